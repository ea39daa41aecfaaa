//! The harness the emulated decode-attention tests share (tests/attend*.rs): every method's
//! codecs as kvq-cache builds them, random inputs and the CPU op's partial rows on them, the
//! emulated attention kernel then `kvq_combine` with every output poisoned with NaN first, and
//! the comparison (relative L2 of the normalized output and the log-sum-exp). Each test binary
//! uses part of it.
#![allow(dead_code)]

use candle_core::{Device, Tensor};
use kvq_cache::codec::rng::SplitMix;
use kvq_cache::compressed::{KeyCodec, ValueCodec};
use kvq_cache::methods::qjl::{GroupCodec, QjlKeyCodec};
use kvq_cache::methods::turboquant_mse::MseCodec;
use kvq_cache::methods::turboquant_prod::ProdKeyCodec;
use kvq_cache::methods::turboquant_rvq::RvqCodec;
use kvq_cache::methods::vecinfer::codec::{ValueAccum, VqKeyCodec, VqValueCodec};
use kvq_kernels::metal::dispatch::{self, AttendPlan};
use kvq_kernels::metal::params::{
    AsBytes, CombineParams, QjlAttendParams, ScalarAttendParams, vq_book_norms,
};
use kvq_kernels::spec::{KeySpec, ScalarSpec, SketchSpec, ValueSpec, VqSpec};
use kvq_kernels::{AttendParams, compressed_attend, encode_keys, encode_values};
use kvq_metal_emu::{Order, f32_bytes, run};
use std::sync::Arc;

pub const KVH: usize = 2;
/// fp32 throughout: the kernel and the CPU op differ only in summation order.
pub const BOUND: f64 = 1e-4;
/// `kvq_attend_vq_lut`: its key scores come from a 16-bit fixed-point table (each entry within
/// 2^-17 of its sub-position's range, about 1e-5 of a row's score), not from f32 dot products.
pub const TABLE_BOUND: f64 = 1e-3;
/// VecInfer's table kernel.
pub const VQ_TABLE: &str = "kvq_attend_vq_lut";

/// What the emulated kernel reads besides the codes: the codecs' specs.
pub enum Spec {
    Scalar {
        k: ScalarSpec,
        v: ScalarSpec,
    },
    Prod {
        k: ScalarSpec,
        sketch: SketchSpec,
        v: ScalarSpec,
    },
    Qjl {
        m: usize,
        outliers: usize,
        mats: Vec<f32>,
        vbits: u32,
        vgroup: usize,
    },
    Vq {
        k: VqSpec,
        v: VqSpec,
    },
}

impl Spec {
    /// The attention kernel of this layout.
    pub fn kernel(&self) -> &'static str {
        match self {
            Spec::Scalar { .. } => "kvq_attend_scalar",
            Spec::Prod { .. } => "kvq_attend_prod",
            Spec::Qjl { .. } => "kvq_attend_qjl",
            Spec::Vq { .. } => "kvq_attend_vq",
        }
    }
}

pub struct Case {
    pub name: String,
    pub keys: Arc<dyn KeyCodec>,
    pub values: Arc<dyn ValueCodec>,
    pub spec: Spec,
}

pub fn case(name: String, keys: Arc<dyn KeyCodec>, values: Arc<dyn ValueCodec>) -> Case {
    let ks = keys.kernel_data().map(|k| k.spec.clone());
    let vs = values.kernel_data().map(|v| v.spec.clone());
    let spec = match (ks, vs) {
        (Some(KeySpec::Scalar(k)), Some(ValueSpec::Scalar(v))) => Spec::Scalar { k, v },
        (Some(KeySpec::ScalarSketch { scalar, sketch }), Some(ValueSpec::Scalar(v))) => {
            Spec::Prod {
                k: scalar,
                sketch,
                v,
            }
        }
        (Some(KeySpec::Sketch { sketch, outliers }), Some(ValueSpec::Group { bits, group })) => {
            Spec::Qjl {
                m: sketch.m,
                outliers,
                mats: sketch.matrices.to_vec(),
                vbits: bits,
                vgroup: group,
            }
        }
        (Some(KeySpec::ProductVq(k)), Some(ValueSpec::ProductVq(v))) => Spec::Vq { k, v },
        other => panic!("{name}: no Metal attention for {other:?}"),
    };
    Case {
        name,
        keys,
        values,
        spec,
    }
}

