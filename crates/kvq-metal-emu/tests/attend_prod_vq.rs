//! The emulated fused decode attention of TurboQuant-Prod (kernels/metal/turboquant_prod/
//! attend.metal: the scalar stage plus the residual's sign sketch) and of VecInfer
//! (kernels/metal/vecinfer/attend.metal: centroids gathered from the codebooks, and keys scored
//! from a per-query table of 16-bit entries) against the CPU op on the same codes, under every lane order, outputs poisoned (the harness is tests/common):
//! head dims 64, 128 and 256, GQA groups 1 to 6, decode over 1 to 3000 positions (up to twelve
//! splits), a prefill, sinks, the fp16 window and a rolled sliding window. Both kernels are
//! turboquant_mse/attend.metal's `attend_codes` body: the attention's negative controls
//! (build.rs) are made in that body and must be caught through these kernels too.

mod common;

use common::{
    Case, TABLE_BOUND, VQ_TABLE, assert_caught_at, check, decode_params, errors, inputs,
    prefill_params, prod, rolled_params, vq,
};
use kvq_kernels::AttendParams;
use kvq_metal_emu::ORDERS;

/// Every case against the CPU op at `d`, GQA `groups`, over `ns` positions (decode).
fn decode_sweep(cases: &[Case], d: usize, groups: &[usize], ns: &[usize], seed: &mut u64) {
    for c in cases {
        for &group in groups {
            for &n in ns {
                *seed += 1;
                let x = inputs(c, d, group, n, 1, decode_params(n, d), *seed);
                for order in ORDERS {
                    check(c, &x, c.spec.kernel(), "kvq_combine", order).unwrap_or_else(|e| {
                        panic!("{} d {d} g {group} n {n} {order:?}: {e}", c.name)
                    });
                }
            }
        }
    }
}

/// TurboQuant-Prod decode at 2, 3 and 4 bits (MSE stages of 1 to 3 bits), head dims 64 and 128,
/// GQA groups 1 and 4, over 1, 300 and 3000 positions; at head dim 256 the 3-bit codec, GQA 2.
#[test]
fn prod_attend_equals_the_cpu_op() {
    let mut seed = 4000;
    for d in [64, 128] {
        let cases: Vec<Case> = [2, 3, 4].map(|b| prod(d, b)).into();
        decode_sweep(&cases, d, &[1, 4], &[1, 300, 3000], &mut seed);
    }
    decode_sweep(&[prod(256, 3)], 256, &[2], &[1, 700], &mut seed);
}

/// VecInfer decode at sub-vectors of 4 and 8, codebooks shared and per sub-position, head dims
/// 64 and 128, GQA groups 1 and 4, over 1, 300 and 3000 positions (the CPU op's values by
/// histogram past 256 positions, gathered below); at head dim 256 sub-vectors of 4, GQA 2.
#[test]
fn vq_attend_equals_the_cpu_op() {
    let mut seed = 5000;
    for d in [64, 128] {
        let cases = [vq(d, 4, false), vq(d, 8, true)];
        decode_sweep(&cases, d, &[1, 4], &[1, 300, 3000], &mut seed);
    }
    let cases = [vq(256, 4, true), vq(256, 8, false)];
    decode_sweep(&cases, 256, &[2], &[1, 700], &mut seed);
}

/// Both kernels over six query heads per kv head (two head chunks), a prefill of five rows
/// each over its own causal range, and a rolled sliding window with sinks and the fp16 window.
#[test]
fn prod_and_vq_ranges_equal_the_cpu_op() {
    let pos = 3000;
    let rolled = rolled_params(pos, 1024);
    let prefill = prefill_params(700, 5, 64);
    let shapes = [
        ("g6", 6, 300, 1, decode_params(300, 64)),
        ("rolled sliding", 3, 1024, 1, rolled),
        ("prefill t5", 2, 700, 5, prefill),
    ];
    for c in [prod(64, 3), vq(64, 4, true)] {
        for (i, (name, group, n, t, p)) in shapes.into_iter().enumerate() {
            let x = inputs(&c, 64, group, n, t, p, 600 + i as u64);
            for order in ORDERS {
                check(&c, &x, c.spec.kernel(), "kvq_combine", order)
                    .unwrap_or_else(|e| panic!("{} {name} {order:?}: {e}", c.name));
            }
        }
    }
}

/// Logits far from zero (softmax scale 4), where a running max read before its tile's scores
/// are written overflows.
#[test]
fn prod_and_vq_large_logits_equal_the_cpu_op() {
    for (i, c) in [prod(64, 4), vq(64, 4, false)].into_iter().enumerate() {
        let p = AttendParams {
            scale: 4.0,
            ..decode_params(3000, 64)
        };
        let x = inputs(&c, 64, 4, 3000, 1, p, 700 + i as u64);
        for order in ORDERS {
            check(&c, &x, c.spec.kernel(), "kvq_combine", order)
                .unwrap_or_else(|e| panic!("{} {order:?}: {e}", c.name));
        }
    }
}

