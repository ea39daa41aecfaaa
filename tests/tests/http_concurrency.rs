//! Concurrency: simultaneous streams with different prompts each get their own correct greedy
//! output, batched by the engine.

mod common;

use common::{base, client, model_id, post_json};
use serde_json::{Value, json};

const PROMPTS: [&str; 8] = [
    "The capital of Italy is",
    "List three colors:",
    "Once upon a time",
    "The best way to learn Rust is",
    "Water boils at",
    "My favourite fruit is",
    "In 1969, humans",
    "A haiku about the sea:",
];

fn body(prompt: &str, stream: bool) -> Value {
    json!({"model": model_id(), "prompt": prompt, "temperature": 0, "max_tokens": 16, "stream": stream})
}

async fn stream_text(prompt: &str) -> String {
    let resp = client()
        .post(format!("{}/v1/completions", base()))
        .json(&body(prompt, true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_concurrent_streams_each_get_their_own_greedy_output() {
    // Reference: one at a time.
    let mut solo = Vec::new();
    for p in PROMPTS {
        let (s, _, v) = post_json("/v1/completions", &body(p, false), &[]).await;
        assert_eq!(s, 200, "{v}");
        solo.push(v["choices"][0]["text"].as_str().unwrap().to_string());
    }
    // All at once: batched by the engine.
    let together = futures::future::join_all(PROMPTS.iter().map(|p| stream_text(p))).await;
    for ((p, a), b) in PROMPTS.iter().zip(&solo).zip(&together) {
        assert_eq!(a, b, "prompt {p:?}: solo vs concurrent");
    }
    let distinct: std::collections::HashSet<_> = together.iter().collect();
    assert!(
        distinct.len() >= 6,
        "outputs should differ by prompt: {together:?}"
    );
}

/// Requests with different cache methods, running at the same time, each get the output they
/// get alone; the compressed cache reports fewer resident bytes than fp16.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn different_cache_methods_at_once_each_get_their_own_output() {
    // Longer than the 64-token fp16 window, so the compressed path really runs.
    let prompt =
        "The following is a short history of the printing press and its effect on Europe. "
            .repeat(6);
    let methods: [(&str, Option<&str>); 4] = [
        ("fp16", None),
        ("f32", None),
        ("turboquant-mse", Some("4")),
        ("turboquant-mse", Some("2")),
    ];
    let run = |m: &'static str, bits: Option<&'static str>| {
        let body = body(&prompt, false);
        async move {
            let mut headers = vec![("x-kv-cache-method", m)];
            if let Some(b) = bits {
                headers.push(("x-kv-cache-bits", b));
            }
            let (s, h, v) = post_json("/v1/completions", &body, &headers).await;
            assert_eq!(s, 200, "{m}: {v}");
            assert_eq!(h["x-kv-cache-method"], m);
            (
                v["choices"][0]["text"].as_str().unwrap().to_string(),
                v["usage"]["kv_cache_bytes"].as_u64().unwrap(),
            )
        }
    };
    let mut solo = Vec::new();
    for (m, b) in methods {
        solo.push(run(m, b).await);
    }
    let together = futures::future::join_all(methods.iter().map(|&(m, b)| run(m, b))).await;
    for ((m, b), (a, t)) in methods.iter().zip(solo.iter().zip(&together)) {
        assert_eq!(a.0, t.0, "{m} {b:?}: alone vs together");
    }
    let (fp16_bytes, tq2_bytes) = (solo[0].1, solo[3].1);
    assert!(
        tq2_bytes * 2 < fp16_bytes,
        "turboquant-mse 2-bit holds {tq2_bytes} bytes, fp16 {fp16_bytes}"
    );
}
