//! The fused compressed-attention op: for every query row, score the compressed key codes,
//! softmax and accumulate the values straight from their codes, in one pass per row. The result
//! is a partial softmax state (unnormalized output, running max, sum of exponentials) over the
//! compressed positions only; the cache merges it with its fp16 rows with [`merge_partial`].

use crate::codec::{KeyCodec, ValueCodec};
use crate::pool::for_each_row;
use crate::storage::{f32_rows, u8_rows};
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor, bail};
use std::sync::Arc;

/// Where each query row's compressed positions lie.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttendParams {
    /// Softmax scale (1/sqrt(d) usually).
    pub scale: f32,
    /// Position of query row 0 (row r sits at `first_pos + r`).
    pub first_pos: usize,
    /// fp16 recent window: a query at p reads keys in `(p - window, p]` from fp16.
    pub window: usize,
    /// The first `sinks` positions are read from fp16.
    pub sinks: usize,
    /// Sliding attention window of the layer, if any.
    pub sliding_window: Option<usize>,
    /// Position of code row 0: a rolling cache drops the rows no query can reach any more (they
    /// left the sliding window), so row `i` holds position `code_first + i`.
    pub code_first: usize,
    /// Queries at positions below this read every key they attend from fp16: the cache fixes
    /// its key center from the keys up to here, so their codes are not final before.
    pub exact_before: usize,
}

impl AttendParams {
    /// The compressed range `[c0, c1)` of the query at position `pos`, and the first position it
    /// attends at all.
    pub fn ranges(&self, pos: usize) -> (usize, usize, usize) {
        let start = self
            .sliding_window
            .map_or(0, |w| (pos + 1).saturating_sub(w));
        let c1 = match pos < self.exact_before {
            true => self.sinks.max(start).min(pos + 1),
            false => (pos + 1).saturating_sub(self.window.max(1)).max(start),
        };
        let c0 = self.sinks.max(start).min(c1);
        (start, c0, c1)
    }

    /// The code rows `[r0, r1)` of the query at position `pos`: its compressed range relative to
    /// `code_first` (empty when the range is).
    pub fn code_rows(&self, pos: usize) -> (usize, usize) {
        let (_, c0, c1) = self.ranges(pos);
        if c1 <= c0 {
            return (0, 0);
        }
        (
            c0.saturating_sub(self.code_first),
            c1.saturating_sub(self.code_first),
        )
    }
}

/// The partial softmax state of one row: `out` = sum_j exp(s_j - max) v_j (unnormalized),
/// `max`, and `sum` = sum_j exp(s_j - max). An empty range has max = -inf and sum = 0.
#[derive(Debug, Clone, Copy)]
pub struct Partial<'a> {
    pub out: &'a [f32],
    pub max: f32,
    pub sum: f32,
}

impl<'a> Partial<'a> {
    /// Reads one row of the op's output (`d + 2` values).
    pub fn from_row(row: &'a [f32]) -> Self {
        let d = row.len() - 2;
        Self {
            out: &row[..d],
            max: row[d],
            sum: row[d + 1],
        }
    }
}

/// Merges a compressed partial state with exact fp16 scores: `scores[j]` (already scaled) with
/// value rows given by `value(j, buf)`, writing the normalized attention output to `out`.
pub fn merge_partial(
    part: Partial<'_>,
    scores: &[f32],
    mut value: impl FnMut(usize, &mut [f32]),
    out: &mut [f32],
) {
    let m = scores.iter().copied().fold(part.max, f32::max);
    let wc = if part.sum > 0.0 {
        (part.max - m).exp()
    } else {
        0.0
    };
    let mut total = part.sum * wc;
    for (o, &x) in out.iter_mut().zip(part.out) {
        *o = x * wc;
    }
    let mut row = vec![0f32; out.len()];
    for (j, &s) in scores.iter().enumerate() {
        let p = (s - m).exp();
        total += p;
        value(j, &mut row);
        out.iter_mut().zip(&row).for_each(|(o, v)| *o += p * v);
    }
    let inv = if total > 0.0 { 1.0 / total } else { 0.0 };
    out.iter_mut().for_each(|o| *o *= inv);
}

