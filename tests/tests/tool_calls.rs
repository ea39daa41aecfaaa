//! Tool calls end to end: the real `kvq serve` binary driven by the official `openai` package
//! (tests/clients/tool_calls.py). Qwen2.5-Coder-0.5B-Instruct, whose chat template shows tools:
//! "auto" calls parsed from its `<tool_call>` syntax, whole and streamed, under fp16 and a
//! compressed preset, a follow-up turn with the `tool` message, "none", a strict pydantic tool
//! forced by name, one call without parallel_tool_calls. SmolLM2, whose template has none:
//! "auto" is a 400 naming `tools`, while "required" and a named function get a call the grammar
//! writes.

use kvq_tests::{default_gguf, models_dir, run_client_check};

#[test]
fn qwen_calls_a_tool_through_the_openai_client() {
    let model = models_dir().join("Qwen2.5-Coder-0.5B-Instruct.gguf");
    assert!(
        model.exists(),
        "{} is missing: run scripts/fetch-models qwen2",
        model.display()
    );
    run_client_check(
        &model,
        "tool_calls.py",
        &["template", "fp16", "turboquant-mse-4bit"],
    );
}

#[test]
fn a_model_without_tool_support_is_forced_to_call_by_the_grammar() {
    run_client_check(
        &default_gguf(),
        "tool_calls.py",
        &["plain", "fp16", "turboquant-prod-3bit"],
    );
}
