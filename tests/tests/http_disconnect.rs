//! A client that disconnects mid-stream stops its generation and frees its cache (its own test
//! binary, so no other test's requests are running meanwhile).

mod common;

use common::{base, client, model_id};
use futures::StreamExt;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

async fn health() -> Value {
    client()
        .get(format!("{}/health", base()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn disconnect_mid_stream_stops_generation_and_frees_the_cache() {
    let mut b = json!({"model": model_id(), "prompt": "Write a very long essay about the history of bread.", "temperature": 0, "stream": true});
    b["max_tokens"] = json!(4000);
    let resp = client()
        .post(format!("{}/v1/completions", base()))
        .json(&b)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let mut seen = 0;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        seen += chunk.len();
        if seen > 600 {
            break;
        }
    }
    // It was running; now hang up.
    drop(stream);
    let start = Instant::now();
    loop {
        let h = health().await;
        let stats = common::engine().stats();
        if h["running"] == 0 && stats.kv_bytes_by_method.values().all(|&b| b == 0) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "generation still running 10 s after the client left: {h}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
