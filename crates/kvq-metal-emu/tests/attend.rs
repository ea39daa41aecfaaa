//! The emulated fused decode attention of the scalar-codebook methods
//! (kernels/metal/turboquant_mse/attend.metal, TurboQuant-MSE and -RVQ), of QJL
//! (kernels/metal/qjl/attend.metal) and the split merge (kernels/metal/common/combine.metal)
//! against the CPU op (`compressed_attend` on the CPU, the reference
//! crates/kvq-cache/tests/cuda_parity.rs holds the CUDA kernels to), on the same codes: relative
//! L2 of the normalized output and the log-sum-exp, under every lane order, with every output
//! poisoned with NaN first; and the negative controls (build.rs): a barrier removed from the
//! attention's final reduction, between its scores and the softmax, from QJL's projection or
//! from the combine, and a split boundary off by one row, each must be caught.

use candle_core::{Device, Tensor};
use kvq_cache::codec::rng::SplitMix;
use kvq_cache::compressed::{KeyCodec, ValueCodec};
use kvq_cache::methods::qjl::{GroupCodec, QjlKeyCodec};
use kvq_cache::methods::turboquant_mse::MseCodec;
use kvq_cache::methods::turboquant_rvq::RvqCodec;
use kvq_kernels::metal::dispatch::{self, AttendPlan};
use kvq_kernels::metal::params::{AsBytes, CombineParams, QjlAttendParams, ScalarAttendParams};
use kvq_kernels::spec::{KeySpec, ScalarSpec, ValueSpec};
use kvq_kernels::{AttendParams, compressed_attend, encode_keys, encode_values};
use kvq_metal_emu::{ORDERS, Order, f32_bytes, run};
use std::sync::Arc;

const KVH: usize = 2;
/// fp32 throughout: the kernel and the CPU op differ only in summation order.
const BOUND: f64 = 1e-4;

/// What the emulated kernel reads besides the codes: the codecs' specs.
enum Spec {
    Scalar {
        k: ScalarSpec,
        v: ScalarSpec,
    },
    Qjl {
        m: usize,
        outliers: usize,
        mats: Vec<f32>,
        vbits: u32,
        vgroup: usize,
    },
}

struct Case {
    name: String,
    keys: Arc<dyn KeyCodec>,
    values: Arc<dyn ValueCodec>,
    spec: Spec,
}

