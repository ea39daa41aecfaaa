//! A compressed cache on a GPU: the fp16 window and sinks live in device buffers beside the
//! codes (`exact_rows.rs` keeps them), and attention never leaves the device. A decode step
//! (one query row) is one fused launch sequence on CUDA: the codes' attention split over the
//! sequence, the fp16 rows as one more split, the key center's logit shift and the merge
//! inside the combine kernel. Prompt chunks (and devices without a fused kernel) take the
//! simpler path: the compressed op's partial states merged with the fp16 rows in tensor ops,
//! masked per query row, in slices that bound the score matrix.

use super::CompressedCache;
use super::exact_rows::Fp16Rows;
use crate::Result;
use candle_core::{D, DType, Tensor};
use kvq_kernels::AttendParams;

/// Bytes a prompt chunk's exact scores may take at once (`[heads, rows, exact rows]` f32).
const SCORE_BYTES: usize = 64 << 20;

impl CompressedCache {
    /// Attention of the last `t` positions' queries `q` (`[heads, t, d]` f32, contiguous, on
    /// the device) with the checked parameters `p`.
    pub(super) fn attend_device(&self, q: &Tensor, t: usize, p: AttendParams) -> Result<Tensor> {
        let (_, c0, c1) = p.ranges(self.len - 1);
        let codes = self.codes.views(self.len)?.filter(|_| c1 > c0);
        #[cfg(feature = "cuda")]
        if t == 1
            && q.device().is_cuda()
            && [64, 128, 256].contains(&self.geom.head_dim)
            && self.codes.keys().kernel_data().is_some()
            && self.codes.values().kernel_data().is_some()
        {
            return self.decode_cuda(q, p, codes);
        }
        let parts = match &codes {
            Some(codes) => Some(self.codes.attend(p, q, codes)?),
            None => None,
        };
        self.merge_tensors(q, parts, t, p)
    }

    /// One decode step on CUDA: the fused kernel over the codes and the fp16 rows the query
    /// reads (sinks `[start, c0)`, window `[c1, pos]`), with the center's shift.
    #[cfg(feature = "cuda")]
    fn decode_cuda(
        &self,
        q: &Tensor,
        p: AttendParams,
        codes: Option<(Tensor, Tensor)>,
    ) -> Result<Tensor> {
        use kvq_kernels::cuda::ops::{decode_attend_shifted, dense_decode_attend};
        let (nh, _, d) = q.dims3()?;
        let pos = self.len - 1;
        let (start, c0, c1) = p.ranges(pos);
        let ((sink_k, recent_k), (sink_v, recent_v)) = (self.exact.keys(), self.exact.values());
        if let Some((kc, vc)) = &codes {
            // One launch over the codes and the fp16 rows in place, when a version-5 kernel
            // takes these codecs.
            let seg = |k: &Fp16Rows, v: &Fp16Rows, from: usize, to: usize| -> Result<_> {
                Ok(
                    match (to > from, k.dev_range(from, to)?, v.dev_range(from, to)?) {
                        (true, Some(k), Some(v)) => Some((k, v)),
                        _ => None,
                    },
                )
            };
            let sinks = seg(sink_k, sink_v, start, c0)?;
            let recent = seg(recent_k, recent_v, c1, pos + 1)?;
            let out = kvq_kernels::cuda::step::decode_fast(
                &**self.codes.keys(),
                &**self.codes.values(),
                p,
                q,
                kc,
                vc,
                [
                    sinks.as_ref().map(|(k, v)| (k, v)),
                    recent.as_ref().map(|(k, v)| (k, v)),
                ],
                self.center.mu_device(),
            )?;
            if let Some(out) = out {
                return Ok(out);
            }
        }
        let exact = |sinks: &Fp16Rows, recent: &Fp16Rows| -> Result<Tensor> {
            let mut parts = Vec::with_capacity(2);
            if c0 > start {
                parts.extend(sinks.dev_range(start, c0)?);
            }
            parts.extend(recent.dev_range(c1, pos + 1)?);
            Ok(Tensor::cat(&parts, 1)?.unsqueeze(0)?)
        };
        let (xk, xv) = (exact(sink_k, recent_k)?, exact(sink_v, recent_v)?);
        let q4 = q.unsqueeze(0)?;
        let out = match codes {
            Some((kc, vc)) => {
                let shift = self
                    .center
                    .shift(q, p.scale)?
                    .map(|s| s.reshape((1, nh)))
                    .transpose()?;
                decode_attend_shifted(
                    &**self.codes.keys(),
                    &**self.codes.values(),
                    p,
                    &q4,
                    &kc.unsqueeze(0)?,
                    &vc.unsqueeze(0)?,
                    (&xk, &xv),
                    shift.as_ref(),
                    true,
                )?
            }
            None => {
                // Every key this query reads is an fp16 row (a sharp layer, an early position).
                let n = xk.dim(2)?;
                let dp = AttendParams {
                    first_pos: n,
                    window: 1,
                    sinks: 0,
                    sliding_window: None,
                    code_first: 0,
                    exact_before: 0,
                    ..p
                };
                dense_decode_attend(dp, &q4, &xk, &xv, true)?
            }
        };
        Ok(out.narrow(3, 0, d)?.reshape((nh, 1, d))?)
    }

