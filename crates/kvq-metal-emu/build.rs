//! Compiles the emulator: the fiber runtime (kernels/metal/emu), every `.metal` file of
//! kernels/metal through the `<metal_stdlib>` shim, and the negative controls: copies of a
//! kernel with one known mistake made in its text (each substitution must match exactly once,
//! so a change to the kernel that removes the pattern fails the build instead of silently
//! testing nothing). Warnings are errors: what the shim does not support does not compile.

use std::path::{Path, PathBuf};

/// A negative control: (name, sources under kernels/metal, [(from, to)]), one mistake made in
/// the kernels' text. The sources are concatenated as the Metal backend compiles them into one
/// library (a file that builds on another's helpers after it), so one mistake in a shared helper
/// reaches every kernel built on it; each pattern must occur once in the concatenation.
type Mutant = (
    &'static str,
    &'static [&'static str],
    &'static [(&'static str, &'static str)],
);

/// The scalar encode and the kernels built on its `fwht_row`.
const ENCODE_FWHT: &[&str] = &[
    "turboquant_mse/encode.metal",
    "vecinfer/encode.metal",
    "turboquant_prod/encode.metal",
];
/// The scalar attention and the kernels built on its `attend_codes` (after the split merge's
/// helpers, as the Metal backend compiles them).
const ATTEND_CODES: &[&str] = &[
    "common/combine.metal",
    "turboquant_mse/attend.metal",
    "turboquant_prod/attend.metal",
    "vecinfer/attend.metal",
];

