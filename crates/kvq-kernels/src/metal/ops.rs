//! The ops' `metal_fwd` bodies: checks the storages' layouts, reads the codecs' device arrays
//! ([`super::backend`]), takes the dispatch from [`super::dispatch`] and the parameter bytes
//! from [`super::params`], and encodes the kernels of `kernels/metal` on candle's command
//! buffer. A codec whose spec has no Metal kernel yet (TurboQuant-Prod keys, QJL's group
//! values on encode, VecInfer) runs the op's CPU body on a copy of its inputs
//! ([`via_cpu`]): correct, but a host round trip per call.

use super::backend::{Arg, KeyBufs, ValueBufs, encode, key_bufs, output, value_bufs};
use super::dispatch;
use super::params::{
    AsBytes, CombineParams, NearestParams, QjlAttendParams, QjlKeyEncodeParams, ScalarAttendParams,
    ScalarEncodeParams,
};
use crate::attend::AttendParams;
use crate::codec::{KeyCodec, ValueCodec};
use crate::spec::{KeySpec, ValueSpec};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, DType, Layout, MetalStorage, Result, Shape, bail};

/// A contiguous layout's byte offset into its buffer.
fn offset(s: &MetalStorage, l: &Layout, what: &str) -> Result<usize> {
    if !l.is_contiguous() {
        bail!("metal: {what} must be contiguous (make it so before the op)")
    }
    Ok(l.start_offset() * s.dtype().size_in_bytes())
}

/// Runs `cpu` (the op's CPU body) on CPU copies of `inputs` and uploads its result: the path
/// of a codec without a Metal kernel.
pub(crate) fn via_cpu(
    inputs: &[&MetalStorage],
    cpu: impl FnOnce(&[CpuStorage]) -> Result<(CpuStorage, Shape)>,
) -> Result<(MetalStorage, Shape)> {
    let Some(first) = inputs.first() else {
        bail!("metal: an op without inputs")
    };
    let dev = first.device().clone();
    let host = inputs
        .iter()
        .map(|s| s.to_cpu_storage())
        .collect::<Result<Vec<_>>>()?;
    let (out, shape) = cpu(&host)?;
    Ok((dev.storage_from_cpu_storage_owned(out)?, shape))
}

/// Whether `compressed_attend` has a fused Metal kernel for this codec pair.
pub(crate) fn attend_has_kernel(keys: &dyn KeyCodec, values: &dyn ValueCodec) -> bool {
    matches!(
        (
            keys.kernel_data().map(|k| &k.spec),
            values.kernel_data().map(|v| &v.spec)
        ),
        (Some(KeySpec::Scalar(_)), Some(ValueSpec::Scalar(_)))
            | (Some(KeySpec::Sketch { .. }), Some(ValueSpec::Group { .. }))
    )
}

