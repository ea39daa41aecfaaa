//! The harness the emulated decode-attention tests share (tests/attend*.rs): every method's
//! codecs as kvq-cache builds them, random inputs and the CPU op's partial rows on them, the
//! emulated attention kernel then `kvq_combine` with every output poisoned with NaN first, and
//! the comparison (relative L2 of the normalized output and the log-sum-exp). Each test binary
//! uses part of it.
#![allow(dead_code)]

mod cases;

pub use cases::*;

use candle_core::{Device, Tensor};
use kvq_cache::codec::rng::SplitMix;
use kvq_kernels::metal::dispatch::{self, AttendPlan};
use kvq_kernels::metal::params::{
    AsBytes, CombineParams, QjlAttendParams, ScalarAttendParams, vq_book_norms,
};
use kvq_kernels::{AttendParams, compressed_attend, encode_keys, encode_values};
use kvq_metal_emu::{Order, f32_bytes, run};

pub const KVH: usize = 2;
/// fp32 throughout: the kernel and the CPU op differ only in summation order.
pub const BOUND: f64 = 1e-4;
/// `kvq_attend_vq_lut`: its key scores come from a 16-bit fixed-point table (each entry within
/// 2^-17 of its sub-position's range, about 1e-5 of a row's score), not from f32 dot products.
pub const TABLE_BOUND: f64 = 1e-3;
/// VecInfer's table kernel.
pub const VQ_TABLE: &str = "kvq_attend_vq_lut";

pub fn decode_params(n: usize, d: usize) -> AttendParams {
    AttendParams {
        scale: 1.0 / (d as f32).sqrt(),
        first_pos: n,
        window: 1,
        sinks: 0,
        sliding_window: None,
        code_first: 0,
        exact_before: 0,
    }
}

/// A decode at `pos` under a sliding window of `sliding` positions over rolled codes (code row 0
/// at `pos + 1 - sliding`), with 4 sinks, a 64-position fp16 window and the first 16 positions
/// exact; softmax scale 1/8.
pub fn rolled_params(pos: usize, sliding: usize) -> AttendParams {
    AttendParams {
        scale: 0.125,
        first_pos: pos,
        window: 64,
        sinks: 4,
        sliding_window: Some(sliding),
        code_first: pos + 1 - sliding,
        exact_before: 16,
    }
}

/// A prefill of `t` query rows whose last is at position `n - 1` (head dim `d`'s scale).
pub fn prefill_params(n: usize, t: usize, d: usize) -> AttendParams {
    AttendParams {
        first_pos: n + 1 - t,
        ..decode_params(n, d)
    }
}

/// Random queries, keys and values of one shape, the codes the CPU codecs make of them, and the
/// CPU op's partial rows.
pub struct Inputs {
    pub d: usize,
    pub nh: usize,
    pub t: usize,
    pub n: usize,
    pub p: AttendParams,
    pub q: Vec<f32>,
    pub kc: Vec<u8>,
    pub vc: Vec<u8>,
    pub cpu: Vec<f32>,
}

pub fn inputs(
    c: &Case,
    d: usize,
    group: usize,
    n: usize,
    t: usize,
    p: AttendParams,
    seed: u64,
) -> Inputs {
    let nh = KVH * group;
    let host = |x: Vec<f32>, dims: &[usize]| Tensor::from_vec(x, dims, &Device::Cpu).unwrap();
    let gauss = |n, s| SplitMix::new(seed.wrapping_mul(3).wrapping_add(s)).gauss_vec(n);
    let k = host(gauss(KVH * n * d, 1), &[KVH, n, d]);
    let v = host(gauss(KVH * n * d, 2), &[KVH, n, d]);
    let qv = gauss(nh * t * d, 3);
    let q = host(qv.clone(), &[nh, t, d]);
    let kc = encode_keys(&c.keys, &k).unwrap();
    let vc = encode_values(&c.values, &v).unwrap();
    let cpu = compressed_attend(&c.keys, &c.values, p, &q, &kc, &vc).unwrap();
    let bytes = |x: &Tensor| x.flatten_all().unwrap().to_vec1::<u8>().unwrap();
    Inputs {
        d,
        nh,
        t,
        n,
        p,
        q: qv,
        kc: bytes(&kc),
        vc: bytes(&vc),
        cpu: cpu.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
    }
}

pub fn nan_bytes(floats: usize) -> Vec<u8> {
    f32_bytes(&vec![f32::NAN; floats])
}

pub fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
        .collect()
}

