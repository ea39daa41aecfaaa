//! Bad-input cases of chat and completions validation: each maps to the right status and param.

use super::*;
use crate::extract::parse_json;
use axum::http::StatusCode;
use serde_json::json;

const MODEL: &str = "SmolLM2-135M-Instruct";

fn limits() -> ServerLimits {
    ServerLimits::default()
}

fn chat(body: serde_json::Value) -> Result<ValidatedChat, ApiError> {
    let req: ChatCompletionRequest = parse_json(body.to_string().as_bytes())?;
    validate_chat(&req, MODEL, &limits())
}

fn completion(body: serde_json::Value) -> Result<ValidatedCompletion, ApiError> {
    let req: CompletionRequest = parse_json(body.to_string().as_bytes())?;
    validate_completion(&req, MODEL, &limits())
}

fn with(extra: serde_json::Value) -> serde_json::Value {
    let mut base = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
    if let (Some(b), Some(e)) = (base.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    base
}

#[track_caller]
fn assert_bad(
    result: Result<impl std::fmt::Debug, ApiError>,
    status: StatusCode,
    param: Option<&str>,
) {
    match result {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => {
            assert_eq!(e.status(), status, "{e:?}");
            assert_eq!(e.param(), param, "{e:?}");
        }
    }
}

#[test]
fn minimal_chat_defaults() {
    let v = chat(with(json!({}))).unwrap();
    assert_eq!(v.model, MODEL);
    assert_eq!(v.messages, vec![Message::text(Role::User, "hi")]);
    let p = &v.params;
    assert_eq!(p.max_tokens, None);
    assert_eq!(p.sampling, SamplingParams::default());
    assert!(p.stop.is_empty());
    assert_eq!(p.logprobs, None);
    assert_eq!(p.n, 1);
    assert!(!p.stream);
    assert!(!p.include_usage);
    assert_eq!(p.kv_cache, None);
}

#[test]
fn full_chat_parses() {
    let v = chat(with(json!({
        "max_tokens": 10, "max_completion_tokens": 20, "temperature": 0, "top_p": 0.9,
        "top_k": 40, "min_p": 0.05, "seed": 7, "stop": ["a", "b"], "frequency_penalty": 0.5,
        "presence_penalty": -0.5, "repetition_penalty": 1.1, "logprobs": true, "top_logprobs": 3,
        "n": 1, "stream": true, "stream_options": {"include_usage": true}, "user": "x",
        "kv_cache": {"method": "fp16", "bits": 16}, "tools": [], "response_format": {"type": "text"}
    })))
    .unwrap();
    let p = &v.params;
    assert_eq!(p.max_tokens, Some(20), "max_completion_tokens wins");
    assert_eq!(p.sampling.temperature, 0.0);
    assert_eq!(p.sampling.top_k, 40);
    assert_eq!(p.sampling.seed, Some(7));
    assert_eq!(p.stop, vec!["a".to_string(), "b".to_string()]);
    assert_eq!(p.logprobs, Some(3));
    assert!(p.stream && p.include_usage);
    assert_eq!(
        p.kv_cache,
        Some(CacheSpec {
            method: Some("fp16".into()),
            bits: Some(16)
        })
    );
}

#[test]
fn nulls_are_defaults() {
    let v = chat(with(json!({"temperature": null, "stop": null, "max_tokens": null, "seed": null, "stream_options": null}))).unwrap();
    assert_eq!(v.params.sampling, SamplingParams::default());
}

#[test]
fn model_checks() {
    assert!(chat(with(json!({"model": "smollm2-135m-instruct"}))).is_ok());
    assert!(
        chat(with(
            json!({"model": "HuggingFaceTB/SmolLM2-135M-Instruct"})
        ))
        .is_ok()
    );
    let mut body = with(json!({}));
    body.as_object_mut().map(|o| o.remove("model"));
    assert_eq!(chat(body).unwrap().model, MODEL);
    assert_bad(
        chat(with(json!({"model": "gpt-4o"}))),
        StatusCode::NOT_FOUND,
        Some("model"),
    );
    let err = chat(with(json!({"model": "gpt-4o"}))).unwrap_err();
    assert_eq!(err.code(), Some("model_not_found"));
    assert_eq!(err.error_type(), "invalid_request_error");
}

#[test]
fn a_model_served_under_a_hub_id_answers_to_its_forms() {
    let served = "bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M";
    for ok in [
        served,
        "bartowski/llama-3.2-1b-instruct-gguf:q4_k_m",
        "bartowski/Llama-3.2-1B-Instruct-GGUF",
        "Llama-3.2-1B-Instruct-GGUF",
        "Llama-3.2-1B-Instruct-GGUF:Q4_K_M",
        "other-org/Llama-3.2-1B-Instruct-GGUF",
    ] {
        assert_eq!(check_model(Some(ok), served).unwrap(), served, "{ok}");
    }
    for bad in [
        "bartowski/Llama-3.2-3B-Instruct-GGUF",
        "Q4_K_M",
        "bartowski",
    ] {
        assert!(check_model(Some(bad), served).is_err(), "{bad}");
    }
    let pinned = "HuggingFaceTB/SmolLM2-360M-Instruct@main";
    assert_eq!(
        check_model(Some("SmolLM2-360M-Instruct"), pinned).unwrap(),
        pinned
    );
}

#[test]
fn messages_checks() {
    assert_bad(
        chat(json!({"model": MODEL})),
        StatusCode::BAD_REQUEST,
        Some("messages"),
    );
    assert_bad(
        chat(json!({"messages": []})),
        StatusCode::BAD_REQUEST,
        Some("messages"),
    );
    assert_bad(
        chat(json!({"messages": "hi"})),
        StatusCode::BAD_REQUEST,
        Some("messages"),
    );
    assert_bad(
        chat(json!({"messages": [{"role": "function", "content": "x"}]})),
        StatusCode::BAD_REQUEST,
        Some("messages[0].role"),
    );
    assert_bad(
        chat(json!({"messages": [{"role": "tool", "content": "x"}]})),
        StatusCode::BAD_REQUEST,
        Some("messages[0].tool_call_id"),
    );
    assert_bad(
        chat(json!({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]})),
        StatusCode::BAD_REQUEST,
        Some("messages[0].tool_call_id"),
    );
    assert_bad(
        chat(
            json!({"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}),
        ),
        StatusCode::BAD_REQUEST,
        Some("messages[0].tool_calls"),
    );
    let v = chat(json!({"messages": [{"role": "user", "content": "x"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "42"}]}))
    .unwrap();
    assert_eq!(v.messages[2].role, Role::Tool);
    assert_eq!(v.messages[2].tool_call_id.as_deref(), Some("c"));
    assert_eq!(
        v.messages[1]
            .tool_calls
            .as_ref()
            .map(|c| c[0]["function"]["arguments"]["a"].clone()),
        Some(json!(1))
    );
    assert_bad(
        chat(json!({"messages": [{"content": "x"}]})),
        StatusCode::BAD_REQUEST,
        Some("messages[0].role"),
    );
    assert_bad(
        chat(json!({"messages": [{"role": "user", "content": 5}]})),
        StatusCode::BAD_REQUEST,
        Some("messages[0].content"),
    );
}

#[test]
fn roles_and_content_parts() {
    let v = chat(json!({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "User", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": null},
    ]}))
    .unwrap();
    assert_eq!(v.messages[0].role, Role::System);
    assert_eq!(v.messages[1], Message::text(Role::User, "ab"));
    assert_eq!(v.messages[2].content, "");

    let image = json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}
    ]}]});
    assert_bad(
        chat(image),
        StatusCode::BAD_REQUEST,
        Some("messages[0].content[1].type"),
    );
    let no_text = json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]});
    assert_bad(
        chat(no_text),
        StatusCode::BAD_REQUEST,
        Some("messages[0].content[0].text"),
    );
    let not_obj = json!({"messages": [{"role": "user", "content": ["a"]}]});
    assert_bad(
        chat(not_obj),
        StatusCode::BAD_REQUEST,
        Some("messages[0].content[0]"),
    );
}