/// `compressed_attend` on Metal: q `[nh, t, d]` f32, codes `[kvh, n, cb]` u8, all contiguous;
/// `[nh, t, d + 2]` partial states as the CPU op returns them. The attention kernel writes one
/// partial row per split, `kvq_combine` merges them (unnormalized).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_fwd(
    keys: &dyn KeyCodec,
    values: &dyn ValueCodec,
    p: AttendParams,
    q: &MetalStorage,
    lq: &Layout,
    k: &MetalStorage,
    lk: &Layout,
    v: &MetalStorage,
    lv: &Layout,
) -> Result<(MetalStorage, Shape)> {
    let dev = q.device().clone();
    let (&[nh, t, d], &[kvh, n, kcb], &[_, _, vcb]) = (lq.dims(), lk.dims(), lv.dims()) else {
        bail!("metal: attend takes rank-3 queries and codes")
    };
    crate::attend::check_attend(
        keys,
        values,
        &p,
        nh,
        t,
        d,
        (kvh, n, kcb),
        (lv.dims()[0], lv.dims()[1], vcb),
    )?;
    if (q.dtype(), k.dtype(), v.dtype()) != (DType::F32, DType::U8, DType::U8) {
        bail!("metal: attend takes f32 queries and u8 codes")
    }
    let (qo, ko, vo) = (
        offset(q, lq, "attend queries")?,
        offset(k, lk, "attend key codes")?,
        offset(v, lv, "attend value codes")?,
    );
    let (Some(kd), Some(vd)) = (keys.kernel_data(), values.kernel_data()) else {
        bail!("metal: these codecs have no device kernel")
    };
    let max_rows = (0..t)
        .map(|r| {
            let (r0, r1) = p.code_rows(p.first_pos + r);
            r1.min(n).saturating_sub(r0)
        })
        .max()
        .unwrap_or(0);
    let width = d + 2;
    let range = |what| candle_core::Error::Msg(format!("metal: attend: {what} out of range"));
    let (kb, vb) = (key_bufs(&dev, kd)?, value_bufs(&dev, vd)?);
    let (plan, part) = match (&kd.spec, &vd.spec, &*kb, &*vb) {
        (
            KeySpec::Scalar(ks),
            ValueSpec::Scalar(vs),
            KeyBufs::Scalar(kbuf),
            ValueBufs::Scalar(vbuf),
        ) => {
            let plan = dispatch::attend_scalar(nh, kvh, t, d, max_rows)
                .map_err(candle_core::Error::Msg)?;
            let prm = ScalarAttendParams::new(&plan, &p, n, d, ks, vs)
                .ok_or_else(|| range("a position"))?;
            let part = output(&dev, nh * t * plan.n_splits * width * 4, "kvq-attend-part")?;
            encode(
                &dev,
                "turboquant_mse/attend",
                "kvq_attend_scalar",
                plan.attend,
                &[
                    Arg::In(q.buffer(), qo),
                    Arg::In(k.buffer(), ko),
                    Arg::In(v.buffer(), vo),
                    Arg::In(&kbuf.levels, 0),
                    Arg::In(&kbuf.signs, 0),
                    Arg::In(&vbuf.levels, 0),
                    Arg::In(&vbuf.signs, 0),
                    Arg::Out(&part, 0),
                    Arg::Bytes(prm.as_bytes()),
                ],
            )?;
            (plan, part)
        }
        (
            KeySpec::Sketch { sketch, outliers },
            ValueSpec::Group { bits, group },
            KeyBufs::Sketch(mats),
            _,
        ) => {
            let plan = dispatch::attend_qjl(nh, kvh, t, d, sketch.m, max_rows)
                .map_err(candle_core::Error::Msg)?;
            let prm = QjlAttendParams::new(&plan, &p, n, d, sketch.m, *outliers, *bits, *group)
                .ok_or_else(|| range("a position or code layout"))?;
            if prm.kcb as usize != kcb || prm.vcb as usize != vcb {
                bail!("metal: attend: the QJL code widths are not the kernel's")
            }
            let part = output(&dev, nh * t * plan.n_splits * width * 4, "kvq-attend-part")?;
            encode(
                &dev,
                "qjl/attend",
                "kvq_attend_qjl",
                plan.attend,
                &[
                    Arg::In(q.buffer(), qo),
                    Arg::In(k.buffer(), ko),
                    Arg::In(v.buffer(), vo),
                    Arg::In(mats, 0),
                    Arg::Out(&part, 0),
                    Arg::Bytes(prm.as_bytes()),
                ],
            )?;
            (plan, part)
        }
        _ => bail!("metal: no fused attention kernel for this key / value pair"),
    };
    let out = output(&dev, nh * t * width * 4, "kvq-attend-out")?;
    let cp = CombineParams {
        rows: u32::try_from(nh * t).map_err(|_| range("the row count"))?,
        n_splits: plan.n_splits as u32,
        d: d as u32,
        normalize: 0,
    };
    encode(
        &dev,
        "common/combine",
        "kvq_combine",
        plan.combine,
        &[
            Arg::In(&part, 0),
            Arg::Out(&out, 0),
            Arg::Bytes(cp.as_bytes()),
        ],
    )?;
    Ok((
        MetalStorage::new(out, dev, nh * t * width, DType::F32),
        Shape::from((nh, t, width)),
    ))
}

/// Whether the encode op has a Metal kernel for this codec's spec.
pub(crate) fn encode_has_kernel(
    keys: Option<&dyn KeyCodec>,
    values: Option<&dyn ValueCodec>,
) -> bool {
    match (keys, values) {
        (Some(k), _) => matches!(
            k.kernel_data().map(|d| &d.spec),
            Some(KeySpec::Scalar(_) | KeySpec::Sketch { .. })
        ),
        (None, Some(v)) => matches!(v.kernel_data().map(|d| &d.spec), Some(ValueSpec::Scalar(_))),
        (None, None) => false,
    }
}