/// The most code rows one query row of `x` reads.
pub fn max_rows(x: &Inputs) -> usize {
    (0..x.t)
        .map(|r| {
            let (r0, r1) = x.p.code_rows(x.p.first_pos + r);
            r1.min(x.n).saturating_sub(r0)
        })
        .max()
        .unwrap_or(0)
}

/// The plan and buffers of `c`'s attention kernel on `x`, as `metal_fwd` binds them: the partial
/// rows, merged rows and split counters empty, at indices `len - 4`, `len - 3` and `len - 2`.
/// With `merge` (and more than one split) the kernel's last split threadgroups merge.
fn bind(
    c: &Case,
    x: &Inputs,
    attend: &str,
    merge: bool,
) -> Result<(AttendPlan, Vec<Vec<u8>>), String> {
    let (q, kc, vc) = (f32_bytes(&x.q), x.kc.clone(), x.vc.clone());
    let (nh, t, d, n, mr) = (x.nh, x.t, x.d, x.n, max_rows(x));
    let widths = |kcb: u32, vcb: u32| match kcb as usize == c.keys.code_bytes()
        && vcb as usize == c.values.code_bytes()
    {
        true => Ok(()),
        false => Err("the parameters' code widths are not the codecs'".to_string()),
    };
    let out = match &c.spec {
        Spec::Scalar { k, v } => {
            let plan = dispatch::attend_scalar(nh, KVH, t, d, mr)?;
            let prm = ScalarAttendParams::new(&plan, &x.p, n, d, k, v)
                .ok_or("parameters out of range")?;
            widths(prm.kcb, prm.vcb)?;
            let mut bufs = vec![
                q,
                kc,
                vc,
                f32_bytes(&k.levels),
                f32_bytes(&k.signs),
                f32_bytes(&v.levels),
                f32_bytes(&v.signs),
            ];
            bufs.extend(outputs(merged(prm, &plan, merge).as_bytes()));
            (plan, bufs)
        }
        Spec::Prod { k, sketch, v } => {
            let plan = dispatch::attend_prod(nh, KVH, t, d, sketch.m, mr)?;
            let prm = ScalarAttendParams::prod(&plan, &x.p, n, d, k, sketch.m, v)
                .ok_or("parameters out of range")?;
            widths(prm.kcb, prm.vcb)?;
            let mut bufs = vec![
                q,
                kc,
                vc,
                f32_bytes(&k.levels),
                f32_bytes(&k.signs),
                f32_bytes(&v.levels),
                f32_bytes(&v.signs),
                f32_bytes(&sketch.matrices),
            ];
            bufs.extend(outputs(merged(prm, &plan, merge).as_bytes()));
            (plan, bufs)
        }
        Spec::Qjl {
            m,
            outliers,
            mats,
            vbits,
            vgroup,
        } => {
            let plan = dispatch::attend_qjl(nh, KVH, t, d, *m, mr)?;
            let mut prm = QjlAttendParams::new(&plan, &x.p, n, d, *m, *outliers, *vbits, *vgroup)
                .ok_or("parameters out of range")?;
            widths(prm.kcb, prm.vcb)?;
            prm.merge = u32::from(merge && plan.n_splits > 1);
            let mut bufs = vec![q, kc, vc, f32_bytes(mats)];
            bufs.extend(outputs(prm.as_bytes()));
            (plan, bufs)
        }
        Spec::Vq { k, v } => {
            let table = attend.ends_with(VQ_TABLE);
            let plan = match table {
                true => dispatch::attend_vq_table(nh, KVH, t, d, k.sub, mr)?
                    .ok_or("the table kernel declines this shape")?,
                false => dispatch::attend_vq(nh, KVH, t, d, mr)?,
            };
            let prm =
                ScalarAttendParams::vq(&plan, &x.p, n, d, k, v).ok_or("parameters out of range")?;
            widths(prm.kcb, prm.vcb)?;
            let mut bufs = vec![
                q,
                kc,
                vc,
                f32_bytes(&k.books),
                f32_bytes(&k.signs),
                f32_bytes(&k.lambda),
            ];
            if table {
                bufs.push(f32_bytes(&vq_book_norms(k)));
            }
            bufs.extend([f32_bytes(&v.books), f32_bytes(&v.signs)]);
            bufs.extend(outputs(merged(prm, &plan, merge).as_bytes()));
            (plan, bufs)
        }
    };
    Ok(out)
}

/// The last four arguments of an attention kernel: its partial rows, merged rows and split
/// counters (empty until a run fills them), then its parameters.
fn outputs(params: Vec<u8>) -> [Vec<u8>; 4] {
    [Vec::new(), Vec::new(), Vec::new(), params]
}

