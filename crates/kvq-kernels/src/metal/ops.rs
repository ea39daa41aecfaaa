//! The ops' `metal_fwd` entry points and what they share: which codec specs and shapes have a
//! Metal kernel ([`attend_has_kernel`], [`encode_has_kernel`]), the layouts' byte offsets, the
//! nearest-centroid op, and [`via_cpu`] for the rest. Every builtin method's codecs have a
//! kernel for encode and for the fused decode attention at head dims 64, 128 and 256; the op
//! runs its CPU body on a copy of the inputs ([`via_cpu`]: correct, but a host round trip per
//! call) only for shapes the kernels do not take (another head dim, a codec pair no method
//! uses, a sketch wider than the attention's threadgroup arrays). The attention's body is in
//! [`super::attend_ops`], the encode's in [`super::encode_ops`].

use super::backend::{Arg, encode, output};
use super::dispatch;
use super::params::{AsBytes, NearestParams, vq_books};
use crate::codec::{KeyCodec, ValueCodec};
use crate::spec::{KeySpec, ScalarSpec, ValueSpec};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, DType, Layout, MetalStorage, Result, Shape, bail};

pub(crate) use super::attend_ops::attend_fwd;
pub(crate) use super::encode_ops::encode_fwd;

/// A contiguous layout's byte offset into its buffer.
pub(crate) fn offset(s: &MetalStorage, l: &Layout, what: &str) -> Result<usize> {
    if !l.is_contiguous() {
        bail!("metal: {what} must be contiguous (make it so before the op)")
    }
    Ok(l.start_offset() * s.dtype().size_in_bytes())
}

/// Runs `cpu` (the op's CPU body) on CPU copies of `inputs` and uploads its result: the path
/// of a shape no Metal kernel takes.
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

/// Head dims the Metal kernels take: their threadgroup arrays hold 256 coordinates, an encode
/// threadgroup has one thread per coordinate in whole simdgroups, and the attention's value
/// lanes split `d` into groups of 8 that divide its 128 threads.
pub(crate) fn head_dim_ok(d: usize) -> bool {
    matches!(d, 64 | 128 | 256)
}

/// A scalar codebook the kernels read: 1..=6 bits (the attention's level tables hold 64).
pub(crate) fn scalar_ok(s: &ScalarSpec) -> bool {
    (1..=6).contains(&s.bits) && s.levels.len() == 1 << s.bits
}

/// QJL group values the kernels read: 2, 4 or 8 bits, groups dividing `d` in whole bytes.
pub(crate) fn group_ok(bits: u32, group: usize, d: usize) -> bool {
    matches!(bits, 2 | 4 | 8)
        && group > 0
        && d.is_multiple_of(group)
        && (group * bits as usize).is_multiple_of(8)
}

/// Whether `compressed_attend` has a fused Metal kernel for this codec pair at head dim `d`.
pub(crate) fn attend_has_kernel(keys: &dyn KeyCodec, values: &dyn ValueCodec, d: usize) -> bool {
    if !head_dim_ok(d) {
        return false;
    }
    let (Some(k), Some(v)) = (keys.kernel_data(), values.kernel_data()) else {
        return false;
    };
    match (&k.spec, &v.spec) {
        (KeySpec::Scalar(k), ValueSpec::Scalar(v)) => scalar_ok(k) && scalar_ok(v),
        (KeySpec::ScalarSketch { scalar, sketch }, ValueSpec::Scalar(v)) => {
            scalar_ok(scalar)
                && scalar_ok(v)
                && dispatch::attend_prod(1, 1, 1, d, sketch.m, 1).is_ok()
        }
        (KeySpec::Sketch { sketch, outliers }, ValueSpec::Group { bits, group }) => {
            dispatch::attend_qjl(1, 1, 1, d, sketch.m, 1).is_ok()
                && *outliers <= d / 2
                && group_ok(*bits, *group, d)
        }
        (KeySpec::ProductVq(k), ValueSpec::ProductVq(v)) => {
            vq_books(k, d).is_some() && vq_books(v, d).is_some() && k.lambda.len() == k.signs.len()
        }
        _ => false,
    }
}

/// Whether the encode op has a Metal kernel for this codec's spec at head dim `d`.
pub(crate) fn encode_has_kernel(
    keys: Option<&dyn KeyCodec>,
    values: Option<&dyn ValueCodec>,
    d: usize,
) -> bool {
    if !head_dim_ok(d) {
        return false;
    }
    match (keys, values) {
        (Some(k), _) => match k.kernel_data().map(|k| &k.spec) {
            Some(KeySpec::Scalar(s)) => scalar_ok(s),
            Some(KeySpec::ScalarSketch { scalar, sketch }) => {
                scalar_ok(scalar) && sketch.m > 0 && sketch.m.is_multiple_of(8)
            }
            Some(KeySpec::Sketch { sketch, outliers }) => {
                sketch.m > 0 && sketch.m.is_multiple_of(8) && *outliers <= d
            }
            Some(KeySpec::ProductVq(s)) => {
                vq_books(s, d).is_some() && s.lambda.len() == s.signs.len()
            }
            None => false,
        },
        (None, Some(v)) => match v.kernel_data().map(|v| &v.spec) {
            Some(ValueSpec::Scalar(s)) => scalar_ok(s),
            Some(ValueSpec::Group { bits, group }) => group_ok(*bits, *group, d),
            Some(ValueSpec::ProductVq(s)) => vq_books(s, d).is_some(),
            None => false,
        },
        (None, None) => false,
    }
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
