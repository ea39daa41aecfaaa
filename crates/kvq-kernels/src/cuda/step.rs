//! The fused decode step a compressed cache on CUDA runs per layer: its new keys encoded
//! (centered in the kernel) straight into its code rows, its new keys and values stored as f16
//! into its window rows, both values encoded into theirs (three launches for an append), then one
//! launch of the version-5 attention over the codes and the fp16 rows in place, with the key
//! center's shift computed in the kernel. Every function writes into or reads from the cache's
//! own buffers (views of them), so nothing is copied or concatenated per step.

use super::attend::{AttendLaunch, CodeView, QueryView};
use super::encode::{EncodeDst, launch_encode_into};
use super::fast::{Extras, Segment};
use super::{KeyDev, ValueDev, check_launch, drv, function, storage_address};
use crate::attend::AttendParams;
use crate::codec::{KeyCodec, ValueCodec};
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{DType, Layout, Result, Storage, Tensor, bail};

/// `t`'s CUDA device, storage address (at its layout's start) and layout.
fn cuda_of(t: &Tensor) -> Result<(CudaDevice, u64, Layout)> {
    let (s, l) = t.storage_and_layout();
    match &*s {
        Storage::Cuda(c) => {
            let c: &CudaStorage = c;
            Ok((c.device.clone(), storage_address(c, l)?.0, l.clone()))
        }
        _ => bail!("cuda: tensor is not on a CUDA device"),
    }
}

