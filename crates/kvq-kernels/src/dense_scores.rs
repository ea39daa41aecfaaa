//! Scores of query rows against a run of f16 keys held transposed (one column per head
//! dimension, `stride` apart), the dense fp16 cache's inner loop: on x86 with AVX2, FMA and F16C
//! a register-tiled kernel (4 rows x 16 keys of accumulators, each key column converted once
//! for the 4 rows and never stored as f32), elsewhere the portable loop it must equal.

use half::f16;

/// Adds `scale * q_i . k_j` to `out[i * n + o + j]` for rows `i < rows` of `q` (`[rows, d]`)
/// and keys `j < m`, key `j`'s element `dd` being `k[dd * stride + j]`.
///
/// Out-of-range arguments (a slice shorter than the shapes say) are a caller's bug: checked
/// once here, they panic before any work.
#[allow(clippy::too_many_arguments)]
pub fn add_scores_f16(
    k: &[f16],
    stride: usize,
    m: usize,
    q: &[f32],
    d: usize,
    scale: f32,
    out: &mut [f32],
    (n, o): (usize, usize),
) {
    let rows = q.len() / d.max(1);
    if rows == 0 || m == 0 || d == 0 {
        return;
    }
    assert!(
        (d - 1) * stride + m <= k.len() && m <= stride && (rows - 1) * n + o + m <= out.len(),
        "add_scores_f16: keys {} / out {} too short for d {d}, stride {stride}, m {m}, rows {rows}",
        k.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
    {
        // SAFETY: the features are present; the bounds were checked above.
        unsafe { x86::add_scores(k, stride, m, q, d, rows, scale, out, (n, o)) };
        return;
    }
    add_scores_portable(k, stride, (0, m), q, d, rows, scale, out, (n, o));
}

/// The portable loop over keys `j0..j1` (also the x86 kernel's tail).
#[allow(clippy::too_many_arguments)]
fn add_scores_portable(
    k: &[f16],
    stride: usize,
    (j0, j1): (usize, usize),
    q: &[f32],
    d: usize,
    rows: usize,
    scale: f32,
    out: &mut [f32],
    (n, o): (usize, usize),
) {
    for i in 0..rows {
        let qi = &q[i * d..(i + 1) * d];
        for j in j0..j1 {
            let mut s = 0f32;
            for (dd, &x) in qi.iter().enumerate() {
                s += x * k[dd * stride + j].to_f32();
            }
            out[i * n + o + j] += scale * s;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::f16;
    use std::arch::x86_64::*;

    /// Keys per tile: two 8-lane vectors.
    const KEYS: usize = 16;

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn add_scores(
        k: &[f16],
        stride: usize,
        m: usize,
        q: &[f32],
        d: usize,
        rows: usize,
        scale: f32,
        out: &mut [f32],
        (n, o): (usize, usize),
    ) {
        let full = m / KEYS * KEYS;
        let mut r0 = 0;
        while r0 < rows {
            let rr = (rows - r0).min(4);
            let qr = &q[r0 * d..(r0 + rr) * d];
            let or = &mut out[r0 * n..];
            // SAFETY (all arms): the caller checked every key column and output row in range.
            unsafe {
                match rr {
                    4 => tile::<4>(k, stride, full, qr, d, scale, or, (n, o)),
                    3 => tile::<3>(k, stride, full, qr, d, scale, or, (n, o)),
                    2 => tile::<2>(k, stride, full, qr, d, scale, or, (n, o)),
                    _ => tile::<1>(k, stride, full, qr, d, scale, or, (n, o)),
                }
            }
            r0 += rr;
        }
        super::add_scores_portable(k, stride, (full, m), q, d, rows, scale, out, (n, o));
    }

    /// `R` rows against keys `0..full` (a multiple of 16), accumulators in registers.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const R: usize>(
        k: &[f16],
        stride: usize,
        full: usize,
        q: &[f32],
        d: usize,
        scale: f32,
        out: &mut [f32],
        (n, o): (usize, usize),
    ) {
        let kp = k.as_ptr() as *const u16;
        let s = _mm256_set1_ps(scale);
        let mut j = 0;
        while j < full {
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            for dd in 0..d {
                // SAFETY: (d - 1) * stride + full <= k.len(), checked by the caller.
                let col = unsafe { kp.add(dd * stride + j) } as *const __m128i;
                let (k0, k1) = unsafe {
                    (
                        _mm256_cvtph_ps(_mm_loadu_si128(col)),
                        _mm256_cvtph_ps(_mm_loadu_si128(col.add(1))),
                    )
                };
                for (r, a) in acc.iter_mut().enumerate() {
                    let qv = _mm256_set1_ps(q[r * d + dd]);
                    a[0] = _mm256_fmadd_ps(qv, k0, a[0]);
                    a[1] = _mm256_fmadd_ps(qv, k1, a[1]);
                }
            }
            for (r, a) in acc.iter().enumerate() {
                let dst = &mut out[r * n + o + j..r * n + o + j + KEYS];
                // SAFETY: `dst` is 16 floats long.
                unsafe {
                    let p = dst.as_mut_ptr();
                    _mm256_storeu_ps(p, _mm256_fmadd_ps(a[0], s, _mm256_loadu_ps(p)));
                    let p = p.add(8);
                    _mm256_storeu_ps(p, _mm256_fmadd_ps(a[1], s, _mm256_loadu_ps(p)));
                }
            }
            j += KEYS;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_equals_portable_loop() {
        let mut seed = 7u64;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        for (d, rows, m, stride) in [
            (64, 3, 128, 256),
            (16, 5, 37, 40),
            (128, 4, 16, 16),
            (8, 9, 3, 5),
        ] {
            let k: Vec<f16> = (0..d * stride).map(|_| f16::from_f32(next())).collect();
            let q: Vec<f32> = (0..rows * d).map(|_| next()).collect();
            let (n, o) = (m + 3, 2);
            let base: Vec<f32> = (0..rows * n).map(|_| next()).collect();
            let mut got = base.clone();
            add_scores_f16(&k, stride, m, &q, d, 0.3, &mut got, (n, o));
            let mut want = base.clone();
            add_scores_portable(&k, stride, (0, m), &q, d, rows, 0.3, &mut want, (n, o));
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "d {d} rows {rows} m {m} at {i}: {a} vs {b}"
                );
            }
            // Untouched outside each row's [o, o + m).
            for i in 0..rows {
                assert_eq!(got[i * n..i * n + o], base[i * n..i * n + o]);
                assert_eq!(
                    got[i * n + o + m..(i + 1) * n],
                    base[i * n + o + m..(i + 1) * n]
                );
            }
        }
    }
}
