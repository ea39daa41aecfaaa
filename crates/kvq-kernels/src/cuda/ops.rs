//! The ops' `cuda_fwd` bodies (attend, encode, nearest centroid) and the batched entry points
//! benchmarks and the fp16 cache call on tensors: checks the storages' layouts, reads the
//! codecs' device specs, launches (attend.rs, encode.rs) and wraps the result as a tensor.

use super::attend::{AttendLaunch, CodeView, ExtraRows, QueryView, launch};
use super::encode::{launch_encode, launch_nearest};
use super::{DenseParams, KeyArgs, KeyDev, ValueArgs, ValueDev, storage_address};
use crate::attend::AttendParams;
use crate::codec::{KeyCodec, ValueCodec};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{DType, Layout, Result, Shape, Storage, Tensor, bail};

/// Dims and strides of a rank-`n` storage whose last axis is contiguous.
fn dims_of<'a>(l: &'a Layout, n: usize, what: &str) -> Result<(&'a [usize], &'a [usize])> {
    let (d, s) = (l.dims(), l.stride());
    if d.len() != n || s.last().copied().unwrap_or(1) != 1 && d.last().copied().unwrap_or(1) > 1 {
        bail!("cuda: {what}: expected rank {n} with a contiguous last axis, got {d:?} / {s:?}")
    }
    Ok((d, s))
}

pub(crate) fn key_args(dev: &CudaDevice, keys: &dyn KeyCodec) -> Result<KeyArgs> {
    let Some(data) = keys.kernel_data() else {
        bail!("cuda: this key codec has no device kernel")
    };
    Ok(KeyDev::of(dev, data)?.attend_args(dev))
}

pub(crate) fn value_args(dev: &CudaDevice, values: &dyn ValueCodec) -> Result<ValueArgs> {
    let Some(data) = values.kernel_data() else {
        bail!("cuda: this value codec has no device kernel")
    };
    Ok(ValueDev::of(dev, data)?.attend_args(dev))
}

/// `compressed_attend` on CUDA: q `[nh, t, d]`, codes `[kvh, n, cb]` (row-contiguous views);
/// `[nh, t, d + 2]` partial states as the CPU op returns them.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_fwd(
    keys: &dyn KeyCodec,
    values: &dyn ValueCodec,
    p: AttendParams,
    q: &CudaStorage,
    lq: &Layout,
    k: &CudaStorage,
    lk: &Layout,
    v: &CudaStorage,
    lv: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dev = q.device.clone();
    let (qd, qs) = dims_of(lq, 3, "attend queries")?;
    let (kd, ks) = dims_of(lk, 3, "attend key codes")?;
    let (vd, vs) = dims_of(lv, 3, "attend value codes")?;
    let (nh, t, d) = (qd[0], qd[1], qd[2]);
    crate::attend::check_attend(
        keys,
        values,
        &p,
        nh,
        t,
        d,
        (kd[0], kd[1], kd[2]),
        (vd[0], vd[1], vd[2]),
    )?;
    for (dims, st, what) in [(kd, ks, "key"), (vd, vs, "value")] {
        if dims[1] > 1 && st[1] != dims[2] {
            bail!("cuda: {what} code rows must be contiguous (strides {st:?})")
        }
    }
    let (qa, qt) = storage_address(q, lq)?;
    let (ka, kt) = storage_address(k, lk)?;
    let (va, vt) = storage_address(v, lv)?;
    if (qt, kt, vt) != (DType::F32, DType::U8, DType::U8) {
        bail!("cuda: attend takes f32 queries and u8 codes, got {qt:?} / {kt:?} / {vt:?}")
    }
    let l = AttendLaunch {
        keys: key_args(&dev, keys)?,
        values: value_args(&dev, values)?,
        d,
        batch: 1,
        n_heads: nh,
        n_kv_heads: kd[0],
        t,
        p,
    };
    let qv = QueryView {
        addr: qa,
        b_stride: 0,
        h_stride: qs[0] as i64,
        t_stride: qs[1] as i64,
    };
    let kv = CodeView {
        addr: ka,
        b_stride: 0,
        h_stride: ks[0] as i64,
        row_bytes: kd[2],
        rows: kd[1],
    };
    let vv = CodeView {
        addr: va,
        b_stride: 0,
        h_stride: vs[0] as i64,
        row_bytes: vd[2],
        rows: vd[1],
    };
    let out = launch(&dev, &l, qv, kv, vv, None, false)?;
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from((nh, t, d + 2)),
    ))
}