#[test]
fn sampling_ranges() {
    let cases = [
        (json!({"temperature": "hot"}), "temperature"),
        (json!({"temperature": 2.5}), "temperature"),
        (json!({"temperature": -0.1}), "temperature"),
        (json!({"top_p": 0}), "top_p"),
        (json!({"top_p": 1.5}), "top_p"),
        (json!({"top_k": -1}), "top_k"),
        (json!({"top_k": 1.5}), "top_k"),
        (json!({"min_p": 1.5}), "min_p"),
        (json!({"frequency_penalty": 3}), "frequency_penalty"),
        (json!({"presence_penalty": -2.5}), "presence_penalty"),
        (json!({"repetition_penalty": 0}), "repetition_penalty"),
        (json!({"seed": 1.5}), "seed"),
        (json!({"seed": "x"}), "seed"),
        (json!({"max_tokens": -1}), "max_tokens"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"max_tokens": "ten"}), "max_tokens"),
        (json!({"max_completion_tokens": 0}), "max_completion_tokens"),
        (json!({"n": 2}), "n"),
        (json!({"n": 0}), "n"),
        (json!({"stream": "yes"}), "stream"),
        (json!({"logprobs": 1}), "logprobs"),
        (json!({"top_logprobs": 2}), "top_logprobs"),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            json!({"logprobs": false, "top_logprobs": 1}),
            "top_logprobs",
        ),
        (
            json!({"stream_options": {"include_usage": "yes"}}),
            "stream_options.include_usage",
        ),
    ];
    for (extra, param) in cases {
        let result = chat(with(extra.clone()));
        match result {
            Err(e) => {
                assert_eq!(e.status(), StatusCode::BAD_REQUEST, "{extra}: {e:?}");
                assert_eq!(e.param(), Some(param), "{extra}: {e:?}");
            }
            Ok(v) => panic!("{extra} should be rejected, got {v:?}"),
        }
    }
    let v = chat(with(
        json!({"temperature": 2, "top_p": 1, "min_p": 0, "seed": -1, "repetition_penalty": 0.5}),
    ))
    .unwrap();
    assert_eq!(v.params.sampling.seed, Some(u64::MAX));
}

