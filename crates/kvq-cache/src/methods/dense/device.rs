//! The dense caches on a GPU: keys and values in two growing device buffers
//! (`[kv heads, capacity, d]` of the cache's dtype), written in place. Decode over fp16 runs a
//! fused decode attention (online softmax, no score matrix): on CUDA kvq's own (a few query
//! rows, split over the sequence), on Metal candle's SDPA vector kernel (one query row); prompt
//! chunks run batched matmuls with a causal mask, in slices of query rows that bound the score
//! matrix.

use super::Element;
use crate::Result;
use crate::attention::window_start;
use crate::rowbuf::{GROW_TOKENS, RowBuf};
use crate::state::{StateReader, state_err};
use crate::traits::{CacheGeometry, CacheState};
use candle_core::{DType, Device, Tensor};

/// Bytes a prompt chunk's scores may take at once (`[heads, rows, positions]` f32) on the CPU
/// and on a GPU. On the GPU each slice costs about ten launches whatever its size: at 32k
/// positions and 32 heads, 64 MiB slices are 16 query rows each.
const SCORE_BYTES: usize = 64 << 20;
const GPU_SCORE_BYTES: usize = 512 << 20;

/// [`super::causal_mask`] built on `dev` from position ramps, never on the host: a 512-row
/// chunk at 32k positions is a 64 MiB mask per layer.
pub(crate) fn causal_mask_on(
    t: usize,
    len: usize,
    from: usize,
    window: Option<usize>,
    dev: &Device,
) -> Result<Tensor> {
    // Positions below 2^24 are exact in f32; beyond that the host mask is used.
    if len >= 1 << 24 {
        return super::causal_mask(t, len, from, window, dev);
    }
    let rows = Tensor::arange((len - t) as u32, len as u32, dev)?
        .to_dtype(DType::F32)?
        .reshape((t, 1))?;
    let keys = Tensor::arange(from as u32, len as u32, dev)?
        .to_dtype(DType::F32)?
        .reshape((1, len - from))?;
    let mut ok = keys.broadcast_le(&rows)?;
    if let Some(w) = window {
        // Key j is seen from row pos when j >= pos + 1 - w.
        let start = (rows + (1.0 - w as f64))?;
        ok = (ok * keys.broadcast_ge(&start)?)?;
    }
    let shape = (t, len - from);
    let zero = Tensor::zeros(shape, DType::F32, dev)?;
    let never = Tensor::full(f32::NEG_INFINITY, shape, dev)?;
    Ok(ok.where_cond(&zero, &never)?)
}

/// Head dims candle's Metal SDPA vector kernels are built for (`candle_metal_kernels::
/// call_sdpa_vector` and its two-pass twin name a kernel for each; 512 too, past what kvq's
/// models use).
#[cfg(feature = "metal")]
const METAL_SDPA_DIMS: [usize; 5] = [32, 64, 96, 128, 256];

/// Keys and values of a dense cache on the device.
pub(super) struct DeviceRows {
    k: RowBuf,
    v: RowBuf,
}

impl DeviceRows {
    pub(super) fn new<E: Element>(geom: &CacheGeometry) -> Self {
        let row = |_| RowBuf::new(geom.n_kv_heads, geom.head_dim, E::DTYPE, GROW_TOKENS);
        Self {
            k: row(()),
            v: row(()),
        }
    }

    /// Writes `k`, `v` (`[kv heads, t, d]`) at positions `len..`; rows before `keep_from` may go.
    pub(super) fn append<E: Element>(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        len: usize,
        keep_from: usize,
    ) -> Result<()> {
        self.k.write(&k.to_dtype(E::DTYPE)?, len, keep_from)?;
        self.v.write(&v.to_dtype(E::DTYPE)?, len, keep_from)?;
        Ok(())
    }

    /// An independent copy (both buffers copied on their device).
    pub(super) fn fork(&self) -> Result<Self> {
        Ok(Self {
            k: self.k.fork()?,
            v: self.v.fork()?,
        })
    }

    /// Writes the rows of positions `first..len` as `k` and `v` (`crate::state::put_rows`).
    pub(super) fn save(&self, state: &mut CacheState, len: usize) -> Result<()> {
        self.k.save(state, "k", len)?;
        self.v.save(state, "v", len)
    }

    /// Device rows on `dev` holding the `k` and `v` rows of positions up to `len` that
    /// [`Self::save`] (or a host cache's save) wrote, with the saved capacity (at most `limit`).
    pub(super) fn restore<E: Element>(
        geom: &CacheGeometry,
        reader: &mut StateReader<'_>,
        (len, limit): (usize, usize),
        dev: &Device,
    ) -> Result<Self> {
        let empty = Self::new::<E>(geom);
        let k = empty.k.restore(reader, "k", (len, limit, true), dev)?;
        let v = empty.v.restore(reader, "v", (len, limit, true), dev)?;
        if k.first != v.first || k.bytes() != v.bytes() {
            return Err(state_err(format!(
                "tensors k and v: keys held from {} ({} bytes), values from {} ({} bytes)",
                k.first,
                k.bytes(),
                v.first,
                v.bytes()
            )));
        }
        Ok(Self { k, v })
    }

    /// The first position still held.
    pub(super) fn first(&self) -> usize {
        self.k.first
    }

