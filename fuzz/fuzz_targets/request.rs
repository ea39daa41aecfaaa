//! Fuzz target: a request body (optionally after a `\x01<x-kv-cache-method value>\n` prefix)
//! through everything the chat and completions handlers do before the engine: JSON parsing,
//! validation, cache selection, the tool checks, template rendering (with the tools) and
//! tokenization, and a `response_format`'s or forced tool call's grammar compiled and followed
//! for a few tokens. Every rejection must be a
//! 4xx with OpenAI's error shape; nothing may panic.
#![no_main]

use axum::http::{HeaderMap, HeaderValue};
use kvq_engine::grammar::Followed;
use kvq_fuzz::{check_error, grammar, registry, template, tokenizer};
use kvq_server::ServerLimits;
use kvq_server::cache_select::resolve_cache;
use kvq_server::extract::parse_json;
use kvq_server::openai::{ChatCompletionRequest, CompletionRequest};
use kvq_server::routes::chat::{check_tools, render_and_encode_with};
use kvq_server::tool_calls::{ToolMode, ToolStream, parse_reply};
use kvq_server::validate::format::{schema_error, tool_schema_error};
use kvq_server::validate::{check_token_ids, prompt, validate_chat, validate_completion};
use libfuzzer_sys::fuzz_target;

const SERVED: &str = "SmolLM2-135M-Instruct";

fuzz_target!(|data: &[u8]| {
    kvq_fuzz::contain_third_party_panics();
    let mut headers = HeaderMap::new();
    let mut body = data;
    if let Some(rest) = data.strip_prefix(b"\x01") {
        let end = rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len());
        if let Ok(v) = HeaderValue::from_bytes(&rest[..end]) {
            headers.insert(kvq_server::cache_select::HEADER_METHOD, v);
        }
        body = rest.get(end + 1..).unwrap_or_default();
    }
    let limits = ServerLimits::default();

    match parse_json::<ChatCompletionRequest>(body) {
        Err(e) => check_error(&e),
        Ok(req) => match validate_chat(&req, SERVED, &limits) {
            Err(e) => check_error(&e),
            Ok(v) => {
                if let Err(e) = resolve_cache(registry(), &headers, v.params.kv_cache.as_ref()) {
                    check_error(&e);
                }
                if let Err(e) = check_tools(
                    template(),
                    v.tools.as_ref(),
                    v.params.response_format.is_some(),
                ) {
                    check_error(&e);
                }
                match render_and_encode_with(template(), tokenizer(), &v.messages, v.tools.as_ref())
                {
                    Err(e) => check_error(&e),
                    Ok(ids) => assert!(!ids.is_empty(), "a rendered chat has tokens"),
                }
                let (spec, on_error): (_, fn(_) -> _) = match v.params.response_format.clone() {
                    Some(f) => (Some(f), schema_error),
                    None => (
                        v.tools
                            .as_ref()
                            .and_then(kvq_server::validate::tools::ToolPlan::call_grammar),
                        tool_schema_error,
                    ),
                };
                if let Some(spec) = &spec {
                    match grammar().compile(spec) {
                        Err(e) => check_error(&on_error(e)),
                        Ok(c) => follow_a_few_tokens(c),
                    }
                }
                if let (Some(mode), Some(last)) =
                    (ToolMode::of(v.tools.as_ref()), v.messages.last())
                {
                    parse_as_a_reply(&mode, &last.content);
                }
            }
        },
    }

    match parse_json::<CompletionRequest>(body) {
        Err(e) => check_error(&e),
        Ok(req) => match validate_completion(&req, SERVED, &limits) {
            Err(e) => check_error(&e),
            Ok(_) => {
                // The prompt forms (text, token ids, batches) and the id range check.
                match prompt(req.prompt.as_ref()) {
                    Err(e) => check_error(&e),
                    Ok(kvq_server::validate::Prompt::Tokens(ids)) => {
                        if let Err(e) = check_token_ids(&ids, tokenizer().vocab_size()) {
                            check_error(&e);
                        }
                    }
                    Ok(_) => {}
                }
            }
        },
    }
});

/// Masks and follows the first allowed token a few times, as the worker's decode steps do; a
/// grammar error ends it (the worker fails that one sequence), nothing may panic.
fn follow_a_few_tokens(mut c: kvq_engine::Constraint) {
    let mut logits = vec![0.0f32; tokenizer().vocab_size()];
    for _ in 0..8 {
        logits.fill(0.0);
        if c.mask(&mut logits).is_err() {
            return;
        }
        let Some(id) = logits.iter().position(|l| l.is_finite()) else {
            panic!("mask succeeded but allowed nothing");
        };
        match c.follow(id as u32) {
            Ok(Followed::Open) => {}
            Ok(Followed::Complete) | Err(_) => return,
        }
    }
}

/// The last message's text as if the model had replied it: streamed in pieces of 3 bytes (at
/// char boundaries), it must give the calls the whole reply gives.
fn parse_as_a_reply(mode: &ToolMode, text: &str) {
    let (_, whole) = parse_reply(text, mode);
    let mut stream = ToolStream::new(mode.clone());
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + 3).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        let _ = stream.push(&text[start..end]);
        start = end;
    }
    let (_, streamed) = stream.finish();
    assert_eq!(
        streamed, whole,
        "a streamed reply's calls differ from the whole reply's"
    );
}
