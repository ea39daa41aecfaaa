//! Shared fixtures for the end-to-end tests: where the real models are, a loaded default model,
//! the GGUF to Hugging Face directory conversion, a spawned `kvq serve`, keys captured from the
//! model, random checkpoints of the architectures without reachable weights, and a fake Hugging
//! Face Hub on loopback with its fixture repositories, and the fuzz targets' model-file seeds.

pub mod checkpoints;
pub mod fake_hub;
pub mod fuzz_seeds;
pub mod hf_export;
pub mod hub_fixtures;
pub mod real_keys;
pub mod server;

use std::path::PathBuf;

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_default()
}

/// The models folder (`$KVQ_MODELS_DIR` or `<root>/models`).
pub fn models_dir() -> PathBuf {
    std::env::var_os("KVQ_MODELS_DIR")
        .map_or_else(|| workspace_root().join("models"), PathBuf::from)
}

/// The default model's GGUF; panics with the fix when it is missing (the tests need real weights).
pub fn default_gguf() -> PathBuf {
    let p = models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-models first",
        p.display()
    );
    p
}

/// The golden cases (`../shared/golden/smollm2.json`, or `$KVQ_GOLDEN`).
pub fn golden() -> serde_json::Value {
    let p = std::env::var_os("KVQ_GOLDEN").map_or_else(
        || workspace_root().join("../shared/golden/smollm2.json"),
        PathBuf::from,
    );
    let text =
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("golden file {}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("golden file {}: {e}", p.display()))
}

/// A fresh scratch directory under the target dir.
pub fn scratch_dir(name: &str) -> PathBuf {
    let p = workspace_root()
        .join("target")
        .join("kvq-test-scratch")
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    p
}

/// Starts `kvq serve` on `model` with the shipped presets, runs the Python client check
/// `tests/clients/<script>` against it with `args`, and fails with the client's output and the
/// server log unless every check passed (the script's closing line is "N passed, 0 failed").
pub fn run_client_check(model: &std::path::Path, script: &str, args: &[&str]) {
    let presets = workspace_root().join("configs/cache");
    let server = server::Server::start(&[
        "--model",
        model.to_str().expect("utf-8 path"),
        "--cache-presets",
        presets.to_str().expect("utf-8 path"),
    ]);
    let out = std::process::Command::new("python3")
        .arg(workspace_root().join("tests/clients").join(script))
        .arg(&server.base)
        .args(args)
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains(" passed, 0 failed"),
        "{script} failed:\n{stdout}\n{stderr}\nserver log:\n{}",
        server.log_text()
    );
}