/// The encode op on CUDA: `[heads, t, d]` f32 (contiguous) to `[heads, t, cb]` u8.
pub(crate) fn encode_fwd(
    keys: Option<&dyn KeyCodec>,
    values: Option<&dyn ValueCodec>,
    x: &CudaStorage,
    l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dev = x.device.clone();
    let &[heads, t, d] = l.dims() else {
        bail!(
            "cuda: encode input must be [heads, t, d], got {:?}",
            l.dims()
        )
    };
    if !l.is_contiguous() {
        bail!("cuda: encode input must be contiguous")
    }
    let (addr, dt) = storage_address(x, l)?;
    if dt != DType::F32 {
        bail!("cuda: encode takes f32 rows, got {dt:?}")
    }
    let (params, cb) = match (keys, values) {
        (Some(k), _) => {
            let Some(data) = k.kernel_data() else {
                bail!("cuda: this key codec has no device kernel")
            };
            if k.head_dim() != d {
                bail!("encode: rows of {d} values, codec expects {}", k.head_dim())
            }
            (KeyDev::of(&dev, data)?.encode_args(&dev), k.code_bytes())
        }
        (None, Some(v)) => {
            let Some(data) = v.kernel_data() else {
                bail!("cuda: this value codec has no device kernel")
            };
            if v.head_dim() != d {
                bail!("encode: rows of {d} values, codec expects {}", v.head_dim())
            }
            (ValueDev::of(&dev, data)?.encode_args(&dev), v.code_bytes())
        }
        (None, None) => bail!("encode: no codec"),
    };
    let out = launch_encode(&dev, &params, d, addr, heads * t, t, cb)?;
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from((heads, t, cb)),
    ))
}

/// The nearest-centroid op on CUDA: `x` `[N, sub]`, codebook `[256, sub]`, both contiguous f32.
pub(crate) fn nearest_fwd(
    x: &CudaStorage,
    lx: &Layout,
    c: &CudaStorage,
    lc: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dev = x.device.clone();
    let (&[n, sub], &[nc, csub]) = (lx.dims(), lc.dims()) else {
        bail!("nearest-centroid: x and the codebook must be matrices")
    };
    if sub != csub || nc != 256 || !lx.is_contiguous() || !lc.is_contiguous() {
        bail!(
            "cuda: nearest-centroid needs contiguous [N, s] and [256, s], got [{n}, {sub}] / [{nc}, {csub}]"
        )
    }
    let (xa, _) = storage_address(x, lx)?;
    let (ca, _) = storage_address(c, lc)?;
    let out = launch_nearest(&dev, xa, n, sub, ca)?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(n)))
}

/// A tensor's CUDA storage address and strides (elements), with its read guard held by `f`.
fn with_cuda<R>(t: &Tensor, f: impl FnOnce(&CudaStorage, &Layout) -> Result<R>) -> Result<R> {
    let (s, l) = t.storage_and_layout();
    match &*s {
        Storage::Cuda(c) => f(c, l),
        _ => bail!("cuda: tensor is not on a CUDA device"),
    }
}

/// Batched fused decode attention for benchmarks and parity tests: q `[B, nh, t, d]` f32,
/// codes `[B, kvh, n, cb]` u8 (rows contiguous), optional exact fp16 rows `[B, kvh, nx, d]`
/// that every query row also attends. Returns `[B, nh, t, d + 2]` (see [`launch`]); with
/// `normalize` the first d slots hold the attention output.
#[allow(clippy::too_many_arguments)]
pub fn decode_attend(
    keys: &dyn KeyCodec,
    values: &dyn ValueCodec,
    p: AttendParams,
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    extra: Option<(&Tensor, &Tensor)>,
    normalize: bool,
) -> Result<Tensor> {
    let candle_core::Device::Cuda(dev) = q.device() else {
        bail!("cuda: decode_attend needs CUDA tensors")
    };
    let ka = key_args(dev, keys)?;
    let va = value_args(dev, values)?;
    batched(dev, ka, va, p, q, kc, vc, extra, None, normalize)
}

/// [`decode_attend`] for a centered cache: `shift` `[B, nh]` f32 (`scale * q . mu` per query
/// head) is added to the codes' logits before they are merged with the exact rows, which hold
/// raw keys. One query row per sequence.
#[allow(clippy::too_many_arguments)]
pub fn decode_attend_shifted(
    keys: &dyn KeyCodec,
    values: &dyn ValueCodec,
    p: AttendParams,
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    extra: (&Tensor, &Tensor),
    shift: Option<&Tensor>,
    normalize: bool,
) -> Result<Tensor> {
    let candle_core::Device::Cuda(dev) = q.device() else {
        bail!("cuda: decode_attend needs CUDA tensors")
    };
    let ka = key_args(dev, keys)?;
    let va = value_args(dev, values)?;
    batched(dev, ka, va, p, q, kc, vc, Some(extra), shift, normalize)
}

