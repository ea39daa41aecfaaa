//! Compiles the emulator: the fiber runtime (kernels/metal/emu), every `.metal` file of
//! kernels/metal through the `<metal_stdlib>` shim, and the negative controls: copies of a
//! kernel with one known mistake made in its text (each substitution must match exactly once,
//! so a change to the kernel that removes the pattern fails the build instead of silently
//! testing nothing). Warnings are errors: what the shim does not support does not compile.

use std::path::{Path, PathBuf};

/// A negative control: (name, source under kernels/metal, [(from, to)]), one mistake the seed
/// names made in the kernel's text.
type Mutant = (
    &'static str,
    &'static str,
    &'static [(&'static str, &'static str)],
);

const MUTANTS: &[Mutant] = &[
    (
        // The seed's first Hadamard: XOR partner and an in-place update, with no barrier
        // between a pass's reads and its writes.
        "xor_butterfly",
        "turboquant_mse/encode.metal",
        &[(
            "    const bool upper = (c % (2 * h)) >= h;\n    const uint partner = upper ? c - h : c + h;\n    const float a = u[c];\n    const float b = u[partner];\n    threadgroup_barrier(mem_flags::mem_threadgroup);\n    u[c] = upper ? (b - a) : (a + b);\n",
            "    const uint partner = c ^ h;\n    const bool upper = (c & h) != 0;\n    const float a = u[c];\n    const float b = u[partner];\n    u[c] = upper ? (b - a) : (a + b);\n",
        )],
    ),
    (
        // The barrier that ends a butterfly pass, removed.
        "no_barrier",
        "turboquant_mse/encode.metal",
        &[(
            "    u[c] = upper ? (b - a) : (a + b);\n    threadgroup_barrier(mem_flags::mem_threadgroup);\n",
            "    u[c] = upper ? (b - a) : (a + b);\n",
        )],
    ),
    (
        // A sign packed from the wrong lane (one past the right one).
        "wrong_shuffle_lane",
        "qjl/encode.metal",
        &[(
            "simd_shuffle(bit, ushort((lane / 8) * 8 + b))",
            "simd_shuffle(bit, ushort((lane / 8) * 8 + b + 1))",
        )],
    ),
    (
        // The barrier between the token lanes' writes of their accumulators and the sums over
        // them (the attention's final reduction), removed.
        "attend_no_barrier",
        "turboquant_mse/attend.metal",
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
        "turboquant_mse/attend.metal",
        &[(
            "= s[g] * norm;\n    }\n    threadgroup_barrier(mem_flags::mem_threadgroup);\n",
            "= s[g] * norm;\n    }\n",
        )],
    ),
    (
        // A split that ends one row late: the first row of the next split counted twice.
        "attend_split_overlap",
        "turboquant_mse/attend.metal",
        &[(
            "min(r1, s0 + p.split_rows)",
            "min(r1, s0 + p.split_rows + 1)",
        )],
    ),
    (
        // QJL: the barrier between the projection S q and the scores that read it, removed.
        "qjl_no_barrier",
        "qjl/attend.metal",
        &[(
            "a[g] * cq;\n  }\n  threadgroup_barrier(mem_flags::mem_threadgroup);\n",
            "a[g] * cq;\n  }\n",
        )],
    ),
    (
        // The barrier between the split weights' writes and their reads, removed.
        "combine_no_barrier",
        "common/combine.metal",
        &[(
            "exp(ms - m);\n  }\n  threadgroup_barrier(mem_flags::mem_threadgroup);\n",
            "exp(ms - m);\n  }\n",
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
    for (name, src, subs) in MUTANTS {
        let path = mutant(&kernels.join(src), &out, name, subs);
        build.define(
            &format!("KVQ_MUTANT_{}", name.to_uppercase()),
            Some(&*format!("\"{}\"", path.display())),
        );
    }
    build.compile("kvq_metal_emu");
}

fn mutant(src: &Path, out: &Path, name: &str, subs: &[(&str, &str)]) -> PathBuf {
    let mut text =
        std::fs::read_to_string(src).unwrap_or_else(|e| panic!("reading {}: {e}", src.display()));
    for (from, to) in subs {
        let n = text.matches(from).count();
        assert!(
            n == 1,
            "negative control {name}: the pattern occurs {n} times in {} (expected once):\n{from}",
            src.display()
        );
        text = text.replacen(from, to, 1);
    }
    let path = out.join(format!("mutant_{name}.metal"));
    std::fs::write(&path, text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    path
}