    pub(super) fn bytes(&self) -> usize {
        self.k.bytes() + self.v.bytes()
    }

    /// An upper bound on [`Self::bytes`] while at most `held` positions are live.
    pub(super) fn max_bytes(&self, held: usize, rolling: bool) -> usize {
        self.k.max_bytes(held, rolling) + self.v.max_bytes(held, rolling)
    }

    /// Causal attention of the last `t` of `len` positions' queries `q` (`[heads, t, d]` f32).
    pub(super) fn attend(
        &self,
        geom: &CacheGeometry,
        q: &Tensor,
        len: usize,
        scale: f32,
    ) -> Result<Tensor> {
        let (nh, t, d) = q.dims3()?;
        #[cfg(feature = "cuda")]
        if t <= super::DECODE_MAX_ROWS
            && self.k.dtype() == DType::F16
            && q.device().is_cuda()
            && [64, 128, 256].contains(&d)
        {
            return self.decode_cuda(geom, q, len, scale);
        }
        #[cfg(feature = "metal")]
        if t == 1
            && self.k.dtype() == DType::F16
            && q.device().is_metal()
            && METAL_SDPA_DIMS.contains(&d)
        {
            return self.decode_metal(geom, q, len, scale);
        }
        let kvh = geom.n_kv_heads;
        let group = nh / kvh;
        let from = window_start(len - t, geom.sliding_window).max(self.first());
        let (Some(k), Some(v)) = (self.k.range(from, len)?, self.v.range(from, len)?) else {
            return Err(crate::CacheError::Shape("attend before any append".into()));
        };
        let (k, v) = (k.to_dtype(DType::F32)?, v.to_dtype(DType::F32)?);
        let n = len - from;
        let mask = causal_mask_on(t, len, from, geom.sliding_window, q.device())?;
        let budget = match q.device().is_cpu() {
            true => SCORE_BYTES,
            false => GPU_SCORE_BYTES,
        };
        let step = (budget / (4 * nh * n.max(1))).clamp(1, t);
        let mut outs = Vec::with_capacity(t.div_ceil(step));
        for r0 in (0..t).step_by(step) {
            let rows = step.min(t - r0);
            let qs = q.narrow(1, r0, rows)?.reshape((kvh, group * rows, d))?;
            let s = (qs.matmul(&k.t()?)? * f64::from(scale))?
                .reshape((kvh, group, rows, n))?
                .broadcast_add(&mask.narrow(0, r0, rows)?)?;
            let pr = candle_nn::ops::softmax_last_dim(&s)?;
            let o = pr.reshape((kvh, group * rows, n))?.matmul(&v)?;
            outs.push(o.reshape((nh, rows, d))?);
        }
        Ok(Tensor::cat(&outs, 1)?)
    }

    /// One query row over fp16 on Metal: candle's fused SDPA vector kernel (online softmax,
    /// two passes over the sequence from 1024 positions, GQA without tiling the keys), reading
    /// the held rows in place: the kernel takes the kv-head stride of the view
    /// (`[1, kv heads, positions, d]` of the `[kv heads, capacity, d]` buffer) and rows `d`
    /// apart. The row is the last position, so every position from the window's start is
    /// visible and no mask is needed.
    #[cfg(feature = "metal")]
    fn decode_metal(
        &self,
        geom: &CacheGeometry,
        q: &Tensor,
        len: usize,
        scale: f32,
    ) -> Result<Tensor> {
        let (nh, _, d) = q.dims3()?;
        let from = window_start(len - 1, geom.sliding_window).max(self.first());
        let (Some(k), Some(v)) = (self.k.range(from, len)?, self.v.range(from, len)?) else {
            return Err(crate::CacheError::Shape("attend before any append".into()));
        };
        let q16 = q.to_dtype(DType::F16)?.unsqueeze(0)?;
        let out = candle_nn::ops::sdpa(
            &q16,
            &k.unsqueeze(0)?,
            &v.unsqueeze(0)?,
            None,
            false,
            scale,
            1.0,
        )?;
        Ok(out.to_dtype(DType::F32)?.reshape((nh, 1, d))?)
    }

    /// The fused fp16 decode kernel: each query row at position `pos` reads positions
    /// `[window start, pos]`, which the kernel's ranges give for a row placed at `pos + 1`
    /// with a window of one (every row before it "compressed") and a sliding window one longer.
    #[cfg(feature = "cuda")]
    fn decode_cuda(
        &self,
        geom: &CacheGeometry,
        q: &Tensor,
        len: usize,
        scale: f32,
    ) -> Result<Tensor> {
        let (nh, t, d) = q.dims3()?;
        let (Some(k), Some(v)) = (self.k.view(len)?, self.v.view(len)?) else {
            return Err(crate::CacheError::Shape("attend before any append".into()));
        };
        let p = kvq_kernels::AttendParams {
            scale,
            first_pos: len - t + 1,
            window: 1,
            sinks: 0,
            sliding_window: geom.sliding_window.map(|w| w + 1),
            code_first: self.first(),
            exact_before: 0,
        };
        let out = kvq_kernels::cuda::ops::dense_decode_attend(
            p,
            &q.unsqueeze(0)?,
            &k.unsqueeze(0)?,
            &v.unsqueeze(0)?,
            true,
        )?;
        Ok(out.narrow(3, 0, d)?.reshape((nh, t, d))?)
    }
}
