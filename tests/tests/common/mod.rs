//! In-process test server: the real router over the real default model, on a loopback port,
//! shared by every test of one test binary (the model loads once).

#![allow(dead_code)]

use kvq_cache::CacheRegistry;
use kvq_engine::{Engine, EngineConfig};
use kvq_server::{AppState, ServerLimits};
use std::sync::{Arc, OnceLock};

/// Body limit the test server uses (small, so the 413 test stays cheap).
pub const TEST_BODY_LIMIT: usize = 256 * 1024;

struct Shared {
    base: String,
    engine: Engine,
}

fn shared() -> &'static Shared {
    static S: OnceLock<Shared> = OnceLock::new();
    S.get_or_init(|| {
        let loaded =
            kvq_models::load(&kvq_tests::default_gguf(), &mut |_, _| {}).expect("model loads");
        let engine = Engine::start(loaded, EngineConfig::default());
        let state = AppState {
            engine: engine.clone(),
            registry: Arc::new(CacheRegistry::builtin()),
            metrics: kvq_server::install_metrics(),
            limits: ServerLimits {
                max_body_bytes: TEST_BODY_LIMIT,
                ..ServerLimits::default()
            },
            access: kvq_server::Access::default(),
            lifecycle: Default::default(),
        };
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("bind");
                let addr = listener.local_addr().expect("addr");
                tx.send(format!("http://{addr}")).expect("send addr");
                axum::serve(listener, kvq_server::router(state))
                    .await
                    .expect("serve");
            });
        });
        let base = rx.recv().expect("server address");
        Shared { base, engine }
    })
}

/// `http://127.0.0.1:PORT` of the shared test server.
pub fn base() -> &'static str {
    &shared().base
}

/// The engine behind the test server.
pub fn engine() -> &'static Engine {
    &shared().engine
}

/// The model id the server reports.
pub fn model_id() -> String {
    engine().model_info().id.clone()
}

/// An HTTP client.
pub fn client() -> reqwest::Client {
    reqwest::Client::new()
}

/// POSTs JSON and returns (status, headers, parsed body).
pub async fn post_json(
    path: &str,
    body: &serde_json::Value,
    headers: &[(&str, &str)],
) -> (u16, reqwest::header::HeaderMap, serde_json::Value) {
    let mut req = client().post(format!("{}{path}", base())).json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.expect("request");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = resp.text().await.expect("body");
    let json = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("response is not JSON ({e}): {text}"));
    (status, headers, json)
}

/// POSTs a streaming request and returns every `data:` payload of the SSE stream, in order.
pub async fn post_sse(
    path: &str,
    body: &serde_json::Value,
    headers: &[(&str, &str)],
) -> (u16, reqwest::header::HeaderMap, Vec<String>) {
    let mut req = client().post(format!("{}{path}", base())).json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.expect("request");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = resp.text().await.expect("body");
    let data = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|l| l.trim().to_string())
        .collect();
    (status, headers, data)
}

/// The golden case `i` of shared/golden/smollm2.json.
pub fn golden_case(i: usize) -> serde_json::Value {
    kvq_tests::golden()["cases"][i].clone()
}
