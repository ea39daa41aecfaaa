//! The encode op: `[heads, t, d]` f32 keys or values to `[heads, t, code_bytes]` packed codes,
//! one row per token and head, rows encoded in parallel.

use crate::codec::{KeyCodec, ValueCodec};
use crate::pool::for_each_row;
use crate::storage::f32_rows;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, bail};
use std::sync::Arc;

/// Rows below this count are encoded on the calling thread (spawning costs more).
const PARALLEL_ROWS: usize = 16;

#[derive(Clone)]
enum Codec {
    Key(Arc<dyn KeyCodec>),
    Value(Arc<dyn ValueCodec>),
}

impl Codec {
    fn dims(&self) -> (usize, usize) {
        match self {
            Codec::Key(c) => (c.head_dim(), c.code_bytes()),
            Codec::Value(c) => (c.head_dim(), c.code_bytes()),
        }
    }

    fn encode(&self, head: usize, x: &[f32], out: &mut [u8]) {
        match self {
            Codec::Key(c) => c.encode(head, x, out),
            Codec::Value(c) => c.encode(head, x, out),
        }
    }
}

struct EncodeOp(Codec);

impl CustomOp1 for EncodeOp {
    fn name(&self) -> &'static str {
        "kvq-encode"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_rows(s, l, "encode input")?;
        let (d, cb) = self.0.dims();
        if x.width != d {
            bail!("encode: rows of {} values, codec expects {d}", x.width)
        }
        let (heads, t) = (x.heads, x.rows);
        let mut out = vec![0u8; heads * t * cb];
        for_each_row(&mut out, cb, PARALLEL_ROWS, |i, code| {
            let (h, r) = (i / t.max(1), i % t.max(1));
            self.0.encode(h, x.range(h, r, r + 1), code);
        })?;
        Ok((CpuStorage::U8(out), Shape::from((heads, t, cb))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        match &self.0 {
            Codec::Key(c) => crate::cuda::ops::encode_fwd(Some(&**c), None, s, l),
            Codec::Value(c) => crate::cuda::ops::encode_fwd(None, Some(&**c), s, l),
        }
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        s: &candle_core::MetalStorage,
        l: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        use crate::metal::ops;
        let (k, v) = match &self.0 {
            Codec::Key(c) => (Some(&**c), None),
            Codec::Value(c) => (None, Some(&**c)),
        };
        let d = l.dims().last().copied().unwrap_or(0);
        match ops::encode_has_kernel(k, v, d) && l.is_contiguous() {
            true => ops::encode_fwd(k, v, s, l),
            false => ops::via_cpu(&[s], |h| self.cpu_fwd(&h[0], l)),
        }
    }
}

fn apply(x: &Tensor, op: EncodeOp) -> Result<Tensor> {
    if x.device().is_metal() {
        // The Metal kernels read contiguous rows from the buffer's offset.
        return x.contiguous()?.apply_op1_no_bwd(&op);
    }
    x.apply_op1_no_bwd(&op)
}

/// Encodes keys `[heads, t, d]` (f32) into codes `[heads, t, code_bytes]` (u8).
pub fn encode_keys(codec: &Arc<dyn KeyCodec>, x: &Tensor) -> Result<Tensor> {
    apply(x, EncodeOp(Codec::Key(codec.clone())))
}

/// Encodes values `[heads, t, d]` (f32) into codes `[heads, t, code_bytes]` (u8).
pub fn encode_values(codec: &Arc<dyn ValueCodec>, x: &Tensor) -> Result<Tensor> {
    apply(x, EncodeOp(Codec::Value(codec.clone())))
}

/// The definition the encode op is tested against: each row encoded in order on one thread.
/// `x` is `[heads][t][d]` row-major; returns `[heads][t][code_bytes]`.
pub fn encode_reference(
    encode: impl Fn(usize, &[f32], &mut [u8]),
    x: &[f32],
    heads: usize,
    d: usize,
    code_bytes: usize,
) -> Vec<u8> {
    let t = x.len() / (heads * d).max(1);
    let mut out = vec![0u8; heads * t * code_bytes];
    for h in 0..heads {
        for r in 0..t {
            let row = &x[(h * t + r) * d..(h * t + r + 1) * d];
            encode(
                h,
                row,
                &mut out[(h * t + r) * code_bytes..(h * t + r + 1) * code_bytes],
            );
        }
    }
    out
}
