//! Scores of query rows against a run of f16 keys held transposed (one column per head
//! dimension, `stride` apart), the dense fp16 cache's inner loop: on x86 with AVX2, FMA and F16C
//! a register-tiled kernel (4 rows x 16 keys of accumulators, each key column converted once
//! for the 4 rows and never stored as f32), elsewhere the portable loop it must equal.

use half::f16;

/// A run of `len` keys held transposed: key `j`'s element `dd` is `keys[dd * stride + j]`.
#[derive(Clone, Copy)]
pub struct KeyColumns<'a, T> {
    pub keys: &'a [T],
    pub stride: usize,
    pub len: usize,
}

/// Where scores go: row `i`'s score of key `j` is added to `out[i * row_stride + offset + j]`.
pub struct ScoreRows<'a> {
    pub out: &'a mut [f32],
    pub row_stride: usize,
    pub offset: usize,
}

/// Adds `scale * q_i . k_j` to the scores of rows `q_i` of `q` (`[rows, d]`) and keys `k_j`.
///
/// Out-of-range arguments (a slice shorter than the shapes say) are a caller's bug: checked
/// once here, they panic before any work.
pub fn add_scores_f16(k: KeyColumns<'_, f16>, q: &[f32], d: usize, scale: f32, s: ScoreRows<'_>) {
    let rows = q.len() / d.max(1);
    let (m, stride) = (k.len, k.stride);
    if rows == 0 || m == 0 || d == 0 {
        return;
    }
    assert!(
        (d - 1) * stride + m <= k.keys.len()
            && m <= stride
            && (rows - 1) * s.row_stride + s.offset + m <= s.out.len(),
        "add_scores_f16: keys {} / out {} too short for d {d}, stride {stride}, m {m}, rows {rows}",
        k.keys.len(),
        s.out.len()
    );
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
    {
        // SAFETY: the features are present; the bounds were checked above.
        unsafe { x86::add_scores(k, q, d, scale, s) };
        return;
    }
    add_scores_portable(k, 0, q, d, scale, s);
}

/// The portable loop over keys `from..k.len` (also the x86 kernel's tail).
fn add_scores_portable(
    k: KeyColumns<'_, f16>,
    from: usize,
    q: &[f32],
    d: usize,
    scale: f32,
    s: ScoreRows<'_>,
) {
    let rows = q.len() / d;
    for i in 0..rows {
        let qi = &q[i * d..(i + 1) * d];
        for j in from..k.len {
            let mut acc = 0f32;
            for (dd, &x) in qi.iter().enumerate() {
                acc += x * k.keys[dd * k.stride + j].to_f32();
            }
            s.out[i * s.row_stride + s.offset + j] += scale * acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{KeyColumns, ScoreRows, f16};
    use std::arch::x86_64::*;

    /// Keys per tile: two 8-lane vectors.
    const KEYS: usize = 16;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn add_scores(
        k: KeyColumns<'_, f16>,
        q: &[f32],
        d: usize,
        scale: f32,
        s: ScoreRows<'_>,
    ) {
        let rows = q.len() / d;
        let full = k.len / KEYS * KEYS;
        let mut r0 = 0;
        while r0 < rows {
            let rr = (rows - r0).min(4);
            let qr = &q[r0 * d..(r0 + rr) * d];
            let or = &mut s.out[r0 * s.row_stride..];
            let at = (s.row_stride, s.offset);
            // SAFETY (all arms): the caller checked every key column and output row in range.
            unsafe {
                match rr {
                    4 => tile::<4>(k, full, qr, d, scale, or, at),
                    3 => tile::<3>(k, full, qr, d, scale, or, at),
                    2 => tile::<2>(k, full, qr, d, scale, or, at),
                    _ => tile::<1>(k, full, qr, d, scale, or, at),
                }
            }
            r0 += rr;
        }
        super::add_scores_portable(k, full, q, d, scale, s);
    }

    /// `R` rows against keys `0..full` (a multiple of 16), accumulators in registers; row `r`'s
    /// scores start at `out[r * n + o]`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const R: usize>(
        k: KeyColumns<'_, f16>,
        full: usize,
        q: &[f32],
        d: usize,
        scale: f32,
        out: &mut [f32],
        (n, o): (usize, usize),
    ) {
        let kp = k.keys.as_ptr() as *const u16;
        let s = _mm256_set1_ps(scale);
        let mut j = 0;
        while j < full {
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            for dd in 0..d {
                // SAFETY: (d - 1) * stride + full <= keys.len(), checked by the caller.
                let col = unsafe { kp.add(dd * k.stride + j) } as *const __m128i;
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
            let cols = KeyColumns {
                keys: &k,
                stride,
                len: m,
            };
            let rows_of = |out| ScoreRows {
                out,
                row_stride: n,
                offset: o,
            };
            let mut got = base.clone();
            add_scores_f16(cols, &q, d, 0.3, rows_of(&mut got));
            let mut want = base.clone();
            add_scores_portable(cols, 0, &q, d, 0.3, rows_of(&mut want));
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
