//! The emulated fused decode attention of the scalar-codebook methods
//! (kernels/metal/turboquant_mse/attend.metal, TurboQuant-MSE and -RVQ), of QJL
//! (kernels/metal/qjl/attend.metal) and the split merge (kernels/metal/common/combine.metal)
//! against the CPU op (`compressed_attend` on the CPU, the reference
//! crates/kvq-cache/tests/cuda_parity.rs holds the CUDA kernels to), on the same codes: relative
//! L2 of the normalized output and the log-sum-exp, under every lane order, with every output
//! poisoned with NaN first (the harness is tests/common), at head dims 64, 128 and 256; and the
//! negative controls (build.rs): a barrier removed from the attention's final reduction, between
//! its scores and the softmax, from QJL's projection or from the combine, a split boundary off
//! by one row, and the one-dispatch merge done by the first split to arrive, each must be
//! caught. Every split decode is checked merged both ways: by `kvq_combine` in a second
//! dispatch, and by the attention's last split threadgroups (the MSL 3.2 path). TurboQuant-Prod and VecInfer, on the same skeleton, are
//! in attend_prod_vq.rs.

mod common;

use common::{
    Case, assert_caught_at, check, decode_params, emu_attend, inputs, mse, normalized,
    prefill_params, qjl, qjl_cases, rel_l2, rolled_params, rvq,
};
use kvq_kernels::AttendParams;
use kvq_metal_emu::{ORDERS, Order};

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

/// Head dim 256 (the threadgroup arrays' full width): the scalar codecs and QJL's (sketches up
/// to 4 d + 8 = 1032 projections), GQA 2, over 1 and 700 positions (three splits).
#[test]
fn head_dim_256_equals_the_cpu_op() {
    let mut seed = 6000;
    let mut cases = vec![mse(256, 3), rvq(256, 4)];
    cases.extend(qjl_cases(256));
    for c in &cases {
        for n in [1, 700] {
            seed += 1;
            let x = inputs(c, 256, 2, n, 1, decode_params(n, 256), seed);
            for order in ORDERS {
                check(c, &x, c.spec.kernel(), "kvq_combine", order)
                    .unwrap_or_else(|e| panic!("{} d 256 n {n} {order:?}: {e}", c.name));
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
    let rolled = rolled_params(pos, 2048);
    let prefill = prefill_params(700, 5, 64);
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
        let kernel = c.spec.kernel();
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

/// The one-dispatch merge (MSL 3.2) done by the first split threadgroup to arrive instead of
/// the last: it reads splits not yet written (the emulator runs the threadgroups forward,
/// reversed and shuffled, so the first is a different split each time).
#[test]
fn a_merge_by_the_first_split_is_caught() {
    assert_caught(
        &mse(64, 4),
        "kvq_attend_scalar",
        "merge_not_last/kvq_attend_scalar",
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
    let rolled = rolled_params(pos, 1024);
    let prefill = prefill_params(700, 5, 64);
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