/// The body's negative controls (scale 4 for the score barrier, whose race overflows only with
/// large logits) plus `extra`, made in kernel `real` and caught on `c`.
fn caught_through(c: &Case, real: &str, extra: &[&str]) {
    let body = [
        "attend_no_barrier",
        "attend_no_score_barrier",
        "attend_split_overlap",
    ];
    for mutant in extra.iter().chain(&body) {
        let scale = if *mutant == "attend_no_score_barrier" {
            4.0
        } else {
            0.125
        };
        let p = AttendParams {
            scale,
            ..decode_params(3000, 64)
        };
        assert_caught_at(c, p, real, &format!("{mutant}/{real}"), "kvq_combine");
    }
}

/// The attention body's negative controls, through the Prod and VecInfer kernels.
#[test]
fn the_attention_bodys_mistakes_are_caught_in_prod_and_vq() {
    for c in [prod(64, 3), vq(64, 4, false)] {
        caught_through(&c, c.spec.kernel(), &[]);
    }
}

/// VecInfer's table kernel at every head dim and sub-vector length whose table fits (head dim
/// 256 only at sub-vectors of 8), codebooks shared and per sub-position, GQA groups 1, 3 and 4
/// (one or two query heads a threadgroup, a last chunk of one), over 600 and 3000 positions.
/// The largest error is printed: it is the table's rounding, far under [`TABLE_BOUND`].
#[test]
fn vq_table_attend_equals_the_cpu_op() {
    let mut seed = 8000;
    let mut worst: f64 = 0.0;
    let shapes = [
        (64, 4, false),
        (64, 8, true),
        (128, 4, false),
        (128, 8, true),
        (256, 8, false),
    ];
    for (d, sub, per_position) in shapes {
        let c = vq(d, sub, per_position);
        for group in [1, 3, 4] {
            for n in [600, 3000] {
                seed += 1;
                let x = inputs(&c, d, group, n, 1, decode_params(n, d), seed);
                for order in ORDERS {
                    let (e, dl, plan) = errors(&c, &x, VQ_TABLE, "kvq_combine", order)
                        .unwrap_or_else(|e| panic!("{} d {d} g {group} n {n}: {e}", c.name));
                    assert!(
                        e < TABLE_BOUND && dl < TABLE_BOUND,
                        "{} d {d} g {group} n {n} {order:?}: rel L2 {e:.3e}, |dlse| {dl:.3e} \
                         ({} splits)",
                        c.name,
                        plan.n_splits
                    );
                    worst = worst.max(e).max(dl);
                }
            }
        }
    }
    eprintln!("kvq_attend_vq_lut: largest error {worst:.3e} (bound {TABLE_BOUND:.0e})");
}

/// The table kernel over a prefill of five rows, a rolled sliding window with sinks and the
/// fp16 window, and logits far from zero (softmax scale 4, where the table's rounding is
/// multiplied by 32 against the usual 1/8).
#[test]
fn vq_table_ranges_and_large_logits_equal_the_cpu_op() {
    let pos = 3000;
    let rolled = rolled_params(pos, 1024);
    let prefill = prefill_params(700, 5, 64);
    let large = AttendParams {
        scale: 4.0,
        ..decode_params(3000, 64)
    };
    let shapes = [
        ("rolled sliding", 3, 1024, 1, rolled),
        ("prefill t5", 2, 700, 5, prefill),
        ("scale 4", 4, 3000, 1, large),
    ];
    for c in [vq(64, 4, true), vq(64, 8, false)] {
        for (i, (name, group, n, t, p)) in shapes.into_iter().enumerate() {
            let x = inputs(&c, 64, group, n, t, p, 900 + i as u64);
            let mut worst: f64 = 0.0;
            for order in ORDERS {
                let (e, dl, _) = errors(&c, &x, VQ_TABLE, "kvq_combine", order)
                    .unwrap_or_else(|e| panic!("{} {name} {order:?}: {e}", c.name));
                assert!(
                    e < TABLE_BOUND && dl < TABLE_BOUND,
                    "{} {name} {order:?}: rel L2 {e:.3e}, |dlse| {dl:.3e}",
                    c.name
                );
                worst = worst.max(e).max(dl);
            }
            eprintln!(
                "kvq_attend_vq_lut {} {name}: largest error {worst:.3e}",
                c.name
            );
        }
    }
}

/// The attention body's negative controls through the table kernel, and the table's own: the
/// barrier between its writes and the scores that read it, removed.
#[test]
fn the_table_kernels_mistakes_are_caught() {
    caught_through(&vq(64, 4, false), VQ_TABLE, &["vq_lut_no_barrier"]);
}