/// The checks every backend makes before attending: head dims and code widths match the
/// codecs, kv heads divide query heads, and the codes hold the rows the queries need
/// (`k` and `v` are `(heads, rows, width)`). Returns the GQA group size.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_attend(
    keys: &dyn KeyCodec,
    values: &dyn ValueCodec,
    p: &AttendParams,
    nh: usize,
    t: usize,
    d: usize,
    k: (usize, usize, usize),
    v: (usize, usize, usize),
) -> Result<usize> {
    if d != keys.head_dim() || d != values.head_dim() {
        bail!("attend: head_dim {d} does not match the codecs")
    }
    if k.2 != keys.code_bytes() || v.2 != values.code_bytes() {
        bail!("attend: code widths do not match the codecs")
    }
    if k.0 == 0 || !nh.is_multiple_of(k.0) || v.0 != k.0 || v.1 != k.1 {
        bail!("attend: {nh} query heads over {} / {} kv heads", k.0, v.0)
    }
    let last = p.first_pos + t;
    let (_, c0_first, c1_first) = p.ranges(p.first_pos);
    if t > 0 && c1_first > c0_first && c0_first < p.code_first {
        bail!(
            "attend: position {} needs codes from {c0_first}, kept from {}",
            p.first_pos,
            p.code_first
        )
    }
    let (_, r1_last) = p.code_rows(last.saturating_sub(1));
    if t > 0 && r1_last > k.1 {
        bail!("attend: rows need {r1_last} codes, {} given", k.1)
    }
    Ok(nh / k.0)
}

/// Rows times code rows from which the op spreads its rows over candle's pool (below, the
/// calling thread does them all: the hand-off would cost more than the second core saves).
const PARALLEL_WORK: usize = 2048;

struct AttendOp {
    keys: Arc<dyn KeyCodec>,
    values: Arc<dyn ValueCodec>,
    p: AttendParams,
}

/// One row's work on the CPU: prepare the query, score the codes, softmax, accumulate values.
#[allow(clippy::too_many_arguments)]
fn attend_row(op: &AttendOp, kh: usize, q: &[f32], kcodes: &[u8], vcodes: &[u8], out: &mut [f32]) {
    let d = q.len();
    let n = kcodes.len() / op.keys.code_bytes();
    if n == 0 {
        out.fill(0.0);
        out[d] = f32::NEG_INFINITY;
        return;
    }
    let mut state = vec![0f32; op.keys.state_len()];
    op.keys.prepare(kh, q, &mut state);
    let mut s = vec![0f32; n];
    op.keys.scores(kh, &state, kcodes, &mut s);
    let mut max = f32::NEG_INFINITY;
    for x in s.iter_mut() {
        *x *= op.p.scale;
        max = max.max(*x);
    }
    let sum = crate::math::exp_sub_sum(&mut s, max);
    let mut acc = vec![0f32; op.values.acc_len()];
    op.values.accumulate(kh, &s, vcodes, &mut acc);
    op.values.finish(kh, &acc, &mut out[..d]);
    out[d] = max;
    out[d + 1] = sum;
}