#[test]
fn n_up_to_limit() {
    let req: ChatCompletionRequest =
        parse_json(with(json!({"n": 3})).to_string().as_bytes()).unwrap();
    let l = ServerLimits {
        max_n: 4,
        ..ServerLimits::default()
    };
    assert_eq!(validate_chat(&req, MODEL, &l).unwrap().params.n, 3);
    let req: ChatCompletionRequest =
        parse_json(with(json!({"n": 5})).to_string().as_bytes()).unwrap();
    assert_bad(
        validate_chat(&req, MODEL, &l),
        StatusCode::BAD_REQUEST,
        Some("n"),
    );
}

#[test]
fn stop_parsing() {
    assert_eq!(
        chat(with(json!({"stop": "\n"}))).unwrap().params.stop,
        vec!["\n".to_string()]
    );
    assert_eq!(
        chat(with(json!({"stop": []}))).unwrap().params.stop,
        Vec::<String>::new()
    );
    assert_eq!(
        chat(with(json!({"stop": ["a", "b", "c", "d"]})))
            .unwrap()
            .params
            .stop
            .len(),
        4
    );
    for bad in [
        json!(""),
        json!(["a", "b", "c", "d", "e"]),
        json!([""]),
        json!([1]),
        json!(5),
        json!({"a": 1}),
        json!("x".repeat(4097)),
        json!(["a", "x".repeat(4097)]),
    ] {
        assert_bad(
            chat(with(json!({"stop": bad}))),
            StatusCode::BAD_REQUEST,
            Some("stop"),
        );
    }
}

#[test]
fn include_usage_only_when_streaming() {
    let v = chat(with(json!({"stream_options": {"include_usage": true}}))).unwrap();
    assert!(!v.params.include_usage);
}

#[test]
fn kv_cache_body() {
    let v = chat(with(json!({"kv_cache": "qjl"}))).unwrap();
    assert_eq!(
        v.params.kv_cache,
        Some(CacheSpec {
            method: Some("qjl".into()),
            bits: None
        })
    );
    assert_bad(
        chat(with(json!({"kv_cache": {"method": 3}}))),
        StatusCode::BAD_REQUEST,
        Some("kv_cache.method"),
    );
    assert_bad(
        chat(with(json!({"kv_cache": {"bits": "x"}}))),
        StatusCode::BAD_REQUEST,
        Some("kv_cache.bits"),
    );
    assert_bad(
        chat(with(json!({"kv_cache": {"bits": 300}}))),
        StatusCode::BAD_REQUEST,
        Some("kv_cache.bits"),
    );
    assert_bad(
        chat(with(json!({"kv_cache": 5}))),
        StatusCode::BAD_REQUEST,
        Some("kv_cache"),
    );
}

