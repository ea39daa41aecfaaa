//! With the `cuda` feature, compiles every `kernels/cuda/<family>/*.cu` to PTX with nvcc
//! (`$NVCC`, else `$CUDA_ROOT/bin/nvcc`, else `nvcc` on the PATH; `scripts/build-cuda` provides
//! the pinned CUDA 13.0 one) and writes `ptx.rs`, which embeds them in the binary as
//! `(module name, PTX text)` pairs. Without the feature it does nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=CARGO_FEATURE_CUDA");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let src = manifest.join("../../kernels/cuda");
    println!("cargo:rerun-if-changed={}", src.display());
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets it"));
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| match std::env::var("CUDA_ROOT") {
        Ok(root) => format!("{root}/bin/nvcc"),
        Err(_) => "nvcc".into(),
    });
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let mut units = Vec::new();
    for family in sorted_entries(&src) {
        if !family.is_dir() {
            continue;
        }
        for file in sorted_entries(&family) {
            println!("cargo:rerun-if-changed={}", file.display());
            if file.extension().is_some_and(|e| e == "cu") {
                units.push((family.clone(), file));
            }
        }
    }
    let mut table = String::from(
        "/// (module, PTX) for every kernels/cuda source.\npub const MODULES: &[(&str, &str)] = &[\n",
    );
    for (family, file) in units {
        let name = format!(
            "{}_{}",
            family.file_name().and_then(|f| f.to_str()).unwrap_or("x"),
            file.file_stem().and_then(|f| f.to_str()).unwrap_or("x")
        );
        let ptx = out.join(format!("{name}.ptx"));
        let status = Command::new(&nvcc)
            .args(["-ptx", "-O3", "-std=c++17", "-lineinfo"])
            .arg(format!("-arch=sm_{cap}"))
            .arg("-I")
            .arg(&src)
            .arg("-o")
            .arg(&ptx)
            .arg(&file)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {nvcc} (scripts/build-cuda sets it up): {e}"));
        assert!(status.success(), "nvcc failed on {}", file.display());
        table.push_str(&format!(
            "    ({name:?}, include_str!({:?})),\n",
            ptx.display().to_string()
        ));
    }
    table.push_str("];\n");
    std::fs::write(out.join("ptx.rs"), table).expect("OUT_DIR is writable");
}

fn sorted_entries(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|r| r.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.sort();
    v
}
