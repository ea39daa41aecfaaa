//! The shim refuses what it cannot emulate: MSL it does not support fails to compile (so no
//! kernel can pass the emulator by being silently misread), while a plain kernel compiles. Runs
//! the same compiler and flags build.rs uses (`c++`, or `$CXX`).

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

fn compiles(body: &str) -> Result<(), String> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../kernels/metal/emu");
    let dir = std::env::temp_dir().join(format!("kvq-shim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let src = dir.join(format!("k{}.metal", NEXT.fetch_add(1, Ordering::Relaxed)));
    std::fs::write(
        &src,
        format!("#include <metal_stdlib>\nusing namespace metal;\n{body}\n"),
    )
    .map_err(|e| e.to_string())?;
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let out = Command::new(cxx)
        .args([
            "-x",
            "c++",
            "-std=c++17",
            "-fsyntax-only",
            "-Werror",
            "-Wall",
            "-Wno-attributes",
        ])
        .arg("-I")
        .arg(root.join("include"))
        .arg("-I")
        .arg(&root)
        .arg(&src)
        .output()
        .map_err(|e| format!("running the C++ compiler: {e}"))?;
    match out.status.success() {
        true => Ok(()),
        false => Err(String::from_utf8_lossy(&out.stderr).into_owned()),
    }
}

#[test]
fn a_plain_kernel_compiles() {
    compiles(
        "kernel void k(device float* x [[buffer(0)]], constant uint& n [[buffer(1)]],\n\
         uint i [[thread_position_in_grid]]) {\n\
           threadgroup float t[32];\n\
           if (i < n) { t[i % 32] = x[i]; threadgroup_barrier(mem_flags::mem_threadgroup);\n\
           float2 v = float2(x[i], 2.0f) * float2(3.0f);\n\
           x[i] = simd_sum(t[i % 32]) + half(1.0f) + dot(v, float2(1.0f, v.y)); }\n\
         }",
    )
    .expect("a kernel in the supported subset compiles");
    compiles(
        "kernel void k(coherent(device) device float* x [[buffer(0)]],\n\
         device atomic_uint* n [[buffer(1)]]) {\n\
           atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device);\n\
           x[0] = float(atomic_fetch_add_explicit(n, 1u, memory_order_relaxed));\n\
         }",
    )
    .expect("MSL 3.2's coherent buffers, device fences and atomic_uint's add compile");
}

#[test]
fn what_the_shim_does_not_support_does_not_compile() {
    let unsupported = [
        // threadgroup memory as a parameter (the shim's threadgroup arrays are locals)
        "kernel void k(threadgroup float* t [[threadgroup(0)]]) { t[0] = 1.0f; }",
        // swizzles (vector types have their components only)
        "kernel void k(device float4* x [[buffer(0)]]) { x[0].xy = x[1].zw; }",
        // atomics other than atomic_uint's add, load and store
        "kernel void k(device atomic_int* x [[buffer(0)]]) { atomic_fetch_add_explicit(x, 1, memory_order_relaxed); }",
        "kernel void k(device atomic_uint* x [[buffer(0)]]) { atomic_fetch_max_explicit(x, 1u, memory_order_relaxed); }",
        // writing a constant buffer
        "kernel void k(constant float& x [[buffer(0)]]) { x = 1.0f; }",
        // textures
        "kernel void k(texture2d<float> t [[texture(0)]]) { }",
    ];
    for body in unsupported {
        assert!(
            compiles(body).is_err(),
            "compiled, but the shim cannot emulate it:\n{body}"
        );
    }
}
