//! Attention of a CPU compressed cache, the last step: the compressed op's partial states over
//! each query row's code range merged with exact attention over the fp16 rows that row reads
//! (the sinks `[start, c0)` and the window `[c1, pos]`), row by row. The partial states scored
//! `q . (k - mu)`; the key center's `q . mu` is added back here.

use super::center::KeyCenter;
use super::exact_rows::ExactRows;
use crate::attention::dot;
use crate::traits::CacheGeometry;
use kvq_kernels::{AttendParams, Partial, merge_partial};

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
) -> Vec<f32> {
    let CacheGeometry {
        n_heads,
        n_kv_heads,
        head_dim: d,
        ..
    } = *geom;
    let ((sink_k, recent_k), (sink_v, recent_v)) = (exact.keys(), exact.values());
    let group = n_heads / n_kv_heads;
    let mut out = vec![0f32; n_heads * t * d];
    let empty = {
        let mut e = vec![0f32; d + 2];
        e[d] = f32::NEG_INFINITY;
        e
    };
    let mut row = vec![0f32; d];
    let mut scores = Vec::new();
    let mut at = Vec::new();
    for h in 0..n_heads {
        let kh = h / group;
        for r in 0..t {
            let pos = p.first_pos + r;
            let (start, c0, c1) = p.ranges(pos);
            let qrow = &q[(h * t + r) * d..(h * t + r + 1) * d];
            scores.clear();
            at.clear();
            for j in (start..c0).chain(c1..=pos) {
                let rows = if j < c0 { sink_k } else { recent_k };
                rows.row(kh, j, d, &mut row);
                scores.push(dot(qrow, &row) * p.scale);
                at.push(j);
            }
            let part = match parts {
                Some(all) if c1 > c0 => &all[(h * t + r) * (d + 2)..(h * t + r + 1) * (d + 2)],
                _ => &empty[..],
            };
            let mut part = Partial::from_row(part);
            // The codes scored `q . (k - mu)`; softmax needs `q . k`.
            part.max += p.scale * center.center_score(kh, qrow);
            let value = |i: usize, buf: &mut [f32]| {
                let j = at[i];
                let rows = if j < c0 { sink_v } else { recent_v };
                rows.row(kh, j, d, buf);
            };
            let orow = &mut out[(h * t + r) * d..(h * t + r + 1) * d];
            merge_partial(part, &scores, value, orow);
        }
    }
    out
}
