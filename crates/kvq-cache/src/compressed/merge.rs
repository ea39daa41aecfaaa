//! Attention of a CPU compressed cache, the last step: the compressed op's partial states over
//! each query row's code range merged with exact attention over the fp16 rows that row reads
//! (the sinks `[start, c0)` and the window `[c1, pos]`). The partial states scored
//! `q . (k - mu)`; the key center's `q . mu` is added back here.
//!
//! The fp16 part runs in tiles, flash-attention style, like the dense cache's prompt path: a
//! work item is one kv head and up to 16 query positions (all the GQA group's heads for them);
//! it walks the fp16 keys its rows see in spans, converts each span once, scores it against
//! all the item's rows, folds it into each row's running max, sum and output (online softmax)
//! and drops it. A prompt chunk of a layer that stays in fp16 (or one attended before the key
//! center is fixed) reads every earlier key this way, so nothing the size of
//! `[heads, chunk, context]` is allocated. Items run on candle's CPU pool.

use super::center::KeyCenter;
use super::exact_rows::{ExactRows, Fp16Rows};
use crate::attention::{axpy, dot};
use crate::tiles::{RowState, TileGrid};
use crate::traits::CacheGeometry;
use kvq_kernels::{AttendParams, Partial};

/// fp16 keys an item converts and scores at once.
const SPAN_TOKENS: usize = 128;

/// Below this many fp16 keys per query row in all, a step attends on the calling thread: a
/// decode step's window is less work than handing it to the pool.
const PARALLEL_MIN_KEYS: usize = 4096;

/// What an item reads from one kind of fp16 rows: per row, the half-open position range.
struct Segment<'a> {
    keys: &'a Fp16Rows,
    values: &'a Fp16Rows,
    ranges: Vec<(usize, usize)>,
}

/// An item's working state, shared by its two segments.
struct Tile<'a> {
    kh: usize,
    d: usize,
    scale: f32,
    /// `[rows][d]` the item's query rows (row g * n + r: group head g at tile position r).
    q: &'a [f32],
    /// `[rows][d]` unnormalized outputs.
    acc: &'a mut [f32],
    state: Vec<RowState>,
    scores: Vec<f32>,
    buf: Vec<f32>,
}

impl Tile<'_> {
    /// Folds every key of `seg` a row sees into that row's state.
    fn fold(&mut self, seg: &Segment<'_>) {
        let d = self.d;
        let live = seg.ranges.iter().filter(|(a, b)| a < b);
        let (Some(first), Some(last)) = (live.clone().map(|r| r.0).min(), live.map(|r| r.1).max())
        else {
            return;
        };
        let rows = seg.ranges.len();
        let mut lo = first;
        while lo < last {
            let hi = (lo + SPAN_TOKENS).min(last);
            let m = hi - lo;
            let keys = &mut self.buf[..m * d];
            seg.keys.rows_f32(self.kh, (lo, hi), d, keys);
            for (i, &(start, end)) in seg.ranges.iter().enumerate() {
                let (a, b) = (start.clamp(lo, hi) - lo, end.clamp(lo, hi) - lo);
                if a >= b {
                    continue;
                }
                let qrow = &self.q[i * d..(i + 1) * d];
                let row = &mut self.scores[i * SPAN_TOKENS..][a..b];
                for (s, k) in row.iter_mut().zip(keys[a * d..b * d].chunks_exact(d)) {
                    *s = dot(qrow, k) * self.scale;
                }
                self.state[i].fold(row, &mut self.acc[i * d..(i + 1) * d]);
            }
            let values = &mut self.buf[..m * d];
            seg.values.rows_f32(self.kh, (lo, hi), d, values);
            for i in 0..rows {
                let (start, end) = seg.ranges[i];
                let (a, b) = (start.clamp(lo, hi) - lo, end.clamp(lo, hi) - lo);
                let acc = &mut self.acc[i * d..(i + 1) * d];
                for jj in a..b {
                    axpy(
                        acc,
                        self.scores[i * SPAN_TOKENS + jj],
                        &values[jj * d..][..d],
                    );
                }
            }
            lo = hi;
        }
    }
}

