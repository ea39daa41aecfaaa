//! A compressed cache on a GPU: the fp16 window and sinks live in device buffers beside the
//! codes, and attention never leaves the device. A decode step (one query row) is one fused
//! launch sequence on CUDA: the codes' attention split over the sequence, the fp16 rows as one
//! more split, the key center's logit shift and the merge inside the combine kernel. Prompt
//! chunks (and devices without a fused kernel) take the simpler path: the compressed op's
//! partial states merged with the fp16 rows in tensor ops, masked per query row, in slices that
//! bound the score matrix.

use super::{CompressedCache, Fp16Rows};
use crate::Result;
use crate::rowbuf::RowBuf;
use candle_core::{D, DType, Tensor};
use kvq_kernels::{AttendParams, compressed_attend};

/// Bytes a prompt chunk's exact scores may take at once (`[heads, rows, exact rows]` f32).
const SCORE_BYTES: usize = 64 << 20;

impl CompressedCache {
    /// Moves this (empty) cache's fp16 rows to device buffers: it lives where its first keys
    /// came from.
    pub(super) fn use_device(&mut self) -> Result<()> {
        let (h, d) = (self.geom.n_kv_heads, self.geom.head_dim);
        // The window's buffer grows (and is compacted) a window's length at a time.
        let recent = (self.window + 1)
            .next_power_of_two()
            .clamp(16, crate::rowbuf::GROW_TOKENS);
        let sinks = self.sinks.max(1);
        for (rows, step) in [
            (&mut self.recent_k, recent),
            (&mut self.recent_v, recent),
            (&mut self.sink_k, sinks),
            (&mut self.sink_v, sinks),
        ] {
            *rows = Fp16Rows {
                dev: Some(RowBuf::new(h, d, DType::F16, step)),
                ..Fp16Rows::new(h)
            };
        }
        Ok(())
    }

    /// Appends the fp16 rows of keys `k` and values `v` (`[kv heads, t, d]` f32 on the device)
    /// at positions `len..`, the first `sinks` also as sinks.
    pub(super) fn push_device(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let (len, t) = (self.len, k.dim(1)?);
        let (k16, v16) = (k.to_dtype(DType::F16)?, v.to_dtype(DType::F16)?);
        let keep = self.recent_k.first;
        for (rows, x) in [(&mut self.recent_k, &k16), (&mut self.recent_v, &v16)] {
            if let Some(buf) = &mut rows.dev {
                buf.write(x, len, keep)?;
            }
        }
        let ns = self.sinks.min(len + t).saturating_sub(len);
        if ns > 0 {
            for (rows, x) in [(&mut self.sink_k, &k16), (&mut self.sink_v, &v16)] {
                if let Some(buf) = &mut rows.dev {
                    buf.write(&x.narrow(1, 0, ns)?, len, 0)?;
                }
            }
        }
        Ok(())
    }

    /// Attention of the last `t` positions' queries `q` (`[heads, t, d]` f32, contiguous, on
    /// the device) with the checked parameters `p`.
    pub(super) fn attend_device(&self, q: &Tensor, t: usize, p: AttendParams) -> Result<Tensor> {
        let (_, c0, c1) = p.ranges(self.len - 1);
        let codes = match (
            c1 > c0,
            self.key_codes.view(self.len)?,
            self.val_codes.view(self.len)?,
        ) {
            (true, Some(kc), Some(vc)) => Some((kc, vc)),
            _ => None,
        };
        #[cfg(feature = "cuda")]
        if t == 1
            && q.device().is_cuda()
            && [64, 128, 256].contains(&self.geom.head_dim)
            && self.keys.kernel_data().is_some()
            && self.values.kernel_data().is_some()
        {
            return self.decode_cuda(q, p, codes);
        }
        let parts = match &codes {
            Some((kc, vc)) => Some(compressed_attend(&self.keys, &self.values, p, q, kc, vc)?),
            None => None,
        };
        self.merge_tensors(q, parts, t, p)
    }

    /// `scale * q . mu` per query row, `[heads, t, 1]`, or None for an uncentered cache.
    fn center_shift(&self, q: &Tensor, scale: f32) -> Result<Option<Tensor>> {
        let Some(mu) = &self.mu_dev else {
            return Ok(None);
        };
        let (nh, t, d) = q.dims3()?;
        let kvh = self.geom.n_kv_heads;
        let qs = q.reshape((kvh, nh / kvh * t, d))?;
        Ok(Some(
            (qs.matmul(mu)? * f64::from(scale))?.reshape((nh, t, 1))?,
        ))
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
        let exact = |sinks: &Fp16Rows, recent: &Fp16Rows| -> Result<Tensor> {
            let mut parts = Vec::with_capacity(2);
            if c0 > start
                && let Some(s) = sinks.dev.as_ref().map(|b| b.range(start, c0)).transpose()?
            {
                parts.extend(s);
            }
            if let Some(r) = recent
                .dev
                .as_ref()
                .map(|b| b.range(c1, pos + 1))
                .transpose()?
            {
                parts.extend(r);
            }
            Ok(Tensor::cat(&parts, 1)?.unsqueeze(0)?)
        };
        let (xk, xv) = (
            exact(&self.sink_k, &self.recent_k)?,
            exact(&self.sink_v, &self.recent_v)?,
        );
        let q4 = q.unsqueeze(0)?;
        let out = match codes {
            Some((kc, vc)) => {
                let shift = self
                    .center_shift(q, p.scale)?
                    .map(|s| s.reshape((1, nh)))
                    .transpose()?;
                decode_attend_shifted(
                    &*self.keys,
                    &*self.values,
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
        let ns = self.sinks.min(len);
        let rf = (0..t)
            .map(|r| p.ranges(p.first_pos + r).2)
            .min()
            .unwrap_or(len)
            .max(self.recent_k.first)
            .min(len);
        let cols = |sinks: &Fp16Rows, recent: &Fp16Rows| -> Result<Tensor> {
            let mut v = Vec::with_capacity(2);
            if ns > 0 {
                v.extend(
                    sinks
                        .dev
                        .as_ref()
                        .map(|b| b.range(0, ns))
                        .transpose()?
                        .flatten(),
                );
            }
            v.extend(
                recent
                    .dev
                    .as_ref()
                    .map(|b| b.range(rf, len))
                    .transpose()?
                    .flatten(),
            );
            Ok(Tensor::cat(&v, 1)?.to_dtype(DType::F32)?)
        };
        let (kx, vx) = (
            cols(&self.sink_k, &self.recent_k)?,
            cols(&self.sink_v, &self.recent_v)?,
        );
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
        let shift = self.center_shift(q, p.scale)?;
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