/// TurboQuant-MSE at `bits` (keys and values with their own rotations: other seeds).
pub fn mse(d: usize, bits: u32) -> Case {
    let k = MseCodec::new(d, KVH, bits, 3, 11).expect("mse keys");
    let v = MseCodec::new(d, KVH, bits, 3, 12).expect("mse values");
    case(format!("mse-{bits}"), Arc::new(k), Arc::new(v))
}

pub fn rvq(d: usize, bits: u32) -> Case {
    let k = RvqCodec::new(d, KVH, bits, 3, 11).expect("rvq keys");
    let v = RvqCodec::new(d, KVH, bits, 3, 12).expect("rvq values");
    case(format!("rvq-{bits}"), Arc::new(k), Arc::new(v))
}

/// TurboQuant-Prod at `bits` (an MSE stage of `bits - 1`, the residual sketch, MSE values of
/// `bits`), as the method builds it.
pub fn prod(d: usize, bits: u32) -> Case {
    let k = ProdKeyCodec::new(d, KVH, bits, 3, 11).expect("prod keys");
    let v = MseCodec::new(d, KVH, bits, 3, 12).expect("mse values");
    case(format!("prod-{bits}"), Arc::new(k), Arc::new(v))
}

/// QJL at sketch dimension `m` with `outliers` exact channels, values at `vbits` in groups of
/// `vgroup`.
pub fn qjl(d: usize, m: usize, outliers: usize, vbits: u32, vgroup: usize) -> Case {
    let k = QjlKeyCodec::new(d, KVH, m, outliers, 3, 11).expect("qjl keys");
    let v = GroupCodec::new(d, vbits, vgroup).expect("qjl values");
    case(
        format!("qjl m{m} o{outliers} v{vbits}/{vgroup}"),
        Arc::new(k),
        Arc::new(v),
    )
}

/// QJL's codecs as cuda_parity.rs runs them: the sketch sizes of the 3- and 4-bit presets (one
/// and four exact outlier channels), values at 2 and 4 bits in groups of 64; and 8-bit values in
/// groups of 32 with no outliers.
pub fn qjl_cases(d: usize) -> Vec<Case> {
    vec![
        qjl(d, 3 * d - d / 8 * 3, 1, 2, 64.min(d)),
        qjl(d, 4 * d + 8, 4, 4, 64.min(d)),
        qjl(d, 2 * d, 0, 8, 32),
    ]
}

/// VecInfer codebooks and smoothing factors as calibration would give them, made up: `[books]
/// [256][sub]` Gaussian centroids (scaled to the coded vectors' spread), lambdas in [0.5, 2).
pub fn vq_books(d: usize, sub: usize, per_position: bool, seed: u64) -> Vec<f32> {
    let books = if per_position { d / sub } else { 1 };
    let mut r = SplitMix::new(seed);
    r.gauss_vec(books * 256 * sub)
        .into_iter()
        .map(|x| 0.9 * x)
        .collect()
}

pub fn vq_lambda(d: usize, seed: u64) -> Vec<f32> {
    let mut r = SplitMix::new(seed);
    (0..KVH * d)
        .map(|_| 0.5 + 1.5 * (r.next_u64() >> 11) as f32 / (1u64 << 53) as f32)
        .collect()
}

/// VecInfer's key and value codecs at sub-vector length `sub`, codebooks shared or one per
/// sub-position, values accumulated as the method does (histogram for long runs).
pub fn vq(d: usize, sub: usize, per_position: bool) -> Case {
    let lambda = vq_lambda(d, 41);
    let k = VqKeyCodec::new(d, sub, 3, 11, &lambda, &vq_books(d, sub, per_position, 42))
        .expect("vq keys");
    let v = VqValueCodec::new(
        d,
        sub,
        3,
        11,
        KVH,
        &vq_books(d, sub, per_position, 43),
        ValueAccum::Auto(256),
    )
    .expect("vq values");
    let books = if per_position {
        "per position"
    } else {
        "shared"
    };
    case(format!("vq s{sub} {books}"), Arc::new(k), Arc::new(v))
}

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

