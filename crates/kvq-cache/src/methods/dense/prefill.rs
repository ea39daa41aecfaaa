//! The dense caches' attention for a prompt chunk without a score matrix (flash-attention
//! style): each work item is one kv head and a tile of query positions (all the GQA group's
//! heads for them); it walks the keys its rows can see in spans, scores a span against all its
//! rows at once, folds it into each row's running max, sum and output (online softmax) and
//! drops it. Nothing the size of `[heads, chunk, context]` is allocated: an item holds its
//! rows' scores for one span and their outputs. Items run on candle's CPU pool.

use super::{DenseCache, Element};
use crate::attention::{axpy, window_start};
use crate::traits::CacheGeometry;

/// Query positions per work item: with GQA group g an item scores `g * TILE_POSITIONS` rows per
/// key column it converts.
const TILE_POSITIONS: usize = 16;

/// Keys per span an item scores at once.
const SPAN_TOKENS: usize = 128;

/// One row's online-softmax state over the spans seen so far.
#[derive(Clone, Copy)]
struct RowState {
    max: f32,
    sum: f32,
}

impl<E: Element> DenseCache<E> {
    /// Exact attention for the last `t` positions' queries `q` (`[n_heads, t, d]`), returning
    /// `[n_heads, t, d]`.
    pub(super) fn attend_tiled(&self, q: &[f32], t: usize, scale: f32) -> crate::Result<Vec<f32>> {
        let CacheGeometry {
            n_heads,
            n_kv_heads,
            head_dim: d,
            ..
        } = self.geom;
        let group = n_heads / n_kv_heads;
        let tiles = t.div_ceil(TILE_POSITIONS);
        let width = group * TILE_POSITIONS * d;
        let mut items = vec![0f32; n_kv_heads * tiles * width];
        kvq_kernels::for_each_row(&mut items, width, 2, |item, out| {
            let (kh, tile) = (item / tiles, item % tiles);
            let p0 = tile * TILE_POSITIONS;
            let p1 = (p0 + TILE_POSITIONS).min(t);
            self.attend_tile(kh, q, t, (p0, p1), scale, out);
        })?;
        // Item rows are (group head, position in tile); scatter them to [n_heads, t, d].
        let mut out = vec![0f32; n_heads * t * d];
        for kh in 0..n_kv_heads {
            for tile in 0..tiles {
                let item = &items[(kh * tiles + tile) * width..][..width];
                let p0 = tile * TILE_POSITIONS;
                let n = (p0 + TILE_POSITIONS).min(t) - p0;
                for g in 0..group {
                    let head = kh * group + g;
                    let src = &item[g * n * d..(g + 1) * n * d];
                    out[(head * t + p0) * d..][..n * d].copy_from_slice(src);
                }
            }
        }
        Ok(out)
    }

    /// Query positions `p0..p1` (of the chunk's `t`) of kv head `kh`'s group against every key
    /// they see; writes the normalized outputs to `out` as `[group, p1 - p0, d]`.
    fn attend_tile(
        &self,
        kh: usize,
        q: &[f32],
        t: usize,
        (p0, p1): (usize, usize),
        scale: f32,
        out: &mut [f32],
    ) {
        let d = self.geom.head_dim;
        let group = self.geom.n_heads / self.geom.n_kv_heads;
        let n = p1 - p0;
        let rows = group * n;
        // Row g * n + r is query head kh * group + g at chunk position p0 + r.
        let mut qt = vec![0f32; rows * d];
        for g in 0..group {
            let head = kh * group + g;
            qt[g * n * d..(g + 1) * n * d].copy_from_slice(&q[(head * t + p0) * d..][..n * d]);
        }
        let base = self.len - t;
        let range = |i: usize| {
            let pos = base + p0 + i % n;
            (window_start(pos, self.geom.sliding_window), pos + 1)
        };
        let first = (0..rows).map(|i| range(i).0).min().unwrap_or(0);
        let last = base + p1;
        let acc = &mut out[..rows * d];
        acc.fill(0.0);
        let mut state = vec![
            RowState {
                max: f32::NEG_INFINITY,
                sum: 0.0
            };
            rows
        ];
        let mut scores = vec![0f32; rows * SPAN_TOKENS];
        let mut scratch = vec![0f32; SPAN_TOKENS.min(super::BLOCK_TOKENS) * d];
        let mut seen = vec![(0usize, 0usize); rows];
        let mut lo = first;
        while lo < last {
            let hi = (lo + SPAN_TOKENS).min(last);
            let m = hi - lo;
            let s = &mut scores[..rows * m];
            s.fill(0.0);
            self.add_scores(kh, &qt, (lo, hi), scale, s);
            for i in 0..rows {
                let (start, end) = range(i);
                let (a, b) = (start.clamp(lo, hi) - lo, end.clamp(lo, hi) - lo);
                seen[i] = (a, b.max(a));
                if a >= b {
                    continue;
                }
                let row = &mut s[i * m..(i + 1) * m];
                let span_max = row[a..b].iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let st = &mut state[i];
                if span_max > st.max {
                    // Rescale what the row holds to the new max (exp(-inf) = 0 the first time).
                    let c = (st.max - span_max).exp();
                    st.sum *= c;
                    acc[i * d..(i + 1) * d].iter_mut().for_each(|x| *x *= c);
                    st.max = span_max;
                }
                st.sum += kvq_kernels::exp_sub_sum(&mut row[a..b], st.max);
            }
            self.for_each_value_block(kh, lo, hi, &mut scratch, |j, x| {
                let jj = j - lo;
                for (i, &(a, b)) in seen.iter().enumerate() {
                    if jj >= a && jj < b {
                        axpy(&mut acc[i * d..(i + 1) * d], s[i * m + jj], x);
                    }
                }
            });
            lo = hi;
        }
        for (i, st) in state.iter().enumerate() {
            let inv = if st.sum > 0.0 { 1.0 / st.sum } else { 0.0 };
            acc[i * d..(i + 1) * d].iter_mut().for_each(|x| *x *= inv);
        }
    }
}