fn case(name: String, keys: Arc<dyn KeyCodec>, values: Arc<dyn ValueCodec>) -> Case {
    let ks = keys.kernel_data().map(|k| k.spec.clone());
    let vs = values.kernel_data().map(|v| v.spec.clone());
    let spec = match (ks, vs) {
        (Some(KeySpec::Scalar(k)), Some(ValueSpec::Scalar(v))) => Spec::Scalar { k, v },
        (Some(KeySpec::Sketch { sketch, outliers }), Some(ValueSpec::Group { bits, group })) => {
            Spec::Qjl {
                m: sketch.m,
                outliers,
                mats: sketch.matrices.to_vec(),
                vbits: bits,
                vgroup: group,
            }
        }
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
fn mse(d: usize, bits: u32) -> Case {
    let k = MseCodec::new(d, KVH, bits, 3, 11).expect("mse keys");
    let v = MseCodec::new(d, KVH, bits, 3, 12).expect("mse values");
    case(format!("mse-{bits}"), Arc::new(k), Arc::new(v))
}

fn rvq(d: usize, bits: u32) -> Case {
    let k = RvqCodec::new(d, KVH, bits, 3, 11).expect("rvq keys");
    let v = RvqCodec::new(d, KVH, bits, 3, 12).expect("rvq values");
    case(format!("rvq-{bits}"), Arc::new(k), Arc::new(v))
}

/// QJL at sketch dimension `m` with `outliers` exact channels, values at `vbits` in groups of
/// `vgroup`.
fn qjl(d: usize, m: usize, outliers: usize, vbits: u32, vgroup: usize) -> Case {
    let k = QjlKeyCodec::new(d, KVH, m, outliers, 3, 11).expect("qjl keys");
    let v = GroupCodec::new(d, vbits, vgroup).expect("qjl values");
    case(
        format!("qjl m{m} o{outliers} v{vbits}/{vgroup}"),
        Arc::new(k),
        Arc::new(v),
    )
}

fn decode_params(n: usize, d: usize) -> AttendParams {
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
struct Inputs {
    d: usize,
    nh: usize,
    t: usize,
    n: usize,
    p: AttendParams,
    q: Vec<f32>,
    kc: Vec<u8>,
    vc: Vec<u8>,
    cpu: Vec<f32>,
}

fn inputs(
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

fn nan_bytes(floats: usize) -> Vec<u8> {
    f32_bytes(&vec![f32::NAN; floats])
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
        .collect()
}

/// The most code rows one query row of `x` reads.
fn max_rows(x: &Inputs) -> usize {
    (0..x.t)
        .map(|r| {
            let (r0, r1) = x.p.code_rows(x.p.first_pos + r);
            r1.min(x.n).saturating_sub(r0)
        })
        .max()
        .unwrap_or(0)
}

/// Runs attention kernel `attend` on the emulator: the plan and its partial rows (poisoned with
/// NaN first, every slot checked written).
fn emu_part(
    c: &Case,
    x: &Inputs,
    attend: &str,
    order: Order,
) -> Result<(AttendPlan, Vec<u8>), String> {
    let width = x.d + 2;
    let (q, kc, vc) = (f32_bytes(&x.q), x.kc.clone(), x.vc.clone());
    let (plan, mut bufs) = match &c.spec {
        Spec::Scalar { k, v } => {
            let plan = dispatch::attend_scalar(x.nh, KVH, x.t, x.d, max_rows(x))?;
            let prm = ScalarAttendParams::new(&plan, &x.p, x.n, x.d, k, v)
                .ok_or("parameters out of range")?;
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
        Spec::Qjl {
            m,
            outliers,
            mats,
            vbits,
            vgroup,
        } => {
            let plan = dispatch::attend_qjl(x.nh, KVH, x.t, x.d, *m, max_rows(x))?;
            let prm = QjlAttendParams::new(&plan, &x.p, x.n, x.d, *m, *outliers, *vbits, *vgroup)
                .ok_or("parameters out of range")?;
            if prm.kcb as usize != c.keys.code_bytes() || prm.vcb as usize != c.values.code_bytes()
            {
                return Err("the parameters' code widths are not the codecs'".into());
            }
            (
                plan,
                vec![q, kc, vc, f32_bytes(mats), Vec::new(), prm.as_bytes()],
            )
        }
    };
    let slot = bufs.len() - 2;
    bufs[slot] = nan_bytes(x.nh * x.t * plan.n_splits * width);
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
fn emu_attend(
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
    Ok((out, plan))
}

/// Normalized outputs and log-sum-exps of `[.., d + 2]` partial rows (an empty range: zeros and
/// -inf, which it must be exactly).
fn normalized(rows: &[f32], d: usize) -> Result<(Vec<f32>, Vec<f32>), String> {
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

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// The emulated attention against the CPU op on `x`: Ok when the relative L2 of the normalized
/// outputs and the largest log-sum-exp difference (relative to the log-sum-exp where that is
/// over 1) are under [`BOUND`].
fn check(c: &Case, x: &Inputs, attend: &str, combine: &str, order: Order) -> Result<(), String> {
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
    let e = rel_l2(&og, &oc);
    match e < BOUND && dl < BOUND {
        true => Ok(()),
        false => Err(format!(
            "rel L2 {e:.3e}, |dlse| {dl:.3e} ({} splits of {} rows)",
            plan.n_splits, plan.split_rows
        )),
    }
}

/// Decode (one query row) of every scalar codec at head dim 64 and 128, GQA groups 1 and 4, over
/// 1 position, 300 (two splits, the second partial) and 3000 (twelve splits, the last partial).
#[test]
fn scalar_attend_equals_the_cpu_op() {
    let mut seed = 1000;
    for d in [64, 128] {
        let mut cases: Vec<Case> = [2, 3, 4].map(|b| mse(d, b)).into();
        cases.push(rvq(d, 6));
        for c in &cases {
            for group in [1, 4] {
                for n in [1, 300, 3000] {
                    seed += 1;
                    let x = inputs(c, d, group, n, 1, decode_params(n, d), seed);
                    for order in ORDERS {
                        check(c, &x, "kvq_attend_scalar", "kvq_combine", order).unwrap_or_else(
                            |e| panic!("{} d {d} g {group} n {n} {order:?}: {e}", c.name),
                        );
                    }
                }
            }
        }
    }
}

/// Six query heads per kv head (two head chunks, the second of 2 heads), several query rows
/// each over its own causal range, sinks, the fp16 window, a sliding window over rolled codes
/// (`code_first > 0`), and queries whose every key is exact (all splits empty).
#[test]
fn scalar_attend_ranges_equal_the_cpu_op() {
    let c = mse(64, 3);
    let pos = 5000;
    let rolled = AttendParams {
        scale: 0.125,
        first_pos: pos,
        window: 64,
        sinks: 4,
        sliding_window: Some(2048),
        code_first: pos + 1 - 2048,
        exact_before: 16,
    };
    let prefill = AttendParams {
        first_pos: 700 - 4,
        ..decode_params(700, 64)
    };
    let exact = AttendParams {
        exact_before: usize::MAX,
        ..decode_params(100, 64)
    };
    let shapes = [
        ("g6", 6, 300, 1, decode_params(300, 64)),
        ("rolled sliding", 3, 2048, 1, rolled),
        ("prefill t5", 2, 700, 5, prefill),
        ("exact (empty)", 3, 100, 2, exact),
    ];
    for (i, (name, group, n, t, p)) in shapes.into_iter().enumerate() {
        let x = inputs(&c, 64, group, n, t, p, 77 + i as u64);
        for order in ORDERS {
            check(&c, &x, "kvq_attend_scalar", "kvq_combine", order)
                .unwrap_or_else(|e| panic!("{name} {order:?}: {e}"));
        }
    }
}

/// Logits far from zero (softmax scale 4: scores up to ~110 at head dim 64), where exp of a
/// score less its true running max overflows: a max read before every score of its tile is
/// written (a missing barrier) turns into inf and NaN instead of passing unseen.
#[test]
fn large_logits_equal_the_cpu_op() {
    let mut seed = 3000;
    for c in [mse(64, 4), qjl_cases(64).swap_remove(1)] {
        let kernel = match c.spec {
            Spec::Scalar { .. } => "kvq_attend_scalar",
            Spec::Qjl { .. } => "kvq_attend_qjl",
        };
        for n in [300, 3000] {
            seed += 1;
            let p = AttendParams {
                scale: 4.0,
                ..decode_params(n, 64)
            };
            let x = inputs(&c, 64, 4, n, 1, p, seed);
            for order in ORDERS {
                check(&c, &x, kernel, "kvq_combine", order)
                    .unwrap_or_else(|e| panic!("{} n {n} {order:?}: {e}", c.name));
            }
        }
    }
}

/// With `normalize` the combine writes the attention output itself: the unnormalized rows
/// divided by their sums, and the same max and sum.
#[test]
fn combine_normalizes() {
    let c = mse(128, 4);
    let x = inputs(&c, 128, 4, 3000, 1, decode_params(3000, 128), 5);
    let (raw, _) = emu_attend(
        &c,
        &x,
        "kvq_attend_scalar",
        "kvq_combine",
        0,
        Order::Forward,
    )
    .expect("attend");
    let (norm, _) = emu_attend(
        &c,
        &x,
        "kvq_attend_scalar",
        "kvq_combine",
        1,
        Order::Reverse,
    )
    .expect("attend");
    let d = x.d;
    let (want, _) = normalized(&raw, d).expect("rows");
    for (i, (a, b)) in norm
        .chunks_exact(d + 2)
        .zip(raw.chunks_exact(d + 2))
        .enumerate()
    {
        assert_eq!(&a[d..], &b[d..], "row {i}: max and sum");
        let e = rel_l2(&a[..d], &want[i * d..(i + 1) * d]);
        assert!(e < 1e-6, "row {i}: {e:.3e}");
    }
}

/// A negative control: under every lane order it fails the check on decode over 3000 positions
/// (`real`: the kernel it is a copy of, which passes).
fn assert_caught(c: &Case, real: &str, attend: &str, combine: &str) {
    assert_caught_at(c, decode_params(3000, 64), real, attend, combine);
}

fn assert_caught_at(c: &Case, p: AttendParams, real: &str, attend: &str, combine: &str) {
    let x = inputs(c, 64, 4, 3000, 1, p, 9);
    check(c, &x, real, "kvq_combine", Order::Forward).expect("the real kernels");
    for order in ORDERS {
        assert!(
            check(c, &x, attend, combine, order).is_err(),
            "{attend} + {combine} {order:?} passed the parity check"
        );
    }
}

#[test]
fn a_removed_reduction_barrier_is_caught() {
    assert_caught(
        &mse(64, 4),
        "kvq_attend_scalar",
        "attend_no_barrier/kvq_attend_scalar",
        "kvq_combine",
    );
}

#[test]
fn a_removed_score_barrier_is_caught() {
    let p = AttendParams {
        scale: 4.0,
        ..decode_params(3000, 64)
    };
    assert_caught_at(
        &mse(64, 4),
        p,
        "kvq_attend_scalar",
        "attend_no_score_barrier/kvq_attend_scalar",
        "kvq_combine",
    );
}

#[test]
fn an_off_by_one_split_boundary_is_caught() {
    assert_caught(
        &mse(64, 4),
        "kvq_attend_scalar",
        "attend_split_overlap/kvq_attend_scalar",
        "kvq_combine",
    );
}

#[test]
fn a_removed_combine_barrier_is_caught() {
    assert_caught(
        &mse(64, 4),
        "kvq_attend_scalar",
        "kvq_attend_scalar",
        "combine_no_barrier/kvq_combine",
    );
}

/// QJL's codecs as cuda_parity.rs runs them: the sketch sizes of the 3- and 4-bit presets (one
/// and four exact outlier channels), values at 2 and 4 bits in groups of 64; and 8-bit values in
/// groups of 32 with no outliers.
fn qjl_cases(d: usize) -> Vec<Case> {
    vec![
        qjl(d, 3 * d - d / 8 * 3, 1, 2, 64.min(d)),
        qjl(d, 4 * d + 8, 4, 4, 64.min(d)),
        qjl(d, 2 * d, 0, 8, 32),
    ]
}

/// QJL decode at head dim 64 and 128, GQA groups 1 and 4, over 1, 300 and 3000 positions.
#[test]
fn qjl_attend_equals_the_cpu_op() {
    let mut seed = 2000;
    for d in [64, 128] {
        for c in &qjl_cases(d) {
            for group in [1, 4] {
                for n in [1, 300, 3000] {
                    seed += 1;
                    let x = inputs(c, d, group, n, 1, decode_params(n, d), seed);
                    for order in ORDERS {
                        check(c, &x, "kvq_attend_qjl", "kvq_combine", order).unwrap_or_else(|e| {
                            panic!("{} d {d} g {group} n {n} {order:?}: {e}", c.name)
                        });
                    }
                }
            }
        }
    }
}

/// QJL over two head chunks, a prefill with its causal ranges, and a rolled sliding window; and
/// value groups of 4 coordinates at 2 bits, narrower than the 8 coordinates a thread decodes.
#[test]
fn qjl_attend_ranges_equal_the_cpu_op() {
    let c = &qjl_cases(64)[1];
    let narrow = qjl(64, 128, 2, 2, 4);
    let pos = 3000;
    let rolled = AttendParams {
        scale: 0.125,
        first_pos: pos,
        window: 64,
        sinks: 4,
        sliding_window: Some(1024),
        code_first: pos + 1 - 1024,
        exact_before: 16,
    };
    let prefill = AttendParams {
        first_pos: 700 - 4,
        ..decode_params(700, 64)
    };
    let shapes = [
        ("g6", 6, 300, 1, decode_params(300, 64)),
        ("rolled sliding", 3, 1024, 1, rolled),
        ("prefill t5", 2, 700, 5, prefill),
        ("groups of 4", 4, 300, 1, decode_params(300, 64)),
    ];
    for (i, (name, group, n, t, p)) in shapes.into_iter().enumerate() {
        let c = if i == 3 { &narrow } else { c };
        let x = inputs(c, 64, group, n, t, p, 300 + i as u64);
        for order in ORDERS {
            check(c, &x, "kvq_attend_qjl", "kvq_combine", order)
                .unwrap_or_else(|e| panic!("{name} {order:?}: {e}"));
        }
    }
}

#[test]
fn a_removed_qjl_projection_barrier_is_caught() {
    let c = &qjl_cases(64)[1];
    assert_caught(
        c,
        "kvq_attend_qjl",
        "qjl_no_barrier/kvq_attend_qjl",
        "kvq_combine",
    );
}
