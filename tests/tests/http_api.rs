//! End-to-end tests of the OpenAI API over HTTP with the real model: completions and chat,
//! streaming and not, the cache-method header, usage, sampling controls, stop strings,
//! logprobs, models, health and metrics.

mod common;

use common::{base, client, golden_case, model_id, post_json, post_sse};
use serde_json::{Value, json};

#[tokio::test]
async fn completions_reproduce_the_golden_text() {
    let case = golden_case(0);
    let want = case["greedy_text"]
        .as_str()
        .unwrap()
        .trim_end_matches("<|im_end|>");
    let body =
        json!({"model": model_id(), "prompt": case["prompt"], "temperature": 0, "max_tokens": 50});
    let (status, headers, v) =
        post_json("/v1/completions", &body, &[("x-kv-cache-method", "f32")]).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(headers["x-kv-cache-method"], "f32");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], want);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let n_prompt = case["prompt_ids"].as_array().unwrap().len();
    let n_gen = case["greedy_ids"].as_array().unwrap().len();
    assert_eq!(v["usage"]["prompt_tokens"], n_prompt);
    assert_eq!(v["usage"]["completion_tokens"], n_gen);
    assert_eq!(v["usage"]["total_tokens"], n_prompt + n_gen);
    assert!(v["usage"]["kv_cache_bytes"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn chat_stream_matches_non_stream_and_follows_openai_chunks() {
    let body = json!({
        "model": model_id(),
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}],
        "temperature": 0,
        "max_tokens": 30,
    });
    let (status, headers, full) = post_json(
        "/v1/chat/completions",
        &body,
        &[("x-kv-cache-method", "fp16")],
    )
    .await;
    assert_eq!(status, 200, "{full}");
    assert_eq!(headers["x-kv-cache-method"], "fp16");
    assert_eq!(full["object"], "chat.completion");
    assert_eq!(full["choices"][0]["message"]["role"], "assistant");
    let content = full["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!content.trim().is_empty(), "{full}");

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let (status, headers, data) = post_sse(
        "/v1/chat/completions",
        &sbody,
        &[("x-kv-cache-method", "fp16")],
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-kv-cache-method"], "fp16");
    assert!(
        headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let id = chunks[0]["id"].clone();
    assert!(
        chunks
            .iter()
            .all(|c| c["id"] == id && c["object"] == "chat.completion.chunk")
    );
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    // The usage chunk comes last, with no choices; the one before carries the finish reason.
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
    assert_eq!(usage["usage"], full["usage"]);
    let fin = &chunks[chunks.len() - 2];
    assert_eq!(
        fin["choices"][0]["finish_reason"],
        full["choices"][0]["finish_reason"]
    );
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, content);
    // Only the final chunk may carry a finish reason.
    let finishes = chunks
        .iter()
        .filter(|c| !c["choices"][0]["finish_reason"].is_null())
        .count();
    assert_eq!(finishes, 1);
}

#[tokio::test]
async fn max_tokens_ends_with_length_and_exact_counts() {
    for field in ["max_tokens", "max_completion_tokens"] {
        let mut body = json!({
            "model": model_id(),
            "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "temperature": 0,
        });
        body[field] = json!(7);
        let (status, _, v) = post_json("/v1/chat/completions", &body, &[]).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["usage"]["completion_tokens"], 7);
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        let retok = common::engine().tokenizer().encode(text, false).unwrap();
        assert!(retok.len() <= 8, "{text:?} is longer than 7 tokens");
    }
}

#[tokio::test]
async fn stop_strings_are_never_emitted() {
    let case = golden_case(1);
    // Greedy text: ", the city of Nova Haven was a thriving metropolis, ..."
    for stop in [
        json!("Haven"),
        json!(["zzz", "thriving"]),
        json!(" Nova Ha"),
    ] {
        let body = json!({"model": model_id(), "prompt": case["prompt"], "temperature": 0,
            "max_tokens": 20, "stop": stop});
        let (status, _, v) =
            post_json("/v1/completions", &body, &[("x-kv-cache-method", "f32")]).await;
        assert_eq!(status, 200, "{v}");
        let text = v["choices"][0]["text"].as_str().unwrap();
        let full = case["greedy_text"].as_str().unwrap();
        let first = match &stop {
            Value::String(s) => s.clone(),
            Value::Array(a) => a[1].as_str().unwrap().to_string(),
            _ => unreachable!(),
        };
        let cut = full.find(&first).unwrap();
        assert_eq!(text, &full[..cut], "stop {stop}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }
    // Streaming: the stop string never shows up in any chunk either.
    let body = json!({"model": model_id(), "prompt": case["prompt"], "temperature": 0,
        "max_tokens": 20, "stop": " Nova Ha", "stream": true});
    let (_, _, data) = post_sse("/v1/completions", &body, &[("x-kv-cache-method", "f32")]).await;
    let text: String = data
        .iter()
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text, ", the city of");
}

#[tokio::test]
async fn same_seed_same_sample_and_sampling_controls_are_accepted() {
    let body = json!({
        "model": model_id(),
        "prompt": "The weather today is",
        "temperature": 1.2, "top_p": 0.9, "top_k": 40, "min_p": 0.02, "seed": 1234,
        "frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.1,
        "max_tokens": 24,
    });
    let (s1, _, a) = post_json("/v1/completions", &body, &[]).await;
    let (s2, _, b) = post_json("/v1/completions", &body, &[]).await;
    assert_eq!((s1, s2), (200, 200), "{a} {b}");
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    let mut other = body.clone();
    other["seed"] = json!(99);
    let outputs: Vec<String> = futures::future::join_all((0..3).map(|i| {
        let mut b = other.clone();
        b["seed"] = json!(100 + i);
        async move {
            post_json("/v1/completions", &b, &[]).await.2["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        }
    }))
    .await;
    let first = a["choices"][0]["text"].as_str().unwrap();
    assert!(
        outputs.iter().any(|o| o != first),
        "four seeds all gave {first:?}"
    );
}

#[tokio::test]
async fn logprobs_are_reported_per_token() {
    let body = json!({
        "model": model_id(),
        "messages": [{"role": "user", "content": "Say hi."}],
        "temperature": 0, "max_tokens": 5, "logprobs": true, "top_logprobs": 3,
    });
    let (status, _, v) = post_json("/v1/chat/completions", &body, &[]).await;
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert!(!content.is_empty());
    for entry in content {
        let lp = entry["logprob"].as_f64().unwrap();
        assert!(lp <= 0.0);
        let tops = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(tops.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert!((tops[0]["logprob"].as_f64().unwrap() - lp).abs() < 1e-4);
        assert!(entry["bytes"].is_array());
    }
}

#[tokio::test]
async fn models_health_and_metrics() {
    let c = client();
    let v: Value = c
        .get(format!("{}/v1/models", base()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], model_id());
    let r = c
        .get(format!("{}/v1/models/{}", base(), model_id()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let h: Value = c
        .get(format!("{}/health", base()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(h["status"], "ok");
    // One request so the counters exist, then scrape.
    let body = json!({"model": model_id(), "prompt": "Hi", "max_tokens": 2, "temperature": 0});
    assert_eq!(post_json("/v1/completions", &body, &[]).await.0, 200);
    let m = c
        .get(format!("{}/metrics", base()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "kvq_requests_total",
        "kvq_prompt_tokens_total",
        "kvq_completion_tokens_total",
        "kvq_time_to_first_token_seconds",
        "kvq_decode_tokens_per_second",
        "kvq_kv_cache_bytes",
    ] {
        assert!(m.contains(name), "{name} missing from /metrics:\n{m}");
    }
}

/// `logit_bias` reaches the sampler: +100 on one token makes every generated token that one,
/// at temperature 1 as greedily; the output is that token's text repeated.
#[tokio::test]
async fn logit_bias_forces_a_token() {
    for temperature in [0.0, 1.0] {
        let body = json!({
            "model": model_id(), "prompt": "The weather today is", "max_tokens": 4,
            "temperature": temperature, "seed": 3, "logit_bias": {"1000": 100},
        });
        let (status, _, v) = post_json("/v1/completions", &body, &[]).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
        let text = v["choices"][0]["text"].as_str().unwrap();
        let piece = text.get(..text.len() / 4).unwrap_or_default();
        assert!(!piece.is_empty() && text == piece.repeat(4), "{text:?}");
    }
}
