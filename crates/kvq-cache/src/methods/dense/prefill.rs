//! The dense caches' attention for a prompt chunk without a score matrix (flash-attention
//! style): each work item is one kv head and a tile of query positions (all the GQA group's
//! heads for them); it walks the keys its rows can see in spans, scores a span against all its
//! rows at once, folds it into each row's running max, sum and output (online softmax) and
//! drops it. Nothing the size of `[heads, chunk, context]` is allocated: an item holds its
//! rows' scores for one span and their outputs. Items run on candle's CPU pool.

use super::{DenseCache, Element};
use crate::attention::{axpy, window_start};
use crate::tiles::{RowState, TileGrid};
use crate::traits::CacheGeometry;

/// Keys per span an item scores at once.
const SPAN_TOKENS: usize = 128;

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
        let grid = TileGrid {
            n_heads,
            n_kv_heads,
            t,
            d,
        };
        let width = grid.item_width();
        let mut items = vec![0f32; n_kv_heads * grid.tiles() * width];
        kvq_kernels::for_each_row(&mut items, width, 2, |item, out| {
            let (kh, p0, n) = grid.item(item);
            let qt = grid.gather_queries(q, (kh, p0, n));
            self.attend_tile(kh, &qt, t, (p0, p0 + n), scale, out);
        })?;
        Ok(grid.scatter(&items))
    }

    /// Query rows `qt` (`[group * n][d]`, see [`TileGrid::gather_queries`]) of positions
    /// `p0..p1` (of the chunk's `t`) of kv head `kh`'s group against every key they see;
    /// writes the normalized outputs to `out` as `[group, p1 - p0, d]`.
    fn attend_tile(
        &self,
        kh: usize,
        qt: &[f32],
        t: usize,
        (p0, p1): (usize, usize),
        scale: f32,
        out: &mut [f32],
    ) {
        let d = self.geom.head_dim;
        let group = self.geom.n_heads / self.geom.n_kv_heads;
        let n = p1 - p0;
        let rows = group * n;
        let base = self.len - t;
        let range = |i: usize| {
            let pos = base + p0 + i % n;
            (window_start(pos, self.geom.sliding_window), pos + 1)
        };
        let first = (0..rows).map(|i| range(i).0).min().unwrap_or(0);
        let last = base + p1;
        let acc = &mut out[..rows * d];
        acc.fill(0.0);
        let mut state = vec![RowState::EMPTY; rows];
        let mut scores = vec![0f32; rows * SPAN_TOKENS];
        let mut scratch = vec![0f32; SPAN_TOKENS.min(super::BLOCK_TOKENS) * d];
        let mut seen = vec![(0usize, 0usize); rows];
        let mut lo = first;
        while lo < last {
            let hi = (lo + SPAN_TOKENS).min(last);
            let m = hi - lo;
            let s = &mut scores[..rows * m];
            s.fill(0.0);
            self.add_scores(kh, qt, (lo, hi), scale, s);
            for i in 0..rows {
                let (start, end) = range(i);
                let (a, b) = (start.clamp(lo, hi) - lo, end.clamp(lo, hi) - lo);
                seen[i] = (a, b.max(a));
                if a < b {
                    state[i].fold(&mut s[i * m..][a..b], &mut acc[i * d..(i + 1) * d]);
                }
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