const MUTANTS: &[Mutant] = &[
    (
        // The seed's first Hadamard: XOR partner and an in-place update, with no barrier
        // between a pass's reads and its writes.
        "xor_butterfly",
        ENCODE_FWHT,
        &[(
            "    const bool upper = (c % (2 * h)) >= h;\n    const uint partner = upper ? c - h : c + h;\n    const float a = u[c];\n    const float b = u[partner];\n    threadgroup_barrier(mem_flags::mem_threadgroup);\n    u[c] = upper ? (b - a) : (a + b);\n",
            "    const uint partner = c ^ h;\n    const bool upper = (c & h) != 0;\n    const float a = u[c];\n    const float b = u[partner];\n    u[c] = upper ? (b - a) : (a + b);\n",
        )],
    ),
    (
        // The barrier that ends a butterfly pass, removed.
        "no_barrier",
        ENCODE_FWHT,
        &[(
            "    u[c] = upper ? (b - a) : (a + b);\n    threadgroup_barrier(mem_flags::mem_threadgroup);\n",
            "    u[c] = upper ? (b - a) : (a + b);\n",
        )],
    ),
    (
        // A sign packed from the wrong lane (one past the right one).
        "wrong_shuffle_lane",
        &["qjl/encode.metal"],
        &[(
            "simd_shuffle(bit, ushort((lane / 8) * 8 + b))",
            "simd_shuffle(bit, ushort((lane / 8) * 8 + b + 1))",
        )],
    ),
    (
        // The barrier between the token lanes' writes of their accumulators and the sums over
        // them (the attention's final reduction), removed.
        "attend_no_barrier",
        ATTEND_CODES,
        &[(
            "= acc[g][j];\n  threadgroup_barrier(mem_flags::mem_threadgroup);\n",
            "= acc[g][j];\n",
        )],
    ),
    (
        // The barrier between a tile's score writes and the online softmax that reads them,
        // removed: the running max then comes from scores not yet written (harmless while the
        // logits are small, an overflow when they are not).
        "attend_no_score_barrier",
        ATTEND_CODES,
        &[(
            "= s[g] * norm;\n    }\n    threadgroup_barrier(mem_flags::mem_threadgroup);\n",
            "= s[g] * norm;\n    }\n",
        )],
    ),
    (
        // A split that ends one row late: the first row of the next split counted twice.
        "attend_split_overlap",
        ATTEND_CODES,
        &[(
            "min(r1, s0 + p.split_rows)",
            "min(r1, s0 + p.split_rows + 1)",
        )],
    ),
    (
        // QJL: the barrier between the projection S q and the scores that read it, removed.
        "qjl_no_barrier",
        &["common/combine.metal", "qjl/attend.metal"],
        &[(
            "a[g] * cq;\n  }\n  threadgroup_barrier(mem_flags::mem_threadgroup);\n",
            "a[g] * cq;\n  }\n",
        )],
    ),
    (
        // The barrier between the split weights' writes and their reads, removed.
        "combine_no_barrier",
        &["common/combine.metal"],
        &[(
            "exp(ms - m);\n  }\n  threadgroup_barrier(mem_flags::mem_threadgroup);\n",
            "exp(ms - m);\n  }\n",
        )],
    ),
    (
        // TurboQuant-Prod's residual sketch: a sign packed from the wrong lane.
        "prod_wrong_shuffle_lane",
        &[
            "turboquant_mse/encode.metal",
            "turboquant_prod/encode.metal",
        ],
        &[(
            "simd_shuffle(bit, ushort((lane / 8) * 8 + b))",
            "simd_shuffle(bit, ushort((lane / 8) * 8 + b + 1))",
        )],
    ),
    (
        // TurboQuant-Prod: the barrier between the residual's writes and the projections that
        // read all of it, removed.
        "prod_no_residual_barrier",
        &[
            "turboquant_mse/encode.metal",
            "turboquant_prod/encode.metal",
        ],
        &[(
            "  threadgroup_barrier(mem_flags::mem_threadgroup);\n  // Signs of S r",
            "  // Signs of S r",
        )],
    ),
    (
        // QJL values: the barrier between the codes' writes and the packing that reads a byte's
        // worth of them, removed.
        "group_no_barrier",
        &["qjl/encode.metal"],
        &[(
            "levels));\n  threadgroup_barrier(mem_flags::mem_threadgroup);\n",
            "levels));\n",
        )],
    ),
    (
        // The split merge in one dispatch: the first split threadgroup to arrive merges, before
        // the others have written their rows.
        "merge_not_last",
        &["common/combine.metal", "turboquant_mse/attend.metal"],
        &[(
            "flag[0] = before + 1 == n_splits ? 1.0f : 0.0f;",
            "flag[0] = before == 0 ? 1.0f : 0.0f;",
        )],
    ),
    (
        // VecInfer's table: the barrier between the table's writes and the scores that read
        // it, removed.
        "vq_lut_no_barrier",
        ATTEND_CODES,
        &[(
            "65535.0f));\n    }\n    threadgroup_barrier(mem_flags::mem_threadgroup);\n",
            "65535.0f));\n    }\n",
        )],
    ),
    (
        // VecInfer encode: the barrier between the scaled rotation's writes and the sub-vectors'
        // reads, removed.
        "vq_no_barrier",
        &["turboquant_mse/encode.metal", "vecinfer/encode.metal"],
        &[(
            "  u[c] = y;\n  threadgroup_barrier(mem_flags::mem_threadgroup);\n",
            "  u[c] = y;\n",
        )],
    ),
];

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("manifest dir"));
    let kernels = root.join("../../kernels/metal");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("out dir"));
    println!("cargo:rerun-if-changed={}", kernels.display());
    println!("cargo:rerun-if-changed=cpp");
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .include(kernels.join("emu/include"))
        .include(kernels.join("emu"))
        .include(&kernels)
        .flag("-Wno-attributes")
        .flag("-Wno-unused-parameter")
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true)
        .opt_level(2)
        .file(kernels.join("emu/kvq_emu_runtime.cpp"))
        .file(root.join("cpp/kernels.cpp"));
    for (name, srcs, subs) in MUTANTS {
        let path = mutant(&kernels, srcs, &out, name, subs);
        build.define(
            &format!("KVQ_MUTANT_{}", name.to_uppercase()),
            Some(&*format!("\"{}\"", path.display())),
        );
    }
    build.compile("kvq_metal_emu");
}

fn mutant(kernels: &Path, srcs: &[&str], out: &Path, name: &str, subs: &[(&str, &str)]) -> PathBuf {
    let mut text = String::new();
    for src in srcs {
        let path = kernels.join(src);
        let part = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        text.push_str(&part);
    }
    for (from, to) in subs {
        let n = text.matches(from).count();
        assert!(
            n == 1,
            "negative control {name}: the pattern occurs {n} times in {srcs:?} (expected once):\n{from}"
        );
        text = text.replacen(from, to, 1);
    }
    let path = out.join(format!("mutant_{name}.metal"));
    std::fs::write(&path, text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    path
}