/// The attention output (`[heads][t][d]`) of queries `q` (`[heads][t][d]`, the last `t`
/// positions, `p.first_pos..`) from the op's partial states `parts` (`[heads][t][d + 2]`, over
/// each row's compressed range; None when no row has one) and the fp16 rows `exact`.
pub(super) fn merge(
    geom: &CacheGeometry,
    exact: &ExactRows,
    center: &KeyCenter,
    q: &[f32],
    parts: Option<&[f32]>,
    t: usize,
    p: AttendParams,
) -> crate::Result<Vec<f32>> {
    let CacheGeometry {
        n_heads,
        n_kv_heads,
        head_dim: d,
        ..
    } = *geom;
    let grid = TileGrid {
        n_heads,
        n_kv_heads,
        t,
        d,
    };
    let group = grid.group();
    let width = grid.item_width();
    let keys_per_row = {
        let (start, c0, c1) = p.ranges(p.first_pos + t - 1);
        (c0 - start) + (p.first_pos + t - c1)
    };
    let min_parallel = match t * keys_per_row < PARALLEL_MIN_KEYS {
        true => usize::MAX,
        false => 2,
    };
    let mut items = vec![0f32; n_kv_heads * grid.tiles() * width];
    kvq_kernels::for_each_row(&mut items, width, min_parallel, |item, out| {
        let (kh, p0, n) = grid.item(item);
        let rows = group * n;
        let qt = grid.gather_queries(q, (kh, p0, n));
        let ranges: Vec<_> = (0..rows)
            .map(|i| p.ranges(p.first_pos + p0 + i % n))
            .collect();
        let ((sink_k, recent_k), (sink_v, recent_v)) = (exact.keys(), exact.values());
        let sinks = Segment {
            keys: sink_k,
            values: sink_v,
            ranges: ranges.iter().map(|&(start, c0, _)| (start, c0)).collect(),
        };
        let recent = Segment {
            keys: recent_k,
            values: recent_v,
            ranges: (0..rows)
                .map(|i| (ranges[i].2, p.first_pos + p0 + i % n + 1))
                .collect(),
        };
        let (acc, _) = out.split_at_mut(rows * d);
        let mut tile_state = Tile {
            kh,
            d,
            scale: p.scale,
            q: &qt,
            acc,
            state: vec![RowState::EMPTY; rows],
            scores: vec![0f32; rows * SPAN_TOKENS],
            buf: vec![0f32; SPAN_TOKENS * d],
        };
        tile_state.fold(&sinks);
        tile_state.fold(&recent);
        let Tile { acc, state, .. } = tile_state;
        for (i, st) in state.iter().enumerate() {
            let (g, r) = (i / n, i % n);
            let head = kh * group + g;
            let (_, c0, c1) = ranges[i];
            let part = match parts {
                Some(all) if c1 > c0 => {
                    let at = (head * t + p0 + r) * (d + 2);
                    Some(Partial::from_row(&all[at..at + d + 2]))
                }
                _ => None,
            };
            let qrow = &qt[i * d..(i + 1) * d];
            finish_row(st, &mut acc[i * d..(i + 1) * d], part, || {
                // The codes scored `q . (k - mu)`; softmax needs `q . k`.
                p.scale * center.center_score(kh, qrow)
            });
        }
    })?;
    Ok(grid.scatter(&items))
}