#[test]
fn completion_prompts() {
    let p = |v: serde_json::Value| completion(json!({"prompt": v})).map(|c| c.prompt);
    assert_eq!(p(json!("hi")).unwrap(), Prompt::Text("hi".into()));
    assert_eq!(p(json!(["hi"])).unwrap(), Prompt::Text("hi".into()));
    assert_eq!(p(json!([1, 2, 3])).unwrap(), Prompt::Tokens(vec![1, 2, 3]));
    assert_eq!(p(json!([[4, 5]])).unwrap(), Prompt::Tokens(vec![4, 5]));
    for bad in [
        json!([]),
        json!(["a", "b"]),
        json!([-1]),
        json!([1.5]),
        json!(5),
        json!([[]]),
        json!(null),
    ] {
        assert_bad(p(bad), StatusCode::BAD_REQUEST, Some("prompt"));
    }
    assert_bad(
        completion(json!({})),
        StatusCode::BAD_REQUEST,
        Some("prompt"),
    );
    assert!(check_token_ids(&[1, 99], 100).is_ok());
    assert_bad(
        check_token_ids(&[1, 100], 100),
        StatusCode::BAD_REQUEST,
        Some("prompt"),
    );
}

#[test]
fn completion_fields() {
    let v = completion(json!({"prompt": "x"})).unwrap();
    assert_eq!(v.params.max_tokens, Some(DEFAULT_COMPLETION_MAX_TOKENS));
    assert!(!v.echo);
    let v = completion(json!({"prompt": "x", "logprobs": 5, "max_tokens": 3, "echo": false, "best_of": 1, "suffix": null}))
        .unwrap();
    assert_eq!(v.params.logprobs, Some(5));
    assert_eq!(v.params.max_tokens, Some(3));
    let cases = [
        (json!({"logprobs": 6}), "logprobs"),
        (json!({"logprobs": true}), "logprobs"),
        (json!({"suffix": "end"}), "suffix"),
        (json!({"echo": true, "logprobs": 1}), "echo"),
        (json!({"best_of": 2}), "best_of"),
        (json!({"n": 2}), "n"),
        (json!({"model": "davinci"}), "model"),
    ];
    for (extra, param) in cases {
        let mut body = json!({"prompt": "x"});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        let err = completion(body).expect_err(&extra.to_string());
        assert_eq!(err.param(), Some(param), "{extra}: {err:?}");
    }
    assert!(
        completion(json!({"prompt": "x", "echo": true}))
            .unwrap()
            .echo
    );
}

#[test]
fn unknown_fields_are_rejected_and_openai_fields_accepted() {
    let err = parse_json::<ChatCompletionRequest>(br#"{"messages": [], "grammar": "x"}"#)
        .expect_err("unknown field");
    assert_eq!(err.status(), StatusCode::BAD_REQUEST);
    assert!(err.to_string().contains("grammar"), "{err}");
    let err = parse_json::<ChatCompletionRequest>(
        br#"{"messages": [{"role": "user", "content": "hi", "foo": 1}]}"#,
    )
    .expect_err("unknown message field");
    assert!(err.to_string().contains("foo"), "{err}");
    assert!(
        err.param().is_some_and(|p| p.starts_with("messages")),
        "{err:?}"
    );
    let err = parse_json::<CompletionRequest>(br#"{"prompt": "a", "bar": 1}"#)
        .expect_err("unknown completion field");
    assert!(err.to_string().contains("bar"), "{err}");
    // What OpenAI's clients send is accepted (and not acted on where kvq has no such feature).
    parse_json::<ChatCompletionRequest>(
        br#"{"messages": [{"role": "user", "content": "hi", "name": "a"}], "user": "u",
             "metadata": {}, "store": false, "logit_bias": {}, "ignore_eos": true}"#,
    )
    .expect("OpenAI's fields");
    assert!(
        chat(with(json!({"ignore_eos": true})))
            .expect("valid")
            .params
            .ignore_eos
    );
    assert!(!chat(with(json!({}))).expect("valid").params.ignore_eos);
}
