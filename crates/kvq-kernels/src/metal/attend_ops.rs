//! `compressed_attend`'s `metal_fwd` body: one fused decode attention dispatch per call (every
//! query head and row of a layer, split over the code rows as [`super::dispatch`] plans it).
//! When it splits the rows, the last split threadgroup of each row merges them where the library
//! compiled as MSL 3.2 (macOS 15, iOS 18: device-scope fences order memory between the
//! threadgroups of one dispatch; still one dispatch); on older systems `kvq_combine` merges them
//! in a second dispatch. The kernel is picked by
//! the codecs' specs: `kvq_attend_scalar` (TurboQuant-MSE and -RVQ), `kvq_attend_prod`
//! (TurboQuant-Prod), `kvq_attend_qjl` (QJL) and, for VecInfer, `kvq_attend_vq_lut` (a per-query
//! table of scores) where [`dispatch::attend_vq_table`] plans it, else `kvq_attend_vq`
//! (centroids gathered).

use super::backend::{
    Arg, KeyBufs, ScalarBufs, ValueBufs, encode, key_bufs, merges, output, value_bufs,
};
use super::dispatch::{self, AttendPlan};
use super::ops::offset;
use super::params::{AsBytes, CombineParams, QjlAttendParams, ScalarAttendParams};
use crate::attend::AttendParams;
use crate::codec::{KeyCodec, ValueCodec};
use crate::spec::{KeySpec, ValueSpec};
use candle_core::backend::BackendStorage;
use candle_core::{DType, Layout, MetalStorage, Result, Shape, bail};

fn range(what: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!("metal: attend: {what} out of range"))
}

/// The query and code arguments, then the key and value levels and signs: the scalar layout's
/// first seven (TurboQuant-Prod's sketch matrices follow).
fn scalar_args<'a>(qkv: [Arg<'a>; 3], kx: &'a ScalarBufs, vx: &'a ScalarBufs) -> Vec<Arg<'a>> {
    let mut v = Vec::from(qkv);
    v.extend([
        Arg::In(&kx.levels, 0),
        Arg::In(&kx.signs, 0),
        Arg::In(&vx.levels, 0),
        Arg::In(&vx.signs, 0),
    ]);
    v
}

fn plan_err(e: String) -> candle_core::Error {
    candle_core::Error::Msg(e)
}