/// Which codec an in-place encode runs.
pub enum Codec<'a> {
    Keys(&'a dyn KeyCodec),
    Values(&'a dyn ValueCodec),
}

/// Encodes `x` (`[kv heads, t, d]` f32, contiguous) with `codec` into rows `row..row + t` of
/// `dst` (`[kv heads, capacity, code bytes]` u8, a cache's code buffer), coding `f16(x) - mu`
/// when a center `mu` (`[kv heads, d]` f32, contiguous) is given.
pub fn encode_rows_into(
    codec: Codec<'_>,
    x: &Tensor,
    mu: Option<&Tensor>,
    dst: &Tensor,
    row: usize,
) -> Result<()> {
    let (dev, xa, xl) = cuda_of(x)?;
    let &[heads, t, d] = xl.dims() else {
        bail!(
            "cuda: encode rows must be [heads, t, d], got {:?}",
            xl.dims()
        )
    };
    if !xl.is_contiguous() || x.dtype() != DType::F32 {
        bail!("cuda: encode rows must be contiguous f32")
    }
    let (_, da, dl) = cuda_of(dst)?;
    let &[dh, cap, cb] = dl.dims() else {
        bail!(
            "cuda: a code buffer is [heads, capacity, bytes], got {:?}",
            dl.dims()
        )
    };
    let ds = dl.stride();
    if dst.dtype() != DType::U8 || dh != heads || row + t > cap || ds[2] != 1 || ds[1] != cb {
        bail!(
            "cuda: code buffer {:?} cannot take {t} rows of {heads} heads at row {row}",
            dl.dims()
        )
    }
    let (params, want_cb, hd) = match codec {
        Codec::Keys(k) => {
            let Some(data) = k.kernel_data() else {
                bail!("cuda: this key codec has no device kernel")
            };
            (
                KeyDev::of(&dev, data)?.encode_args(&dev),
                k.code_bytes(),
                k.head_dim(),
            )
        }
        Codec::Values(v) => {
            let Some(data) = v.kernel_data() else {
                bail!("cuda: this value codec has no device kernel")
            };
            (
                ValueDev::of(&dev, data)?.encode_args(&dev),
                v.code_bytes(),
                v.head_dim(),
            )
        }
    };
    if want_cb != cb || hd != d {
        bail!("cuda: codec rows of {want_cb} bytes at head dim {hd}, buffer {cb} / rows {d}")
    }
    let mu = match mu {
        Some(m) => {
            let (_, ma, ml) = cuda_of(m)?;
            if ml.shape().elem_count() != heads * d
                || !ml.is_contiguous()
                || m.dtype() != DType::F32
            {
                bail!("cuda: the key center must be contiguous f32 [{heads}, {d}]")
            }
            ma
        }
        None => 0,
    };
    let out = EncodeDst {
        addr: da + (row * cb) as u64,
        h_stride: ds[0] as i64,
        mu,
    };
    launch_encode_into(&dev, &params, d, xa, heads * t, t, cb, out)
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct RowsArgs {
    k: u64,
    v: u64,
    dk: u64,
    dv: u64,
    hstride_k: i64,
    hstride_v: i64,
    row0: i64,
    t: i32,
    d: i32,
}

// SAFETY: a #[repr(C)] struct of integers and addresses, laid out as kernels/cuda/common/rows.cu
// `RowsArgs`.
unsafe impl DeviceRepr for RowsArgs {}

/// Stores keys `k` and values `v` (`[kv heads, t, d]` f32, contiguous) as f16 into rows
/// `row..row + t` of the buffers `dk`, `dv` (`[kv heads, capacity, d]` f16), in one launch.
pub fn store_rows_f16(k: &Tensor, v: &Tensor, dk: &Tensor, dv: &Tensor, row: usize) -> Result<()> {
    let (dev, ka, kl) = cuda_of(k)?;
    let (_, va, vl) = cuda_of(v)?;
    let (_, dka, dkl) = cuda_of(dk)?;
    let (_, dva, dvl) = cuda_of(dv)?;
    let &[heads, t, d] = kl.dims() else {
        bail!("cuda: rows must be [heads, t, d], got {:?}", kl.dims())
    };
    let ok_src = |l: &Layout, x: &Tensor| {
        l.is_contiguous() && l.dims() == kl.dims() && x.dtype() == DType::F32
    };
    let ok_dst = |l: &Layout, x: &Tensor| {
        let (dd, ds) = (l.dims(), l.stride());
        x.dtype() == DType::F16
            && dd.len() == 3
            && dd[0] == heads
            && dd[2] == d
            && row + t <= dd[1]
            && ds[2] == 1
            && ds[1] == d
    };
    if !ok_src(&kl, k) || !ok_src(&vl, v) || !ok_dst(&dkl, dk) || !ok_dst(&dvl, dv) || d % 2 != 0 {
        bail!(
            "cuda: f16 row store of {:?} f32 rows into {:?} / {:?} at row {row}",
            kl.dims(),
            dkl.dims(),
            dvl.dims()
        )
    }
    if heads * t == 0 {
        return Ok(());
    }
    let a = RowsArgs {
        k: ka,
        v: va,
        dk: dka,
        dv: dva,
        hstride_k: dkl.stride()[0] as i64,
        hstride_v: dvl.stride()[0] as i64,
        row0: row as i64,
        t: t as i32,
        d: d as i32,
    };
    let f = function(&dev, "common_rows", "kvq_store_rows_f16")?;
    let cfg = LaunchConfig {
        grid_dim: ((heads * t) as u32, 2, 1),
        block_dim: ((d / 2).clamp(32, 128) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    b.arg(&a);
    // SAFETY: a by-value argument struct; the tensors it points into outlive the launch (the
    // stream orders any free after it), and the destination rows are inside the buffers.
    drv(unsafe { b.launch(cfg) }, "kvq_store_rows_f16")?;
    check_launch(&stream, "kvq_store_rows_f16")
}

/// A view of rows of a `[kv heads, n, d]` f16 buffer (the sinks' or the window's), as a segment.
fn segment(k: &Tensor, v: &Tensor) -> Result<Segment> {
    let (_, ka, kl) = cuda_of(k)?;
    let (_, va, vl) = cuda_of(v)?;
    let (kd, ks, vs) = (kl.dims(), kl.stride(), vl.stride());
    if kd.len() != 3 || vl.dims() != kd || k.dtype() != DType::F16 || v.dtype() != DType::F16 {
        bail!(
            "cuda: exact rows must be f16 [heads, n, d], got {kd:?} / {:?}",
            vl.dims()
        )
    }
    if ks != vs || ks[2] != 1 || ks[1] != kd[2] {
        bail!("cuda: exact key and value rows must be laid out alike, rows contiguous")
    }
    Ok(Segment {
        keys: ka,
        values: va,
        b_stride: 0,
        h_stride: ks[0] as i64,
        n: kd[1],
    })
}

/// The decode attention of one sequence's query `q` (`[nh, 1, d]` f32) over its code rows
/// `kc`, `vc` (`[kv heads, n, bytes]` views of its buffers) and up to two segments of fp16 rows
/// (`[kv heads, n, d]` f16 views: the sinks, the window), the key center `mu` (`[kv heads, d]`
/// f32) shifting the codes' logits: `[nh, 1, d]` normalized. One launch; None when no version-5
/// kernel takes these codecs (the caller runs the general path).
#[allow(clippy::too_many_arguments)]
pub fn decode_fast(
    keys: &dyn KeyCodec,
    values: &dyn ValueCodec,
    p: AttendParams,
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    exact: [Option<(&Tensor, &Tensor)>; 2],
    mu: Option<&Tensor>,
) -> Result<Option<Tensor>> {
    let (dev, qa, ql) = cuda_of(q)?;
    let &[nh, t, d] = ql.dims() else {
        bail!("cuda: queries must be [nh, 1, d], got {:?}", ql.dims())
    };
    if t != 1 || !ql.is_contiguous() || q.dtype() != DType::F32 {
        return Ok(None);
    }
    let code = |c: &Tensor| -> Result<CodeView> {
        let (_, a, l) = cuda_of(c)?;
        let (cd, cs) = (l.dims(), l.stride());
        if cd.len() != 3 || c.dtype() != DType::U8 || cs[2] != 1 || (cd[1] > 1 && cs[1] != cd[2]) {
            bail!("cuda: code rows must be u8 [heads, n, bytes] with contiguous rows")
        }
        Ok(CodeView {
            addr: a,
            b_stride: 0,
            h_stride: cs[0] as i64,
            row_bytes: cd[2],
            rows: cd[1],
        })
    };
    let (kv, vv) = (code(kc)?, code(vc)?);
    let kvh = kc.dims()[0];
    if kvh == 0 || !nh.is_multiple_of(kvh) {
        bail!("cuda: {nh} query heads over {kvh} kv heads")
    }
    let l = AttendLaunch {
        keys: super::ops::key_args(&dev, keys)?,
        values: super::ops::value_args(&dev, values)?,
        d,
        batch: 1,
        n_heads: nh,
        n_kv_heads: kvh,
        t: 1,
        p,
    };
    let Some(pl) = super::fast::plan(&l, &kv, &vv) else {
        return Ok(None);
    };
    let mut extras = Extras::default();
    for (slot, seg) in extras.segments.iter_mut().zip(exact) {
        if let Some((k, v)) = seg {
            *slot = segment(k, v)?;
        }
    }
    if let Some(m) = mu {
        let (_, ma, ml) = cuda_of(m)?;
        if ml.shape().elem_count() != kvh * d || !ml.is_contiguous() || m.dtype() != DType::F32 {
            bail!("cuda: the key center must be contiguous f32 [{kvh}, {d}]")
        }
        extras.mu = ma;
    }
    if !extras.aligned(d) {
        return Ok(None);
    }
    let qv = QueryView {
        addr: qa,
        b_stride: (nh * d) as i64,
        h_stride: d as i64,
        t_stride: d as i64,
    };
    let out = super::fast::launch(&dev, &l, &pl, qv, &kv, &vv, &extras, d, true)?;
    let storage = CudaStorage::wrap_cuda_slice(out, dev);
    Ok(Some(Tensor::from_storage(
        Storage::Cuda(storage),
        (nh, 1, d),
        candle_core::op::BackpropOp::none(),
        false,
    )))
}