/// The encode op on Metal: `[heads, t, d]` f32 (contiguous) to `[heads, t, cb]` u8, for the
/// specs [`encode_has_kernel`] accepts.
pub(crate) fn encode_fwd(
    keys: Option<&dyn KeyCodec>,
    values: Option<&dyn ValueCodec>,
    x: &MetalStorage,
    l: &Layout,
) -> Result<(MetalStorage, Shape)> {
    let dev = x.device().clone();
    let &[heads, t, d] = l.dims() else {
        bail!(
            "metal: encode input must be [heads, t, d], got {:?}",
            l.dims()
        )
    };
    if x.dtype() != DType::F32 {
        bail!("metal: encode takes f32 rows")
    }
    let xo = offset(x, l, "encode input")?;
    let rows = heads * t;
    let u = |v: usize| {
        u32::try_from(v).map_err(|_| candle_core::Error::Msg("metal: encode: too many rows".into()))
    };
    let (cb, hd) = match (keys, values) {
        (Some(k), _) => (k.code_bytes(), k.head_dim()),
        (None, Some(v)) => (v.code_bytes(), v.head_dim()),
        (None, None) => bail!("encode: no codec"),
    };
    if hd != d {
        bail!("encode: rows of {d} values, codec expects {hd}")
    }
    let out = output(&dev, rows * cb, "kvq-encode")?;
    let scalar = |s: &crate::spec::ScalarSpec, b: &super::backend::ScalarBufs| -> Result<()> {
        let p = ScalarEncodeParams {
            rows: u(rows)?,
            t: u(t)?,
            d: u(d)?,
            bits: s.bits,
            cb: u(cb)?,
            sigma: s.sigma,
        };
        encode(
            &dev,
            "turboquant_mse/encode",
            "kvq_encode_scalar",
            dispatch::encode_scalar(rows, d),
            &[
                Arg::In(x.buffer(), xo),
                Arg::In(&b.signs, 0),
                Arg::In(&b.thresholds, 0),
                Arg::In(&b.code_of, 0),
                Arg::Out(&out, 0),
                Arg::Bytes(p.as_bytes()),
            ],
        )
    };
    match (keys, values) {
        (Some(k), _) => {
            let Some(data) = k.kernel_data() else {
                bail!("metal: this key codec has no device kernel")
            };
            match (&data.spec, &*key_bufs(&dev, data)?) {
                (KeySpec::Scalar(s), KeyBufs::Scalar(b)) => scalar(s, b)?,
                (KeySpec::Sketch { sketch, outliers }, KeyBufs::Sketch(mats)) => {
                    let p = QjlKeyEncodeParams {
                        rows: u(rows)?,
                        t: u(t)?,
                        d: u(d)?,
                        m: u(sketch.m)?,
                        outliers: u(*outliers)?,
                        cb: u(cb)?,
                    };
                    encode(
                        &dev,
                        "qjl/encode",
                        "kvq_encode_qjl_keys",
                        dispatch::encode_qjl_keys(rows, d),
                        &[
                            Arg::In(x.buffer(), xo),
                            Arg::In(mats, 0),
                            Arg::Out(&out, 0),
                            Arg::Bytes(p.as_bytes()),
                        ],
                    )?
                }
                _ => bail!("metal: no encode kernel for this key codec"),
            }
        }
        (None, Some(v)) => {
            let Some(data) = v.kernel_data() else {
                bail!("metal: this value codec has no device kernel")
            };
            match (&data.spec, &*value_bufs(&dev, data)?) {
                (ValueSpec::Scalar(s), ValueBufs::Scalar(b)) => scalar(s, b)?,
                _ => bail!("metal: no encode kernel for this value codec"),
            }
        }
        (None, None) => bail!("encode: no codec"),
    }
    Ok((
        MetalStorage::new(out, dev, rows * cb, DType::U8),
        Shape::from((heads, t, cb)),
    ))
}

/// The nearest-centroid op on Metal: `x` `[N, sub]`, codebook `[C, sub]` (C at most 256), both
/// contiguous f32, to `[N]` u32.
pub(crate) fn nearest_fwd(
    x: &MetalStorage,
    lx: &Layout,
    c: &MetalStorage,
    lc: &Layout,
) -> Result<(MetalStorage, Shape)> {
    let dev = x.device().clone();
    let (&[n, sub], &[nc, csub]) = (lx.dims(), lc.dims()) else {
        bail!("nearest-centroid: x and the codebook must be matrices")
    };
    if sub != csub || nc == 0 || nc > 256 || !matches!(sub, 1..=8) {
        bail!(
            "metal: nearest-centroid needs [N, s] and [C <= 256, s <= 8], got [{n}, {sub}] / [{nc}, {csub}]"
        )
    }
    if (x.dtype(), c.dtype()) != (DType::F32, DType::F32) {
        bail!("metal: nearest-centroid takes f32")
    }
    let (xo, co) = (offset(x, lx, "x")?, offset(c, lc, "the codebook")?);
    let out = output(&dev, n * 4, "kvq-nearest")?;
    let p = NearestParams {
        n: u32::try_from(n)
            .map_err(|_| candle_core::Error::Msg("metal: too many sub-vectors".into()))?,
        centroids: nc as u32,
        sub: sub as u32,
    };
    encode(
        &dev,
        "vecinfer/encode",
        "kvq_nearest",
        dispatch::nearest(n),
        &[
            Arg::In(x.buffer(), xo),
            Arg::In(c.buffer(), co),
            Arg::Out(&out, 0),
            Arg::Bytes(p.as_bytes()),
        ],
    )?;
    Ok((MetalStorage::new(out, dev, n, DType::U32), Shape::from(n)))
}