impl CustomOp3 for AttendOp {
    fn name(&self) -> &'static str {
        "kvq-compressed-attend"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let q = f32_rows(s1, l1, "attend queries")?;
        let k = u8_rows(s2, l2, "attend key codes")?;
        let v = u8_rows(s3, l3, "attend value codes")?;
        let (nh, t, d) = (q.heads, q.rows, q.width);
        let group = check_attend(
            &*self.keys,
            &*self.values,
            &self.p,
            nh,
            t,
            d,
            (k.heads, k.rows, k.width),
            (v.heads, v.rows, v.width),
        )?;
        let (_, r1_last) = self.p.code_rows((self.p.first_pos + t).saturating_sub(1));
        let mut out = vec![0f32; nh * t * (d + 2)];
        // Parallel when there is real work (long ranges or many rows); decode of a short context
        // stays on the calling thread.
        let rows = nh * t;
        let min_parallel = if rows * r1_last.max(1) >= PARALLEL_WORK {
            2
        } else {
            usize::MAX
        };
        for_each_row(&mut out, d + 2, min_parallel, |i, o| {
            let (h, r) = (i / t, i % t);
            let kh = h / group;
            let (r0, r1) = self.p.code_rows(self.p.first_pos + r);
            attend_row(
                self,
                kh,
                q.range(h, r, r + 1),
                k.range(kh, r0, r1),
                v.range(kh, r0, r1),
                o,
            );
        })?;
        Ok((CpuStorage::F32(out), Shape::from((nh, t, d + 2))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::ops::attend_fwd(&*self.keys, &*self.values, self.p, s1, l1, s2, l2, s3, l3)
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        s1: &candle_core::MetalStorage,
        l1: &Layout,
        s2: &candle_core::MetalStorage,
        l2: &Layout,
        s3: &candle_core::MetalStorage,
        l3: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        use crate::metal::ops;
        let d = l1.dims().last().copied().unwrap_or(0);
        if ops::attend_has_kernel(&*self.keys, &*self.values, d) {
            return ops::attend_fwd(&*self.keys, &*self.values, self.p, s1, l1, s2, l2, s3, l3);
        }
        ops::via_cpu(&[s1, s2, s3], |h| {
            self.cpu_fwd(&h[0], l1, &h[1], l2, &h[2], l3)
        })
    }
}

/// Fused compressed attention. `q`: `[n_heads, t, d]` f32; `kcodes` / `vcodes`:
/// `[n_kv_heads, n, code_bytes]` u8 (views are fine). Returns `[n_heads, t, d + 2]`: per row the
/// partial state over its compressed range (see [`Partial`]).
pub fn compressed_attend(
    keys: &Arc<dyn KeyCodec>,
    values: &Arc<dyn ValueCodec>,
    p: AttendParams,
    q: &Tensor,
    kcodes: &Tensor,
    vcodes: &Tensor,
) -> Result<Tensor> {
    let op = AttendOp {
        keys: keys.clone(),
        values: values.clone(),
        p,
    };
    if q.device().is_metal() {
        // The Metal kernels read contiguous rows from each buffer's offset.
        let (q, k, v) = (q.contiguous()?, kcodes.contiguous()?, vcodes.contiguous()?);
        return q.apply_op3_no_bwd(&k, &v, &op);
    }
    q.apply_op3_no_bwd(kcodes, vcodes, &op)
}

/// The definition `compressed_attend` is tested against: decode every key and value of the row's
/// compressed range to f32, exact dot products, softmax, weighted sum. Same inputs (flat,
/// contiguous `[heads][rows][width]`, row 0 at position `p.code_first`) and output layout as the
/// op.
#[allow(clippy::too_many_arguments)]
pub fn attend_reference(
    keys: &dyn KeyCodec,
    values: &dyn ValueCodec,
    p: AttendParams,
    q: &[f32],
    n_heads: usize,
    kcodes: &[u8],
    vcodes: &[u8],
    n_kv_heads: usize,
) -> Vec<f32> {
    let d = keys.head_dim();
    let (kb, vb) = (keys.code_bytes(), values.code_bytes());
    let t = q.len() / (n_heads * d);
    let n = kcodes.len() / (n_kv_heads * kb);
    let group = n_heads / n_kv_heads;
    let mut out = vec![0f32; n_heads * t * (d + 2)];
    let (mut kr, mut vr) = (vec![0f32; d], vec![0f32; d]);
    for h in 0..n_heads {
        let kh = h / group;
        for r in 0..t {
            let qrow = &q[(h * t + r) * d..(h * t + r + 1) * d];
            let (r0, r1) = p.code_rows(p.first_pos + r);
            let mut s: Vec<f32> = (r0..r1)
                .map(|j| {
                    let at = (kh * n + j) * kb;
                    keys.decode(kh, &kcodes[at..at + kb], &mut kr);
                    qrow.iter().zip(&kr).map(|(a, b)| a * b).sum::<f32>() * p.scale
                })
                .collect();
            let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let o = &mut out[(h * t + r) * (d + 2)..(h * t + r + 1) * (d + 2)];
            let mut sum = 0f32;
            for (x, j) in s.iter_mut().zip(r0..r1) {
                *x = (*x - max).exp();
                sum += *x;
                let at = (kh * n + j) * vb;
                values.decode(kh, &vcodes[at..at + vb], &mut vr);
                o[..d].iter_mut().zip(&vr).for_each(|(a, b)| *a += *x * b);
            }
            o[d] = max;
            o[d + 1] = sum;
        }
    }
    out
}