    /// The general path: the op's partial states `parts` (`[heads, t, d + 2]`, over each row's
    /// compressed range) merged with exact attention over the fp16 rows, in tensor ops.
    fn merge_tensors(
        &self,
        q: &Tensor,
        parts: Option<Tensor>,
        t: usize,
        p: AttendParams,
    ) -> Result<Tensor> {
        let (nh, kvh, d) = (self.geom.n_heads, self.geom.n_kv_heads, self.geom.head_dim);
        let group = nh / kvh;
        let len = self.len;
        // Exact columns: the sinks' rows `0..ns`, then the recent rows `rf..len`.
        let ns = self.exact.sinks().min(len);
        let rf = (0..t)
            .map(|r| p.ranges(p.first_pos + r).2)
            .min()
            .unwrap_or(len)
            .max(self.exact.first())
            .min(len);
        let cols = |sinks: &Fp16Rows, recent: &Fp16Rows| -> Result<Tensor> {
            let mut v = Vec::with_capacity(2);
            if ns > 0 {
                v.extend(sinks.dev_range(0, ns)?);
            }
            v.extend(recent.dev_range(rf, len)?);
            Ok(Tensor::cat(&v, 1)?.to_dtype(DType::F32)?)
        };
        let ((sink_k, recent_k), (sink_v, recent_v)) = (self.exact.keys(), self.exact.values());
        let (kx, vx) = (cols(sink_k, recent_k)?, cols(sink_v, recent_v)?);
        let nx = kx.dim(1)?;
        let mut mask = vec![f32::NEG_INFINITY; t * nx];
        for (r, row) in mask.chunks_mut(nx.max(1)).enumerate().take(t) {
            let pos = p.first_pos + r;
            let (start, c0, c1) = p.ranges(pos);
            for (j, m) in row.iter_mut().enumerate() {
                let ok = match j < ns {
                    true => (start..c0).contains(&j),
                    false => (c1..=pos).contains(&(rf + j - ns)),
                };
                if ok {
                    *m = 0.0;
                }
            }
        }
        let mask = Tensor::from_vec(mask, (t, nx), q.device())?;
        let shift = self.center.shift(q, p.scale)?;
        let step = (SCORE_BYTES / (4 * nh * nx.max(1))).clamp(1, t);
        let mut outs = Vec::with_capacity(t.div_ceil(step));
        for r0 in (0..t).step_by(step) {
            let n = step.min(t - r0);
            let qs = q.narrow(1, r0, n)?.reshape((kvh, group * n, d))?;
            let s = (qs.matmul(&kx.t()?)? * f64::from(p.scale))?
                .reshape((nh, n, nx))?
                .broadcast_add(&mask.narrow(0, r0, n)?)?;
            let mut m = s.max_keepdim(D::Minus1)?;
            let comp = match &parts {
                Some(all) => {
                    let pr = all.narrow(1, r0, n)?;
                    let mut pm = pr.narrow(2, d, 1)?;
                    if let Some(sh) = &shift {
                        pm = (pm + sh.narrow(1, r0, n)?)?;
                    }
                    m = m.maximum(&pm)?;
                    let wc = pm.broadcast_sub(&m)?.exp()?;
                    Some((
                        pr.narrow(2, 0, d)?.broadcast_mul(&wc)?,
                        (pr.narrow(2, d + 1, 1)? * wc)?,
                    ))
                }
                None => None,
            };
            let e = s.broadcast_sub(&m)?.exp()?;
            let mut num = e
                .reshape((kvh, group * n, nx))?
                .matmul(&vx)?
                .reshape((nh, n, d))?;
            let mut den = e.sum_keepdim(D::Minus1)?;
            if let Some((acc, sum)) = comp {
                num = (num + acc)?;
                den = (den + sum)?;
            }
            outs.push(num.broadcast_div(&den)?);
        }
        Ok(Tensor::cat(&outs, 1)?)
    }
}
