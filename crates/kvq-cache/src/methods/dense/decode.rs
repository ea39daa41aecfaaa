//! The dense caches' decode attention on every core: each kv head's live positions are cut into
//! spans, each span is scored against all the query rows of its GQA group and accumulated under
//! its own softmax state (flash-decoding), the spans run on candle's CPU pool, and their states
//! are merged per row. Each key column and value row is read once per span for all the rows
//! (`DenseCache::add_scores`, `for_each_value_block`).

use super::{DenseCache, Element};
use crate::attention::{axpy, window_start};
use crate::traits::CacheGeometry;

/// Positions per span: one span's keys and values (f32) stay in L1/L2 while its rows use them.
const SPAN_TOKENS: usize = 128;

/// Below this many (row, key) dot products per layer the spans run on the calling thread: the
/// pool's hand-off would cost more than the second core saves.
const PARALLEL_DOTS: usize = 2048;

impl<E: Element> DenseCache<E> {
    /// Exact attention for a few query rows `q` (`[n_heads, t, d]`), returning `[n_heads, t, d]`.
    pub(super) fn attend_rows(&self, q: &[f32], t: usize, scale: f32) -> crate::Result<Vec<f32>> {
        let CacheGeometry {
            n_heads,
            n_kv_heads,
            head_dim: d,
            sliding_window,
            ..
        } = self.geom;
        let group = n_heads / n_kv_heads;
        let rows = group * t;
        let len = self.len;
        // Row `i` of a group is query head `kh * group + i / t`, position `len - t + i % t`.
        let range = |i: usize| {
            let pos = len - t + i % t;
            (window_start(pos, sliding_window), pos)
        };
        let first = (0..rows).map(|i| range(i).0).min().unwrap_or(0);
        let spans = (len - first).div_ceil(SPAN_TOKENS).max(1);
        let width = rows * (d + 2);
        let mut parts = vec![0f32; n_kv_heads * spans * width];
        let min_parallel = match rows * (len - first) * n_kv_heads >= PARALLEL_DOTS {
            true => 2,
            false => usize::MAX,
        };
        kvq_kernels::for_each_row(&mut parts, width, min_parallel, |item, part| {
            let (kh, s) = (item / spans, item % spans);
            let lo = first + s * SPAN_TOKENS;
            let hi = (lo + SPAN_TOKENS).min(len);
            let qg = &q[kh * rows * d..(kh + 1) * rows * d];
            self.attend_span(kh, qg, (lo, hi), &range, scale, part);
        })?;
        let mut out = vec![0f32; n_heads * t * d];
        for kh in 0..n_kv_heads {
            let head_parts = &parts[kh * spans * width..(kh + 1) * spans * width];
            for i in 0..rows {
                let o = &mut out[(kh * rows + i) * d..(kh * rows + i + 1) * d];
                merge_rows(
                    head_parts
                        .chunks_exact(width)
                        .map(|p| &p[i * (d + 2)..][..d + 2]),
                    o,
                );
            }
        }
        Ok(out)
    }

    /// One span `[lo, hi)` of kv head `kh` against its group's rows `qg` (`[rows, d]`): writes
    /// per row the unnormalized output, the max score and the sum of exponentials (`d + 2`
    /// values; max -inf and sum 0 where the row sees none of the span).
    fn attend_span(
        &self,
        kh: usize,
        qg: &[f32],
        (lo, hi): (usize, usize),
        range: &dyn Fn(usize) -> (usize, usize),
        scale: f32,
        part: &mut [f32],
    ) {
        let d = self.geom.head_dim;
        let n = hi - lo;
        let rows = qg.len() / d;
        // Every row's scores over the whole span (key columns read once for all rows), then
        // each row keeps only the positions it sees: `[a, b)` of the span.
        let mut scores = vec![0f32; rows * n];
        self.add_scores(kh, qg, (lo, hi), scale, &mut scores);
        let mut seen = Vec::with_capacity(rows);
        for i in 0..rows {
            let (start, pos) = range(i);
            let a = start.clamp(lo, hi) - lo;
            let b = (pos + 1).clamp(lo, hi) - lo;
            let s = &mut scores[i * n..(i + 1) * n];
            let p = &mut part[i * (d + 2)..(i + 1) * (d + 2)];
            p[..d].fill(0.0);
            if a >= b {
                (p[d], p[d + 1]) = (f32::NEG_INFINITY, 0.0);
                seen.push((0, 0));
                continue;
            }
            let max = s[a..b].iter().copied().fold(f32::NEG_INFINITY, f32::max);
            p[d] = max;
            p[d + 1] = kvq_kernels::exp_sub_sum(&mut s[a..b], max);
            seen.push((a, b));
        }
        let mut scratch = vec![0f32; n.min(super::BLOCK_TOKENS) * d];
        self.for_each_value_block(kh, lo, hi, &mut scratch, |j, x| {
            let jj = j - lo;
            for (i, &(a, b)) in seen.iter().enumerate() {
                if jj >= a && jj < b {
                    axpy(
                        &mut part[i * (d + 2)..i * (d + 2) + d],
                        scores[i * n + jj],
                        x,
                    );
                }
            }
        });
    }
}

/// Merges one row's span states (`out[d]`, max, sum each) into its normalized output `o`.
fn merge_rows<'a>(parts: impl Iterator<Item = &'a [f32]> + Clone, o: &mut [f32]) {
    let d = o.len();
    let max = parts
        .clone()
        .map(|p| p[d])
        .fold(f32::NEG_INFINITY, f32::max);
    o.fill(0.0);
    let mut total = 0f32;
    for p in parts {
        if p[d + 1] > 0.0 {
            let w = (p[d] - max).exp();
            total += w * p[d + 1];
            axpy(o, w, &p[..d]);
        }
    }
    let inv = if total > 0.0 { 1.0 / total } else { 0.0 };
    o.iter_mut().for_each(|x| *x *= inv);
}