/// `prm` with the merge asked for when `merge` and `plan` splits.
fn merged(mut prm: ScalarAttendParams, plan: &AttendPlan, merge: bool) -> ScalarAttendParams {
    prm.merge = u32::from(merge && plan.n_splits > 1);
    prm
}

/// What one emulated attention dispatch left.
struct Run {
    plan: AttendPlan,
    /// The partial rows, every slot written.
    part: Vec<u8>,
    /// Merging over several splits: the merged rows.
    merged: Option<Vec<u8>>,
}

/// Runs attention kernel `attend` on the emulator, merging its own splits with `merge`: the
/// plan, its partial rows (poisoned with NaN first, every slot checked written) and, merging
/// over several splits, the merged rows (poisoned too; the split counters start at zero and
/// must each have counted every split).
fn emu_run(c: &Case, x: &Inputs, attend: &str, order: Order, merge: bool) -> Result<Run, String> {
    let (plan, mut bufs) = bind(c, x, attend, merge)?;
    let (ps, os, cs) = (bufs.len() - 4, bufs.len() - 3, bufs.len() - 2);
    let merging = merge && plan.n_splits > 1;
    let counters = x.t * KVH * plan.hchunks;
    bufs[ps] = nan_bytes(x.nh * x.t * plan.n_splits * (x.d + 2));
    if merging {
        bufs[os] = nan_bytes(x.nh * x.t * (x.d + 2));
        bufs[cs] = vec![0; 4 * counters];
    }
    let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    run(attend, plan.attend, order, &mut refs).map_err(|e| e.to_string())?;
    if let Some(i) = floats(&bufs[ps]).iter().position(|v| v.is_nan()) {
        return Err(format!("partial slot {i} of the attention left unwritten"));
    }
    if !merging {
        let part = bufs.swap_remove(ps);
        return Ok(Run {
            plan,
            part,
            merged: None,
        });
    }
    let counts: Vec<u32> = bufs[cs]
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    if let Some(i) = counts.iter().position(|&n| n as usize != plan.n_splits) {
        return Err(format!(
            "split counter {i} counted {} of {} splits",
            counts[i], plan.n_splits
        ));
    }
    let merged = Some(bufs.swap_remove(os));
    Ok(Run {
        plan,
        part: bufs.swap_remove(ps),
        merged,
    })
}

/// Runs attention kernel `attend` on the emulator (no merge): the plan and its partial rows
/// (poisoned with NaN first, every slot checked written).
pub fn emu_part(
    c: &Case,
    x: &Inputs,
    attend: &str,
    order: Order,
) -> Result<(AttendPlan, Vec<u8>), String> {
    let run = emu_run(c, x, attend, order, false)?;
    Ok((run.plan, run.part))
}

/// The attention with its last split threadgroups merging (the MSL 3.2 path: one dispatch) on
/// the emulator: the merged rows `[nh][t][d + 2]` (one split: the partial rows) and the plan.
pub fn emu_merged(
    c: &Case,
    x: &Inputs,
    attend: &str,
    order: Order,
) -> Result<(Vec<f32>, AttendPlan), String> {
    let run = emu_run(c, x, attend, order, true)?;
    let rows = floats(run.merged.as_deref().unwrap_or(&run.part));
    if let Some(i) = rows.iter().position(|v| v.is_nan()) {
        return Err(format!("merged slot {i} left unwritten"));
    }
    Ok((rows, run.plan))
}

/// The attention (`attend` kernel) then the combine (`combine` kernel, `normalize` 0 or 1) on
/// the emulator, outputs poisoned with NaN; the merged rows `[nh][t][d + 2]` and the plan.
pub fn emu_attend(
    c: &Case,
    x: &Inputs,
    attend: &str,
    combine: &str,
    normalize: u32,
    order: Order,
) -> Result<(Vec<f32>, AttendPlan), String> {
    let (plan, mut part) = emu_part(c, x, attend, order)?;
    let width = x.d + 2;
    let mut out = nan_bytes(x.nh * x.t * width);
    let cp = CombineParams {
        rows: (x.nh * x.t) as u32,
        n_splits: plan.n_splits as u32,
        d: x.d as u32,
        normalize,
    };
    run(
        combine,
        plan.combine,
        order,
        &mut [&mut part, &mut out, &mut cp.as_bytes()],
    )
    .map_err(|e| e.to_string())?;
    let out = floats(&out);
    if out.iter().any(|v| v.is_nan()) {
        return Err("NaN in the combined rows (unwritten?)".into());
    }
    if plan.n_splits == 1 && normalize == 0 {
        // The Metal op returns one split's partial rows without the combine (attend_ops.rs):
        // they must equal its output exactly (as numbers: the combine's fma turns -0 into 0).
        let part = floats(&part);
        if let Some(i) = (0..out.len()).find(|&i| out[i] != part[i]) {
            return Err(format!(
                "one split: combined slot {i} is {} where the partial row holds {}",
                out[i], part[i]
            ));
        }
        return Ok((part, plan));
    }
    Ok((out, plan))
}