/// The plan and buffers (the partial rows empty, at index `len - 2`) of `c`'s attention kernel
/// on `x`, as `metal_fwd` binds them.
fn bind(c: &Case, x: &Inputs, attend: &str) -> Result<(AttendPlan, Vec<Vec<u8>>), String> {
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
            let bufs = vec![
                q,
                kc,
                vc,
                f32_bytes(&k.levels),
                f32_bytes(&k.signs),
                f32_bytes(&v.levels),
                f32_bytes(&v.signs),
                Vec::new(),
                prm.as_bytes(),
            ];
            (plan, bufs)
        }
        Spec::Prod { k, sketch, v } => {
            let plan = dispatch::attend_prod(nh, KVH, t, d, sketch.m, mr)?;
            let prm = ScalarAttendParams::prod(&plan, &x.p, n, d, k, sketch.m, v)
                .ok_or("parameters out of range")?;
            widths(prm.kcb, prm.vcb)?;
            let bufs = vec![
                q,
                kc,
                vc,
                f32_bytes(&k.levels),
                f32_bytes(&k.signs),
                f32_bytes(&v.levels),
                f32_bytes(&v.signs),
                f32_bytes(&sketch.matrices),
                Vec::new(),
                prm.as_bytes(),
            ];
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
            let prm = QjlAttendParams::new(&plan, &x.p, n, d, *m, *outliers, *vbits, *vgroup)
                .ok_or("parameters out of range")?;
            widths(prm.kcb, prm.vcb)?;
            (
                plan,
                vec![q, kc, vc, f32_bytes(mats), Vec::new(), prm.as_bytes()],
            )
        }
        Spec::Vq { k, v } if attend.ends_with(VQ_TABLE) => {
            let plan = dispatch::attend_vq_table(nh, KVH, t, d, k.sub, mr)?
                .ok_or("the table kernel declines this shape")?;
            let prm =
                ScalarAttendParams::vq(&plan, &x.p, n, d, k, v).ok_or("parameters out of range")?;
            widths(prm.kcb, prm.vcb)?;
            let bufs = vec![
                q,
                kc,
                vc,
                f32_bytes(&k.books),
                f32_bytes(&k.signs),
                f32_bytes(&k.lambda),
                f32_bytes(&vq_book_norms(k)),
                f32_bytes(&v.books),
                f32_bytes(&v.signs),
                Vec::new(),
                prm.as_bytes(),
            ];
            (plan, bufs)
        }
        Spec::Vq { k, v } => {
            let plan = dispatch::attend_vq(nh, KVH, t, d, mr)?;
            let prm =
                ScalarAttendParams::vq(&plan, &x.p, n, d, k, v).ok_or("parameters out of range")?;
            widths(prm.kcb, prm.vcb)?;
            let bufs = vec![
                q,
                kc,
                vc,
                f32_bytes(&k.books),
                f32_bytes(&k.signs),
                f32_bytes(&k.lambda),
                f32_bytes(&v.books),
                f32_bytes(&v.signs),
                Vec::new(),
                prm.as_bytes(),
            ];
            (plan, bufs)
        }
    };
    Ok(out)
}

/// Runs attention kernel `attend` on the emulator: the plan and its partial rows (poisoned with
/// NaN first, every slot checked written).
pub fn emu_part(
    c: &Case,
    x: &Inputs,
    attend: &str,
    order: Order,
) -> Result<(AttendPlan, Vec<u8>), String> {
    let (plan, mut bufs) = bind(c, x, attend)?;
    let slot = bufs.len() - 2;
    bufs[slot] = nan_bytes(x.nh * x.t * plan.n_splits * (x.d + 2));
    let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
    run(attend, plan.attend, order, &mut refs).map_err(|e| e.to_string())?;
    let part = bufs.swap_remove(slot);
    if let Some(i) = floats(&part).iter().position(|v| v.is_nan()) {
        return Err(format!("partial slot {i} of the attention left unwritten"));
    }
    Ok((plan, part))
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

/// The emulated attention against the CPU op on `x`: Ok when the relative L2 of the normalized
/// outputs and the largest log-sum-exp difference (relative to the log-sum-exp where that is
/// over 1) are under [`BOUND`] ([`TABLE_BOUND`] for VecInfer's table kernel).
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
/// (relative where the log-sum-exp is over 1) of the emulated kernels against the CPU op.
pub fn errors(
    c: &Case,
    x: &Inputs,
    attend: &str,
    combine: &str,
    order: Order,
) -> Result<(f64, f64, AttendPlan), String> {
    let (got, plan) = emu_attend(c, x, attend, combine, 0, order)?;
    let (og, lg) = normalized(&got, x.d)?;
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
    Ok((rel_l2(&og, &oc), dl, plan))
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
