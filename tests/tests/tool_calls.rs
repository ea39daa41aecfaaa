//! Tool calls end to end: the real `kvq serve` binary driven by the official `openai` package
//! (tests/clients/tool_calls.py). Qwen2.5-Coder-0.5B-Instruct, whose chat template shows tools:
//! "auto" calls parsed from its `<tool_call>` syntax, whole and streamed, under fp16 and a
//! compressed preset, a follow-up turn with the `tool` message, "none", a strict pydantic tool
//! forced by name, one call without parallel_tool_calls. SmolLM2, whose template has none:
//! "auto" is a 400 naming `tools`, while "required" and a named function get a call the grammar
//! writes.

use kvq_tests::server::Server;
use kvq_tests::{default_gguf, models_dir, workspace_root};
use std::path::Path;
use std::process::Command;

fn run_client(model: &Path, args: &[&str]) {
    let presets = workspace_root().join("configs/cache");
    let server = Server::start(&[
        "--model",
        model.to_str().expect("utf-8 path"),
        "--cache-presets",
        presets.to_str().expect("utf-8 path"),
    ]);
    let out = Command::new("python3")
        .arg(workspace_root().join("tests/clients/tool_calls.py"))
        .arg(&server.base)
        .args(args)
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains(" passed, 0 failed"),
        "tool call checks failed:\n{stdout}\n{stderr}\nserver log:\n{}",
        server.log_text()
    );
}

#[test]
fn qwen_calls_a_tool_through_the_openai_client() {
    let model = models_dir().join("Qwen2.5-Coder-0.5B-Instruct.gguf");
    assert!(
        model.exists(),
        "{} is missing: run scripts/fetch-models qwen2",
        model.display()
    );
    run_client(&model, &["template", "fp16", "turboquant-mse-4bit"]);
}

#[test]
fn a_model_without_tool_support_is_forced_to_call_by_the_grammar() {
    run_client(&default_gguf(), &["plain", "fp16", "turboquant-prod-3bit"]);
}
