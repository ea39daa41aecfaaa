//! A vectorizable `exp` for softmax: `x <- exp(x - max)` over a slice, written branch-free so
//! the compiler vectorizes it (the library `expf` is a scalar call per score, about a third of
//! a compressed decode step on one thread).

/// `exp(x)` for `x <= 0` (softmax arguments), relative error below 2e-7; underflows to 0 below
/// about -87.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so n * ln2 is exact enough.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = x.max(-87.0);
    let n = (x * LOG2E).round();
    let r = x - n * LN2_HI - n * LN2_LO;
    // exp(r) on |r| <= ln2 / 2: Taylor to degree 7 (truncation < 1e-8 relative).
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // 2^n through the exponent bits (n >= -126 here).
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    p * scale
}

/// `x[i] <- exp(x[i] - max)` for every i, returning the sum; `max` must be >= every x[i].
pub fn exp_sub_sum(x: &mut [f32], max: f32) -> f32 {
    let mut sums = [0f32; 16];
    let mut chunks = x.chunks_exact_mut(16);
    for c in &mut chunks {
        for (v, s) in c.iter_mut().zip(sums.iter_mut()) {
            *v = exp_nonpositive(*v - max);
            *s += *v;
        }
    }
    let mut total: f32 = sums.iter().sum();
    for v in chunks.into_remainder() {
        *v = exp_nonpositive(*v - max);
        total += *v;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_library_exp() {
        let mut worst = 0f32;
        let mut x = -90.0f32;
        while x <= 0.0 {
            let (a, b) = (exp_nonpositive(x), x.exp());
            if b > 1e-30 {
                worst = worst.max((a - b).abs() / b);
            } else {
                assert!(a < 1e-30, "{x}: {a}");
            }
            x += 0.0137;
        }
        assert!(worst < 2e-7, "worst relative error {worst}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
    }

    #[test]
    fn exp_sub_sum_is_softmax_numerator() {
        let mut x: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin() * 9.0).collect();
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let want: Vec<f32> = x.iter().map(|v| (v - max).exp()).collect();
        let sum = exp_sub_sum(&mut x, max);
        for (a, b) in x.iter().zip(&want) {
            assert!((a - b).abs() <= 2e-7 * b.max(1e-30), "{a} vs {b}");
        }
        assert!((sum - want.iter().sum::<f32>()).abs() < 1e-5 * sum);
    }
}
