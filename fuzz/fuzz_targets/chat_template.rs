//! Fuzz target: a hostile chat template, as a model file may carry one. The input is the
//! template source, then (after a NUL byte) a conversation as JSON (an array of
//! `[role, content]` pairs; anything else is one user message). Compiling and rendering must
//! end (minijinja's fuel), stay shallow (the recursion limit) and small (the output bound), and
//! fail only with a template error; nothing may panic, hang or allocate without bound.
#![no_main]

use kvq_models::chat::MAX_RENDER_BYTES;
use kvq_models::{ChatMessage, ChatTemplate, ModelError};
use libfuzzer_sys::fuzz_target;

fn conversation(bytes: &[u8]) -> Vec<ChatMessage> {
    let text = String::from_utf8_lossy(bytes);
    match serde_json::from_str::<Vec<(String, String)>>(&text) {
        Ok(pairs) => pairs
            .into_iter()
            .map(|(role, content)| ChatMessage::new(role, content))
            .collect(),
        Err(_) => vec![ChatMessage::new("user", text)],
    }
}

fuzz_target!(|data: &[u8]| {
    kvq_fuzz::contain_third_party_panics();
    let split = data.iter().position(|&b| b == 0).unwrap_or(data.len());
    let source = String::from_utf8_lossy(&data[..split]);
    let messages = conversation(data.get(split + 1..).unwrap_or_default());
    let template = match ChatTemplate::new(&source, Some("<s>"), Some("</s>")) {
        Ok(t) => t,
        Err(ModelError::Template(_)) => return,
        Err(e) => panic!("compiling gave a non-template error: {e}"),
    };
    for add_generation_prompt in [false, true] {
        let extra = serde_json::json!({"tools": [{"type": "function", "function": {"name": "f"}}]});
        match template.render_with(&messages, add_generation_prompt, Some(&extra)) {
            Ok(out) => assert!(out.len() <= MAX_RENDER_BYTES, "{} bytes", out.len()),
            Err(ModelError::Template(msg)) => assert!(!msg.is_empty()),
            Err(e) => panic!("rendering gave a non-template error: {e}"),
        }
    }
});
