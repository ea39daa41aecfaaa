//! Structured outputs end to end: the real `kvq serve` binary with SmolLM2, driven by the
//! official `openai` package (tests/clients/structured_outputs.py): `chat.completions.parse`
//! with a pydantic model under fp16 and compressed presets, streamed and whole, `json_object`
//! replies that parse for 20 seeded sampled runs, `length` when max_tokens cuts the JSON, and a
//! 400 naming the schema keyword the grammar cannot enforce.

use kvq_tests::{default_gguf, run_client_check};

#[test]
fn openai_client_parses_structured_replies() {
    run_client_check(
        &default_gguf(),
        "structured_outputs.py",
        &[
            "fp16",
            "turboquant-prod-3bit",
            "turboquant-mse-4bit",
            "turboquant-rvq-2bit",
            "qjl-3bit",
            "vecinfer-2bit",
        ],
    );
}
