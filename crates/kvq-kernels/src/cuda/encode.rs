//! Launching the encode kernels (one block of head_dim threads per row; ceil(m / 32) per row for
//! sign sketches) and the fused nearest-centroid search on CUDA.

use super::{EncodeArgs, EncodeParams, check_launch, drv, function, sm_count};
use candle_core::cuda_backend::CudaDevice;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::{Result, bail};

/// Where an encode launch writes: row i (of kv head `i / t`) at `addr + (i / t) * h_stride +
/// (i % t) * cb` bytes, and the center subtracted from its input rows (0: none).
#[derive(Debug, Clone, Copy)]
pub struct EncodeDst {
    pub addr: u64,
    pub h_stride: i64,
    pub mu: u64,
}

/// Encodes `rows` rows of `d` f32 at `x` (row i belongs to kv head `i / t`) into `rows * cb`
/// code bytes.
pub fn launch_encode(
    dev: &CudaDevice,
    params: &EncodeParams,
    d: usize,
    x: u64,
    rows: usize,
    t: usize,
    cb: usize,
) -> Result<CudaSlice<u8>> {
    let stream = dev.cuda_stream();
    // SAFETY: every byte of every row is written by the kernel (each family writes its whole
    // code row) before anything reads it.
    let out = unsafe { dev.alloc::<u8>((rows * cb).max(1))? };
    super::poison(&out, &stream)?;
    let dst = EncodeDst {
        addr: super::address(&out, &stream, 0),
        h_stride: (t.max(1) * cb) as i64,
        mu: 0,
    };
    launch_encode_into(dev, params, d, x, rows, t, cb, dst)?;
    Ok(out)
}

/// Encodes `rows` rows of `d` f32 at `x` (row i belongs to kv head `i / t`) into the code rows
/// at `dst` (a cache's buffer, written in place), centered by `dst.mu` when it is set.
#[allow(clippy::too_many_arguments)]
pub fn launch_encode_into(
    dev: &CudaDevice,
    params: &EncodeParams,
    d: usize,
    x: u64,
    rows: usize,
    t: usize,
    cb: usize,
    dst: EncodeDst,
) -> Result<()> {
    if ![64, 128, 256].contains(&d) {
        bail!("cuda: encode kernels for head_dim 64, 128 and 256, not {d}")
    }
    if rows == 0 {
        return Ok(());
    }
    let stream = dev.cuda_stream();
    let a = EncodeArgs {
        x,
        rows: rows as i64,
        t: t.max(1) as i32,
        out: dst.addr,
        cb: cb as i32,
        out_hstride: dst.h_stride,
        mu: dst.mu,
    };
    let (module, name) = match params {
        EncodeParams::Scalar(_) => ("turboquant_mse_encode", format!("kvq_encode_scalar_d{d}")),
        EncodeParams::Prod(_) => ("turboquant_prod_encode", format!("kvq_encode_prod_d{d}")),
        EncodeParams::QjlKeys(_) => ("qjl_encode", format!("kvq_encode_qjl_keys_d{d}")),
        EncodeParams::Group(_) => ("qjl_encode", format!("kvq_encode_group_d{d}")),
        EncodeParams::Vq(_) => ("vecinfer_encode", format!("kvq_encode_vq_d{d}")),
    };
    let f = function(dev, module, &name)?;
    // Sign sketches: ceil(m / 32) blocks per row, each packing 32 signs (kernels/cuda/common
    // encode.cuh `sketch_signs`), so one token's S is read by many multiprocessors at once.
    let slices = match params {
        EncodeParams::Prod(p) => p.m,
        EncodeParams::QjlKeys(p) => p.m,
        _ => 1,
    };
    let slices = u32::try_from(slices.max(1))
        .map_err(|_| candle_core::Error::Msg("cuda: bad sketch size".into()))?
        .div_ceil(32);
    let cfg = LaunchConfig {
        grid_dim: (
            u32::try_from(rows).map_err(|_| candle_core::Error::Msg("too many rows".into()))?,
            slices,
            1,
        ),
        block_dim: (d as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    fn go<P: DeviceRepr>(
        stream: &std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
        f: &candle_core::cuda_backend::cudarc::driver::CudaFunction,
        cfg: LaunchConfig,
        a: &EncodeArgs,
        p: &P,
        name: &str,
    ) -> Result<()> {
        let mut b = stream.launch_builder(f);
        b.arg(a);
        b.arg(p);
        // SAFETY: by-value argument structs whose addresses outlive the launch.
        drv(unsafe { b.launch(cfg) }, name)?;
        check_launch(stream, name)
    }
    match params {
        EncodeParams::Scalar(p) => go(&stream, &f, cfg, &a, p, &name),
        EncodeParams::Prod(p) => go(&stream, &f, cfg, &a, p, &name),
        EncodeParams::QjlKeys(p) => go(&stream, &f, cfg, &a, p, &name),
        EncodeParams::Group(p) => go(&stream, &f, cfg, &a, p, &name),
        EncodeParams::Vq(p) => go(&stream, &f, cfg, &a, p, &name),
    }
}

/// Nearest of 256 centroids (`[256][sub]` at `c`) for each of the `n` sub-vectors at `x`
/// (`[n][sub]`, sub 4 or 8): `[n]` u32 indices. O(n) memory: the indices alone.
pub fn launch_nearest(
    dev: &CudaDevice,
    x: u64,
    n: usize,
    sub: usize,
    c: u64,
) -> Result<CudaSlice<u32>> {
    if sub != 4 && sub != 8 {
        bail!("cuda: nearest-centroid for sub-vectors of 4 or 8, not {sub}")
    }
    let stream = dev.cuda_stream();
    // SAFETY: the kernel writes every index.
    let out = unsafe { dev.alloc::<u32>(n.max(1))? };
    super::poison(&out, &stream)?;
    if n == 0 {
        return Ok(out);
    }
    let name = format!("kvq_nearest_s{sub}");
    let f = function(dev, "vecinfer_encode", &name)?;
    let blocks = n.div_ceil(256).min(sm_count(stream.context()) * 16);
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (n64, outp) = (n as i64, super::address(&out, &stream, 0));
    let mut b = stream.launch_builder(&f);
    b.arg(&x);
    b.arg(&n64);
    b.arg(&c);
    b.arg(&outp);
    // SAFETY: plain arguments; `x`, `c` and `out` outlive the launch.
    drv(unsafe { b.launch(cfg) }, &name)?;
    check_launch(&stream, &name)?;
    Ok(out)
}
