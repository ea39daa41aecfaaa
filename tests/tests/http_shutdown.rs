//! Graceful shutdown of the real `kvq serve` process: on SIGTERM new requests get 503 (with
//! `Retry-After`), a stream that finishes within `--shutdown-grace` ends normally, one still
//! running when the grace is over ends with an SSE error event and `[DONE]`, and the process
//! exits 0; and `--request-timeout` ends a request that runs too long the same way (408 for a
//! plain request), freeing its sequence.

use futures::StreamExt;
use kvq_tests::default_gguf;
use kvq_tests::server::Server;
use std::time::{Duration, Instant};

/// Long enough for the short stream's 3 tokens on a loaded 2-core machine.
const GRACE_S: f64 = 5.0;

/// Opens a streaming completion of `max_tokens` tokens; its body as a stream of text pieces.
async fn open_stream(
    client: &reqwest::Client,
    base: &str,
    model: &str,
    max_tokens: usize,
) -> impl futures::Stream<Item = String> + Unpin {
    let resp = client
        .post(format!("{base}/v1/completions"))
        .json(&serde_json::json!({
            "model": model,
            "prompt": "1, 2, 3, 4, 5, 6, 7,",
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": true
        }))
        .send()
        .await
        .expect("stream request");
    assert_eq!(resp.status(), 200);
    Box::pin(
        resp.bytes_stream()
            .map(|b| String::from_utf8_lossy(&b.expect("body bytes")).into_owned()),
    )
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// `GET base + path` as JSON.
async fn get(client: &reqwest::Client, base: &str, path: &str) -> serde_json::Value {
    let resp = client.get(format!("{base}{path}")).send().await;
    resp.expect("GET").json().await.expect("a JSON body")
}

/// Reads `s` until its first data chunk arrives; that text.
async fn first_chunk(s: &mut (impl futures::Stream<Item = String> + Unpin)) -> String {
    let mut text = String::new();
    while !text.contains("data: {") {
        text += &s.next().await.expect("a first chunk");
    }
    text
}

/// The rest of `s`, to its end.
async fn rest(mut s: impl futures::Stream<Item = String> + Unpin) -> String {
    let mut text = String::new();
    while let Some(piece) = s.next().await {
        text += &piece;
    }
    text
}

#[test]
fn sigterm_drains_then_cuts_then_exits_zero() {
    let model = default_gguf();
    let grace = GRACE_S.to_string();
    let mut server = Server::start_on(
        "127.0.0.1",
        &[
            "--model",
            model.to_str().expect("utf-8 path"),
            "--shutdown-grace",
            &grace,
        ],
        &[],
    );
    let base = server.base.clone();
    let pid = server.pid();
    let rt = runtime();
    let (long, short, refused, health, took) = rt.block_on(async {
        let client = reqwest::Client::new();
        let id = get(&client, &base, "/v1/models").await["data"][0]["id"]
            .as_str()
            .expect("a model id")
            .to_string();
        // One stream far longer than the grace, one that ends well within it.
        let mut long = open_stream(&client, &base, &id, 4000).await;
        let mut long_text = first_chunk(&mut long).await;
        let mut short = open_stream(&client, &base, &id, 3).await;
        let short_text = first_chunk(&mut short).await;
        let status = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
        let sent = Instant::now();
        // The signal is handled asynchronously: give it a moment before asking again.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let refused = client
            .get(format!("{base}/v1/models"))
            .send()
            .await
            .expect("a request while draining");
        let refused = (
            refused.status().as_u16(),
            refused.headers().get("retry-after").is_some(),
            refused.json::<serde_json::Value>().await.expect("json"),
        );
        let health = client
            .get(format!("{base}/health"))
            .send()
            .await
            .map(|r| r.status().as_u16());
        let short_text = short_text + &rest(short).await;
        long_text += &rest(long).await;
        (long_text, short_text, refused, health, sent.elapsed())
    });
    assert_eq!(refused.0, 503, "{:?}", refused.2);
    assert!(refused.1, "503 without Retry-After");
    assert_eq!(refused.2["error"]["code"], "unavailable", "{:?}", refused.2);
    assert_eq!(health.ok(), Some(503), "/health while draining");
    // The short stream finished normally inside the grace.
    assert!(
        short.contains("\"finish_reason\":\"length\"")
            && short.trim_end().ends_with("data: [DONE]")
            && !short.contains("\"error\""),
        "{short}"
    );
    // The long one was cut at the grace: an error event, then [DONE].
    let err_at = long
        .find("data: {\"error\"")
        .unwrap_or_else(|| panic!("no error event: {long}"));
    assert!(
        long[err_at..].contains("shutting down"),
        "{}",
        &long[err_at..]
    );
    assert!(long.trim_end().ends_with("data: [DONE]"), "{long}");
    assert!(
        took >= Duration::from_secs_f64(GRACE_S - 0.5),
        "the stream ended after {took:?}, before the {GRACE_S} s grace"
    );
    let status = server
        .wait_exit(Duration::from_secs(15))
        .expect("the server exits");
    assert!(status.success(), "exit status {status:?}");
    let log = server.log.lock().map(|l| l.join("\n")).unwrap_or_default();
    assert!(log.contains("shutdown grace over"), "{log}");
}

#[test]
fn a_request_past_the_timeout_ends_with_an_error_and_frees_its_sequence() {
    let model = default_gguf();
    let server = Server::start_on(
        "127.0.0.1",
        &[
            "--model",
            model.to_str().expect("utf-8 path"),
            "--request-timeout",
            "1.5",
        ],
        &[],
    );
    let base = server.base.clone();
    let rt = runtime();
    rt.block_on(async {
        let client = reqwest::Client::new();
        let id = get(&client, &base, "/v1/models").await["data"][0]["id"]
            .as_str()
            .expect("a model id")
            .to_string();
        let start = Instant::now();
        let text = rest(open_stream(&client, &base, &id, 4000).await).await;
        let took = start.elapsed();
        let err_at = text
            .find("data: {\"error\"")
            .unwrap_or_else(|| panic!("no error event: {text}"));
        assert!(
            text[err_at..].contains("request_timeout"),
            "{}",
            &text[err_at..]
        );
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        assert!(
            took >= Duration::from_millis(1400) && took < Duration::from_secs(10),
            "{took:?}"
        );
        let resp = client
            .post(format!("{base}/v1/completions"))
            .json(&serde_json::json!({
                "model": id, "prompt": "1, 2, 3, 4, 5, 6, 7,", "max_tokens": 4000, "temperature": 0
            }))
            .send()
            .await
            .expect("plain request");
        assert_eq!(resp.status().as_u16(), 408);
        let body: serde_json::Value = resp.json().await.expect("json");
        assert_eq!(body["error"]["code"], "request_timeout", "{body}");
        // Both sequences are freed (at the engine's next step: allow for a loaded machine).
        let mut health = get(&client, &base, "/health").await;
        for _ in 0..50 {
            if health["running"] == 0 && health["waiting"] == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            health = get(&client, &base, "/health").await;
        }
        assert_eq!(
            (health["running"].as_u64(), health["waiting"].as_u64()),
            (Some(0), Some(0)),
            "{health}"
        );
    });
}