/// Merges a row's fp16 state (`st`, unnormalized output in `acc`) with the codes' partial
/// state, whose max is shifted by `center_shift()`, and normalizes `acc` into the output.
fn finish_row(
    st: &RowState,
    acc: &mut [f32],
    part: Option<Partial<'_>>,
    center_shift: impl FnOnce() -> f32,
) {
    let mut total = st.sum;
    if let Some(part) = part.filter(|p| p.sum > 0.0) {
        let pmax = part.max + center_shift();
        let (wx, wp) = match st.sum > 0.0 {
            true => {
                let m = pmax.max(st.max);
                ((st.max - m).exp(), (pmax - m).exp())
            }
            false => (0.0, 1.0),
        };
        total = st.sum * wx + part.sum * wp;
        for (a, &o) in acc.iter_mut().zip(part.out) {
            *a = *a * wx + o * wp;
        }
    }
    let inv = if total > 0.0 { 1.0 / total } else { 0.0 };
    acc.iter_mut().for_each(|a| *a *= inv);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::{gauss, rel_err};
    use kvq_kernels::merge_partial;

    /// The plain per-row merge the tiles must equal: each row's fp16 scores gathered one key at
    /// a time, merged with its partial state by `merge_partial`.
    #[allow(clippy::too_many_arguments)]
    fn merge_reference(
        geom: &CacheGeometry,
        exact: &ExactRows,
        q: &[f32],
        parts: Option<&[f32]>,
        t: usize,
        p: AttendParams,
    ) -> Vec<f32> {
        let (n_heads, d) = (geom.n_heads, geom.head_dim);
        let group = n_heads / geom.n_kv_heads;
        let ((sink_k, recent_k), (sink_v, recent_v)) = (exact.keys(), exact.values());
        let row_of = |rows: &Fp16Rows, kh: usize, j: usize| {
            let mut out = vec![0f32; d];
            rows.rows_f32(kh, (j, j + 1), d, &mut out);
            out
        };
        let mut empty = vec![0f32; d + 2];
        empty[d] = f32::NEG_INFINITY;
        let mut out = vec![0f32; n_heads * t * d];
        for h in 0..n_heads {
            let kh = h / group;
            for r in 0..t {
                let pos = p.first_pos + r;
                let (start, c0, c1) = p.ranges(pos);
                let qrow = &q[(h * t + r) * d..(h * t + r + 1) * d];
                let at: Vec<usize> = (start..c0).chain(c1..=pos).collect();
                let scores: Vec<f32> = at
                    .iter()
                    .map(|&j| {
                        let rows = if j < c0 { sink_k } else { recent_k };
                        dot(qrow, &row_of(rows, kh, j)) * p.scale
                    })
                    .collect();
                let part = match parts {
                    Some(all) if c1 > c0 => &all[(h * t + r) * (d + 2)..][..d + 2],
                    _ => &empty[..],
                };
                let value = |i: usize, buf: &mut [f32]| {
                    let j = at[i];
                    let rows = if j < c0 { sink_v } else { recent_v };
                    buf.copy_from_slice(&row_of(rows, kh, j));
                };
                let orow = &mut out[(h * t + r) * d..(h * t + r + 1) * d];
                merge_partial(Partial::from_row(part), &scores, value, orow);
            }
        }
        out
    }

    /// Tiles (several per chunk, spans past 128 keys, GQA) against the per-row reference: with
    /// every key in fp16 (before the center is fixed), and with a window, sinks, a sliding
    /// window and partial states over the codes between them (some rows with none).
    #[test]
    fn tiles_match_the_per_row_merge() {
        let geom = CacheGeometry {
            n_heads: 6,
            n_kv_heads: 2,
            head_dim: 64,
            sliding_window: None,
            max_tokens: 4096,
        };
        let (kvh, d) = (geom.n_kv_heads, geom.head_dim);
        let cases = [
            // (len, t, window, sinks, sliding, exact_before)
            (300, 37, 16, 4, None, usize::MAX),
            (300, 37, 24, 4, None, 0),
            (400, 70, 40, 0, Some(200), 0),
            (260, 1, 32, 8, None, 0),
            (20, 20, 8, 4, None, 10),
        ];
        for (case, &(len, t, window, sinks, sliding, exact_before)) in cases.iter().enumerate() {
            let seed = 100 * case as u64;
            let mut exact = ExactRows::new(kvh, d, window, sinks);
            let (kd, vd) = (gauss(kvh * len * d, seed), gauss(kvh * len * d, seed + 1));
            exact.push_host(&kd, &vd, 0, len);
            let q = gauss(geom.n_heads * t * d, seed + 2);
            let mut parts = gauss(geom.n_heads * t * (d + 2), seed + 3);
            for (i, row) in parts.chunks_exact_mut(d + 2).enumerate() {
                row[d] = row[d].abs() * 2.0;
                // Every fifth row's codes hold nothing (an empty partial state).
                row[d + 1] = if i % 5 == 0 {
                    0.0
                } else {
                    1.0 + row[d + 1].abs() * 10.0
                };
            }
            let p = AttendParams {
                scale: 0.125,
                first_pos: len - t,
                window,
                sinks,
                sliding_window: sliding,
                code_first: 0,
                exact_before,
            };
            let geom = CacheGeometry {
                sliding_window: sliding,
                ..geom
            };
            let center = KeyCenter::new(geom, sinks);
            let got = merge(&geom, &exact, &center, &q, Some(&parts), t, p).expect("merge");
            let want = merge_reference(&geom, &exact, &q, Some(&parts), t, p);
            let err = rel_err(&got, &want);
            assert!(err < 1e-5, "case {case}: relative error {err}");
            let got = merge(&geom, &exact, &center, &q, None, t, p).expect("merge");
            let want = merge_reference(&geom, &exact, &q, None, t, p);
            let err = rel_err(&got, &want);
            assert!(
                err < 1e-5,
                "case {case} without codes: relative error {err}"
            );
        }
    }
}