/// Batched fused decode attention over fp16 keys and values `[B, kvh, n, d]` (the fp16 cache's
/// kernel).
pub fn dense_decode_attend(
    p: AttendParams,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    normalize: bool,
) -> Result<Tensor> {
    let candle_core::Device::Cuda(dev) = q.device() else {
        bail!("cuda: dense_decode_attend needs CUDA tensors")
    };
    if k.dtype() != DType::F16 || v.dtype() != DType::F16 {
        bail!("cuda: dense attention takes f16 keys and values")
    }
    let dp = DenseParams { unused: 0 };
    batched(
        dev,
        KeyArgs::Dense(dp),
        ValueArgs::Dense(dp),
        p,
        q,
        k,
        v,
        None,
        None,
        normalize,
    )
}

#[allow(clippy::too_many_arguments)]
fn batched(
    dev: &CudaDevice,
    ka: KeyArgs,
    va: ValueArgs,
    p: AttendParams,
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    extra: Option<(&Tensor, &Tensor)>,
    shift: Option<&Tensor>,
    normalize: bool,
) -> Result<Tensor> {
    let &[b, nh, t, d] = q.dims() else {
        bail!("cuda: queries must be [B, nh, t, d], got {:?}", q.dims())
    };
    let &[kb, kvh, n, _] = kc.dims() else {
        bail!("cuda: codes must be [B, kvh, n, cb], got {:?}", kc.dims())
    };
    if kb != b || vc.dims().len() != 4 || vc.dims()[..3] != kc.dims()[..3] {
        bail!(
            "cuda: keys {:?} and values {:?} do not match {b} sequences",
            kc.dims(),
            vc.dims()
        )
    }
    let elem = |t: &Tensor| t.dtype().size_in_bytes() as i64;
    let q = q.contiguous()?;
    // Code rows may be a view into a longer buffer (a cache's rows `..len` of its capacity):
    // only each row must be contiguous.
    let rows_contiguous = |c: &Tensor| -> Result<Tensor> {
        let (s, w) = (c.stride(), c.dims()[3]);
        match s[3] == 1 && (c.dims()[2] <= 1 || s[2] == w) {
            true => Ok(c.clone()),
            false => c.contiguous(),
        }
    };
    let (kc, vc) = (rows_contiguous(kc)?, rows_contiguous(vc)?);
    let qv = with_cuda(&q, |s, l| {
        Ok(QueryView {
            addr: storage_address(s, l)?.0,
            b_stride: (nh * t * d) as i64,
            h_stride: (t * d) as i64,
            t_stride: d as i64,
        })
    })?;
    let code_view = |c: &Tensor| {
        with_cuda(c, |s, l| {
            let row = c.dims()[3] * elem(c) as usize;
            let st = l.stride();
            Ok(CodeView {
                addr: storage_address(s, l)?.0,
                b_stride: st[0] as i64 * elem(c),
                h_stride: st[1] as i64 * elem(c),
                row_bytes: row,
                rows: n,
            })
        })
    };
    let (kv, vv) = (code_view(&kc)?, code_view(&vc)?);
    let shift = match shift {
        Some(s) if s.dims() != [b, nh] || s.dtype() != DType::F32 => {
            bail!(
                "cuda: the logit shift must be f32 [{b}, {nh}], got {:?}",
                s.dims()
            )
        }
        Some(s) => Some(s.contiguous()?),
        None => None,
    };
    let shift_addr = match &shift {
        Some(s) => with_cuda(s, |st, l| Ok(storage_address(st, l)?.0))?,
        None => 0,
    };
    let extra = match extra {
        Some((xk, xv)) => {
            let (xk, xv) = (xk.contiguous()?, xv.contiguous()?);
            let ok = |x: &Tensor| {
                x.dtype() == DType::F16
                    && x.dims().len() == 4
                    && x.dims()[..2] == [b, kvh]
                    && x.dims()[3] == d
            };
            if !ok(&xk) || !ok(&xv) || xk.dims() != xv.dims() {
                bail!(
                    "cuda: exact rows must be f16 [{b}, {kvh}, nx, {d}], got {:?} / {:?}",
                    xk.dims(),
                    xv.dims()
                )
            }
            let n = xk.dims()[2];
            let ka = with_cuda(&xk, |s, l| Ok(storage_address(s, l)?.0))?;
            let va = with_cuda(&xv, |s, l| Ok(storage_address(s, l)?.0))?;
            Some((
                ExtraRows {
                    keys: ka,
                    values: va,
                    n,
                    shift: shift_addr,
                },
                xk,
                xv,
            ))
        }
        None => None,
    };
    let l = AttendLaunch {
        keys: ka,
        values: va,
        d,
        batch: b,
        n_heads: nh,
        n_kv_heads: kvh,
        t,
        p,
    };
    let out = launch(dev, &l, qv, kv, vv, extra.as_ref().map(|e| e.0), normalize)?;
    // The shift is read by the combine, enqueued on the same stream before it is freed.
    drop(shift);
    let storage = CudaStorage::wrap_cuda_slice(out, dev.clone());
    Ok(Tensor::from_storage(
        Storage::Cuda(storage),
        (b, nh, t, d + 2),
        candle_core::op::BackpropOp::none(),
        false,
    ))
}
