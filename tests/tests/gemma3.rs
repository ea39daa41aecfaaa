//! Gemma-3-270M (real GGUF from PyPI parts, `scripts/fetch-models gemma3`: head_dim 256, q/k
//! norms, sandwich norms, GeGLU, five sliding-window layers per global one, a SentencePiece
//! vocabulary of 262k) through `kvq serve` and the official openai client, streaming. The file is
//! the base model (not the instruction-tuned `-it`) and carries no chat template, so chat goes
//! through the Question/Answer transcript kvq gives such models: fp16, 4-bit TurboQuant-MSE and
//! 2-bit VecInfer answer questions right and end by themselves; the model completes text; and
//! every cache method, VecInfer calibrated on first use included, runs this head_dim-256 model to
//! the end of its answer. (kvq's fp16 perplexity on it matches llama.cpp's to 0.04%:
//! docs/benchmarks/quality.md.)

use kvq_tests::server::Server;
use kvq_tests::{models_dir, workspace_root};
use std::process::Command;

/// Runs tests/clients/chat_check.py with `flags` (`--completion`, `--ends`) on one prompt.
fn check(flags: &[&str], base: &str, prompt: &str, expect: &str, methods: &[&str]) -> String {
    let out = Command::new("python3")
        .arg(workspace_root().join("tests/clients/chat_check.py"))
        .args(flags)
        .arg(base)
        .arg(prompt)
        .arg(expect)
        .args(methods)
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let want = format!("{} passed, 0 failed", methods.len());
    assert!(
        out.status.success() && stdout.contains(&want),
        "chat checks failed:\n{stdout}\n{stderr}"
    );
    stdout
}

#[test]
fn gemma3_answers_and_completes_through_the_openai_client_with_every_cache_method() {
    let model = models_dir().join("gemma-3-270m-Q4_K_M.gguf");
    assert!(
        model.exists(),
        "{} is missing: run scripts/fetch-models gemma3",
        model.display()
    );
    let presets = workspace_root().join("configs/cache");
    let server = Server::start(&[
        "--model",
        model.to_str().expect("utf-8 path"),
        "--cache-presets",
        presets.to_str().expect("utf-8 path"),
    ]);
    let answering = ["fp16", "turboquant-mse-4bit", "vecinfer-2bit"];
    for (question, answer) in [
        ("What is the capital of France?", "Paris"),
        ("Who wrote Romeo and Juliet?", "Shakespeare"),
        ("What is 12 plus 7?", "19"),
    ] {
        check(&["--ends"], &server.base, question, answer, &answering);
    }
    let water = "Water is made of hydrogen and";
    check(
        &["--completion"],
        &server.base,
        water,
        "oxygen",
        &answering[..2],
    );
    // Every other method runs head_dim 256 to the end of an answer; their quality on this model
    // is measured with `kvq eval` (docs/benchmarks/quality.md), not judged from one answer.
    let all = [
        "turboquant-mse-3bit",
        "turboquant-rvq-4bit",
        "turboquant-prod-4bit",
        "qjl-4bit",
        "vecinfer-2bit",
        "vecinfer-1bit",
    ];
    let out = check(&["--completion"], &server.base, water, "", &all);
    eprintln!("{out}");
}