/// `compressed_attend` on Metal: q `[nh, t, d]` f32, codes `[kvh, n, cb]` u8, all contiguous;
/// `[nh, t, d + 2]` partial states as the CPU op returns them. The attention kernel writes one
/// partial row per split, `kvq_combine` merges them (unnormalized) when there are several.
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
    let (&[nh, t, d], &[kvh, n, kcb], &[vh, vn, vcb]) = (lq.dims(), lk.dims(), lv.dims()) else {
        bail!("metal: attend takes rank-3 queries and codes")
    };
    crate::attend::check_attend(keys, values, &p, nh, t, d, (kvh, n, kcb), (vh, vn, vcb))?;
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
    let (kb, vb) = (key_bufs(&dev, kd)?, value_bufs(&dev, vd)?);
    let (qa, ka, va) = (
        Arg::In(q.buffer(), qo),
        Arg::In(k.buffer(), ko),
        Arg::In(v.buffer(), vo),
    );
    // The widths the kernel's parameters imply must be the codecs' (check_attend checked those
    // against the codes).
    let widths = |kw: u32, vw: u32| -> Result<()> {
        if kw as usize != kcb || vw as usize != vcb {
            bail!("metal: attend: the code widths are not the kernel's layout")
        }
        Ok(())
    };
    // Whether the kernel merges its own splits (one dispatch; `backend::merges`).
    let merged = |plan: &AttendPlan, file: &'static str| -> Result<u32> {
        Ok(u32::from(plan.n_splits > 1 && merges(&dev, file)?))
    };
    // Each kernel's plan, library and name, its arguments before the partial rows, its
    // parameters' bytes, and whether it merges.
    let (plan, file, name, head, bytes, merge) = match (&kd.spec, &vd.spec, &*kb, &*vb) {
        (
            KeySpec::Scalar(ks),
            ValueSpec::Scalar(vs),
            KeyBufs::Scalar(kx),
            ValueBufs::Scalar(vx),
        ) => {
            let plan = dispatch::attend_scalar(nh, kvh, t, d, max_rows).map_err(plan_err)?;
            let mut prm = ScalarAttendParams::new(&plan, &p, n, d, ks, vs)
                .ok_or_else(|| range("a position"))?;
            widths(prm.kcb, prm.vcb)?;
            let file = "turboquant_mse/attend";
            prm.merge = merged(&plan, file)?;
            let head = scalar_args([qa, ka, va], kx, vx);
            let name = "kvq_attend_scalar";
            (plan, file, name, head, prm.as_bytes(), prm.merge != 0)
        }
        (
            KeySpec::ScalarSketch { scalar, sketch },
            ValueSpec::Scalar(vs),
            KeyBufs::ScalarSketch(kx, mats),
            ValueBufs::Scalar(vx),
        ) => {
            let plan =
                dispatch::attend_prod(nh, kvh, t, d, sketch.m, max_rows).map_err(plan_err)?;
            let mut prm = ScalarAttendParams::prod(&plan, &p, n, d, scalar, sketch.m, vs)
                .ok_or_else(|| range("a position or the sketch"))?;
            widths(prm.kcb, prm.vcb)?;
            let file = "turboquant_prod/attend";
            prm.merge = merged(&plan, file)?;
            let mut head = scalar_args([qa, ka, va], kx, vx);
            head.push(Arg::In(mats, 0));
            let name = "kvq_attend_prod";
            (plan, file, name, head, prm.as_bytes(), prm.merge != 0)
        }
        (
            KeySpec::Sketch { sketch, outliers },
            ValueSpec::Group { bits, group },
            KeyBufs::Sketch(mats),
            ValueBufs::Group,
        ) => {
            let plan = dispatch::attend_qjl(nh, kvh, t, d, sketch.m, max_rows).map_err(plan_err)?;
            let mut prm = QjlAttendParams::new(&plan, &p, n, d, sketch.m, *outliers, *bits, *group)
                .ok_or_else(|| range("a position or code layout"))?;
            widths(prm.kcb, prm.vcb)?;
            let file = "qjl/attend";
            prm.merge = merged(&plan, file)?;
            let head = vec![qa, ka, va, Arg::In(mats, 0)];
            let name = "kvq_attend_qjl";
            (plan, file, name, head, prm.as_bytes(), prm.merge != 0)
        }
        (
            KeySpec::ProductVq(ks),
            ValueSpec::ProductVq(vs),
            KeyBufs::ProductVq(kx),
            ValueBufs::ProductVq(vx),
        ) => {
            let (Some(lambda), Some(norms)) = (&kx.lambda, &kx.norms) else {
                bail!("metal: attend: VecInfer keys without smoothing factors")
            };
            let table =
                dispatch::attend_vq_table(nh, kvh, t, d, ks.sub, max_rows).map_err(plan_err)?;
            let plan = match table {
                Some(plan) => plan,
                None => dispatch::attend_vq(nh, kvh, t, d, max_rows).map_err(plan_err)?,
            };
            let mut prm = ScalarAttendParams::vq(&plan, &p, n, d, ks, vs)
                .ok_or_else(|| range("a position or the codebooks"))?;
            widths(prm.kcb, prm.vcb)?;
            let file = "vecinfer/attend";
            prm.merge = merged(&plan, file)?;
            let mut head = vec![
                qa,
                ka,
                va,
                Arg::In(&kx.books, 0),
                Arg::In(&kx.signs, 0),
                Arg::In(lambda, 0),
            ];
            let name = match table {
                Some(_) => {
                    head.push(Arg::In(norms, 0));
                    "kvq_attend_vq_lut"
                }
                None => "kvq_attend_vq",
            };
            head.extend([Arg::In(&vx.books, 0), Arg::In(&vx.signs, 0)]);
            (plan, file, name, head, prm.as_bytes(), prm.merge != 0)
        }
        _ => bail!("metal: no fused attention kernel for this key / value pair"),
    };
    let part = output(&dev, nh * t * plan.n_splits * width * 4, "kvq-attend-part")?;
    // Merging: the merged rows, and one split counter per (query row, kv head, head chunk),
    // zero. Otherwise the kernel never touches those two arguments: the partial rows stand in.
    let merged_out = match merge {
        true => Some((
            output(&dev, nh * t * width * 4, "kvq-attend-out")?,
            dev.new_buffer_with_data(&vec![0u32; plan.t * kvh * plan.hchunks])?,
        )),
        false => None,
    };
    let (out_arg, counters_arg) = match &merged_out {
        Some((o, c)) => (o, c),
        None => (&part, &part),
    };
    let mut args = head;
    args.extend([
        Arg::Out(&part, 0),
        Arg::Out(out_arg, 0),
        Arg::Out(counters_arg, 0),
        Arg::Bytes(bytes),
    ]);
    encode(&dev, file, name, plan.attend, &args)?;
    if let Some((out, _)) = merged_out {
        // The kernel's last split threadgroups merged: one dispatch.
        return Ok((
            MetalStorage::new(out, dev, nh * t * width, DType::F32),
            Shape::from((nh, t, width)),
        ));
    }
    if plan.n_splits == 1 {
        // One split: its partial rows are already the merged state (the combine would multiply
        // each by exp(0) = 1 and add nothing), so a call is one dispatch.
        return Ok((
            MetalStorage::new(part, dev, nh * t * width, DType::F32),
            Shape::from((nh, t, width)),
        ));
    }
    // Split, without MSL 3.2: kvq_combine merges the splits in a second dispatch.
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