/// Normalized outputs and log-sum-exps of `[.., d + 2]` partial rows (an empty range: zeros and
/// -inf, which it must be exactly).
pub fn normalized(rows: &[f32], d: usize) -> Result<(Vec<f32>, Vec<f32>), String> {
    let (mut out, mut lse) = (Vec::new(), Vec::new());
    for r in rows.chunks_exact(d + 2) {
        let (m, l) = (r[d], r[d + 1]);
        if l > 0.0 {
            out.extend(r[..d].iter().map(|x| x / l));
            lse.push(m + l.ln());
        } else {
            if !(m == f32::NEG_INFINITY && r[..d].iter().all(|&x| x == 0.0)) {
                return Err(format!("an empty row is not the empty state: max {m}"));
            }
            out.extend(std::iter::repeat_n(0.0, d));
            lse.push(f32::NEG_INFINITY);
        }
    }
    Ok((out, lse))
}

pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// The emulated attention against the CPU op on `x`, its splits merged both ways ([`errors`]):
/// Ok when the relative L2 of the normalized outputs and the largest log-sum-exp difference
/// (relative to the log-sum-exp where that is over 1) are under [`BOUND`] ([`TABLE_BOUND`] for
/// VecInfer's table kernel).
pub fn check(
    c: &Case,
    x: &Inputs,
    attend: &str,
    combine: &str,
    order: Order,
) -> Result<(), String> {
    let bound = match attend.ends_with(VQ_TABLE) {
        true => TABLE_BOUND,
        false => BOUND,
    };
    let (e, dl, plan) = errors(c, x, attend, combine, order)?;
    match e < bound && dl < bound {
        true => Ok(()),
        false => Err(format!(
            "rel L2 {e:.3e}, |dlse| {dl:.3e} ({} splits of {} rows)",
            plan.n_splits, plan.split_rows
        )),
    }
}

/// The relative L2 error of the normalized outputs and the largest log-sum-exp difference
/// (relative where the log-sum-exp is over 1) of the emulated kernels against the CPU op, the
/// worse of the two ways a split decode is merged: `combine` in a second dispatch, and the
/// attention's own last threadgroups (the MSL 3.2 path).
pub fn errors(
    c: &Case,
    x: &Inputs,
    attend: &str,
    combine: &str,
    order: Order,
) -> Result<(f64, f64, AttendPlan), String> {
    let (two, plan) = emu_attend(c, x, attend, combine, 0, order)?;
    let (e2, dl2) = against_cpu(&two, x)?;
    if plan.n_splits == 1 {
        // Nothing to merge: emu_attend checked the partial rows are the combine's output.
        return Ok((e2, dl2, plan));
    }
    let (one, _) = emu_merged(c, x, attend, order)?;
    let (e1, dl1) = against_cpu(&one, x)?;
    Ok((e2.max(e1), dl2.max(dl1), plan))
}

/// The relative L2 error of `got`'s normalized outputs against the CPU op's and the largest
/// log-sum-exp difference.
fn against_cpu(got: &[f32], x: &Inputs) -> Result<(f64, f64), String> {
    let (og, lg) = normalized(got, x.d)?;
    let (oc, lc) = normalized(&x.cpu, x.d)?;
    let dl = lg
        .iter()
        .zip(&lc)
        .map(|(a, b)| {
            if a == b {
                0.0
            } else {
                f64::from((a - b).abs() / b.abs().max(1.0))
            }
        })
        .fold(0.0, f64::max);
    Ok((rel_l2(&og, &oc), dl))
}

/// A negative control: on decode over 3000 positions with range `p` (head dim 64, 4 query heads
/// per kv head), the real kernels pass, and `attend` + `combine` fail the check under every
/// lane order.
pub fn assert_caught_at(c: &Case, p: AttendParams, real: &str, attend: &str, combine: &str) {
    let x = inputs(c, 64, 4, 3000, 1, p, 9);
    check(c, &x, real, "kvq_combine", Order::Forward).expect("the real kernels");
    for order in kvq_metal_emu::ORDERS {
        assert!(
            check(c, &x, attend, combine, order).is_err(),
            "{attend} + {combine} {order:?} passed the parity check"
        );
    }
}
