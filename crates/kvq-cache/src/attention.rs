//! Plain-Rust attention shared by the methods: the exact reference (`attention_reference`), the
//! causal softmax helpers, and the GQA head mapping. The reference is the definition of correct
//! that every method and kernel is tested against.

/// Exact causal attention in f32.
///
/// `q`: `[n_heads, t, d]`, `k` and `v`: `[n_kv_heads, len, d]` (row-major, contiguous). Query row
/// `r` sits at position `len - t + r` and sees keys `0..=len - t + r`, restricted to the last
/// `window` positions when a sliding window is given. Returns `[n_heads, t, d]`.
#[allow(clippy::too_many_arguments)]
pub fn attention_reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n_heads: usize,
    n_kv_heads: usize,
    t: usize,
    len: usize,
    d: usize,
    scale: f32,
    window: Option<usize>,
) -> Vec<f32> {
    let group = n_heads / n_kv_heads;
    let mut out = vec![0f32; n_heads * t * d];
    let mut scores = vec![0f32; len];
    for h in 0..n_heads {
        let kh = h / group;
        for r in 0..t {
            let pos = len - t + r;
            let start = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let qrow = &q[(h * t + r) * d..(h * t + r + 1) * d];
            for (j, s) in scores.iter_mut().enumerate().take(pos + 1).skip(start) {
                let krow = &k[(kh * len + j) * d..(kh * len + j + 1) * d];
                *s = qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f32>() * scale;
            }
            softmax_in_place(&mut scores[start..=pos]);
            let orow = &mut out[(h * t + r) * d..(h * t + r + 1) * d];
            for (j, &p) in scores.iter().enumerate().take(pos + 1).skip(start) {
                let vrow = &v[(kh * len + j) * d..(kh * len + j + 1) * d];
                for (o, x) in orow.iter_mut().zip(vrow) {
                    *o += p * x;
                }
            }
        }
    }
    out
}

/// Numerically stable softmax over a slice, in place.
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for s in x.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    let inv = 1.0 / sum;
    for s in x.iter_mut() {
        *s *= inv;
    }
}

/// Dot product the compiler vectorizes (eight independent accumulators).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        let (x, y) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// `out += p * x`, vectorized.
#[inline]
pub fn axpy(out: &mut [f32], p: f32, x: &[f32]) {
    for (o, v) in out.iter_mut().zip(x) {
        *o += p * v;
    }
}

/// First key position query row `pos` may see under an optional sliding window.
#[inline]
pub fn window_start(pos: usize, window: Option<usize>) -> usize {
    window.map_or(0, |w| (pos + 1).saturating_sub(w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_key_returns_its_value() {
        let q = vec![1.0, 0.0];
        let k = vec![0.5, 0.5];
        let v = vec![3.0, -2.0];
        let out = attention_reference(&q, &k, &v, 1, 1, 1, 1, 2, 1.0, None);
        assert_eq!(out, vec![3.0, -2.0]);
    }

    #[test]
    fn causal_first_row_sees_only_first_key() {
        // two positions, two query rows: row 0 must ignore key 1.
        let q = vec![1.0, 1.0];
        let k = vec![0.0, 100.0];
        let v = vec![1.0, 5.0];
        let out = attention_reference(&q, &k, &v, 1, 1, 2, 2, 1, 1.0, None);
        assert_eq!(out[0], 1.0);
        assert!((out[1] - 5.0).abs() < 1e-3);
    }

    #[test]
    fn window_hides_old_keys() {
        let q = vec![1.0];
        let k = vec![100.0, 0.0];
        let v = vec![7.0, 2.0];
        let out = attention_reference(&q, &k, &v, 1, 1, 1, 2, 1, 1.0, Some(1));
        assert_eq!(out, vec![2.0]);
    }
}
