//! Structured outputs end to end: the real `kvq serve` binary with SmolLM2, driven by the
//! official `openai` package (tests/clients/structured_outputs.py): `chat.completions.parse`
//! with a pydantic model under fp16 and compressed presets, streamed and whole, `json_object`
//! replies that parse for 20 seeded sampled runs, `length` when max_tokens cuts the JSON, and a
//! 400 naming the schema keyword the grammar cannot enforce.

use kvq_tests::server::Server;
use kvq_tests::{default_gguf, workspace_root};
use std::process::Command;

#[test]
fn openai_client_parses_structured_replies() {
    let presets = workspace_root().join("configs/cache");
    let server = Server::start(&[
        "--model",
        default_gguf().to_str().expect("utf-8 path"),
        "--cache-presets",
        presets.to_str().expect("utf-8 path"),
    ]);
    let out = Command::new("python3")
        .arg(workspace_root().join("tests/clients/structured_outputs.py"))
        .arg(&server.base)
        .args([
            "fp16",
            "turboquant-prod-3bit",
            "turboquant-mse-4bit",
            "turboquant-rvq-2bit",
            "qjl-3bit",
            "vecinfer-2bit",
        ])
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains(" passed, 0 failed"),
        "structured output checks failed:\n{stdout}\n{stderr}\nserver log:\n{}",
        server.log_text()
    );
}
