//! Admission by KV memory (`--kv-budget`): under one budget that fits exactly two fp16
//! requests, at least seven turboquant-mse-3bit requests of the same size run at once, reserved
//! bytes never exceed the budget and resident bytes never exceed reserved; a request that can
//! never fit is a 400 naming what it needs, the budget and the presets that would fit; past the
//! wait queue a request gets 429 with Retry-After; /metrics shows all of it. Held prefixes (the
//! ended requests' caches) never take the reservations past the budget.

use kvq_cache::{CacheRegistry, CacheSpec, ResolvedCache};
use kvq_engine::{
    Engine, EngineConfig, EngineStats, GenerationEvent, GenerationRequest, SamplingParams,
};
use kvq_tests::server::Server;
use kvq_tests::{default_gguf, workspace_root};
use std::time::{Duration, Instant};

const PROMPT: usize = 1008;
const MAX_TOKENS: usize = 16;

fn registry() -> CacheRegistry {
    let mut reg = CacheRegistry::builtin();
    reg.load_presets(&workspace_root().join("configs/cache"))
        .expect("presets");
    reg
}

fn resolved(reg: &CacheRegistry, name: &str) -> ResolvedCache {
    reg.resolve(&CacheSpec {
        method: Some(name.into()),
        bits: None,
    })
    .expect("method")
}

fn request(seed: u32, cache: ResolvedCache) -> GenerationRequest {
    GenerationRequest {
        // Distinct prompts of ordinary token ids.
        prompt: (0..PROMPT as u32)
            .map(|i| 200 + (i * 7 + seed * 13) % 9000)
            .collect(),
        max_tokens: Some(MAX_TOKENS),
        sampling: SamplingParams::greedy(),
        stop: Vec::new(),
        stop_on_eos: false,
        constraint: None,
        logprobs: None,
        cache,
    }
}

/// Runs `n` requests of `method` at once under `budget`, sampling the engine's stats until all
/// finish; returns the most sequences seen running at once. Asserts the invariants on every
/// sample: reserved <= budget, resident <= reserved (per method and in all).
fn run_all(engine: &Engine, reg: &CacheRegistry, method: &str, n: u32, budget: usize) -> usize {
    // The stats are a snapshot published after each step: wait for the one after the last
    // run's final step, so a stale count of its sequences is not read as this run's.
    let idle = Instant::now();
    while (engine.stats().running, engine.stats().waiting) != (0, 0) {
        assert!(
            idle.elapsed() < Duration::from_secs(30),
            "the engine never went idle"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let streams: Vec<_> = (0..n)
        .map(|i| {
            engine
                .submit(request(i, resolved(reg, method)))
                .expect("submit")
        })
        .collect();
    let check = |st: &EngineStats| {
        assert!(
            st.kv_reserved() <= budget,
            "reserved {} > budget {budget}",
            st.kv_reserved()
        );
        // Held prefixes (ended requests' caches) give way to the reservations.
        assert!(
            st.kv_reserved() + st.prefix_bytes <= budget,
            "reserved {} + held prefixes {} > budget {budget}",
            st.kv_reserved(),
            st.prefix_bytes
        );
        for (m, resident) in &st.kv_bytes_by_method {
            let reserved = st.kv_reserved_by_method.get(m).copied().unwrap_or(0);
            assert!(
                *resident <= reserved,
                "{m}: resident {resident} > reserved {reserved}"
            );
        }
    };
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let d = done.clone();
    let waiter = std::thread::spawn(move || {
        rt.block_on(async {
            for mut rx in streams {
                loop {
                    match rx.recv().await {
                        Some(GenerationEvent::Delta { .. }) => {}
                        Some(GenerationEvent::Finished { usage, .. }) => {
                            assert_eq!(usage.completion_tokens, MAX_TOKENS);
                            break;
                        }
                        other => panic!("stream ended with {other:?}"),
                    }
                }
                d.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        })
    });
    let mut most = 0;
    let start = Instant::now();
    while done.load(std::sync::atomic::Ordering::SeqCst) < n as usize {
        let st = engine.stats();
        check(&st);
        most = most.max(st.running);
        assert!(
            start.elapsed() < Duration::from_secs(600),
            "requests did not finish"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    waiter.join().expect("streams");
    most
}

#[test]
fn a_budget_for_two_fp16_requests_runs_seven_compressed_ones() {
    let loaded = kvq_models::load(&default_gguf(), &mut |_, _| {}).expect("model");
    let reg = registry();
    let probe = Engine::start(
        kvq_models::load(&default_gguf(), &mut |_, _| {}).expect("model"),
        EngineConfig::default(),
    );
    let tokens = PROMPT + MAX_TOKENS;
    let fp16 = probe
        .kv_need(&resolved(&reg, "fp16"), tokens)
        .expect("need");
    let mse3 = probe
        .kv_need(&resolved(&reg, "turboquant-mse-3bit"), tokens)
        .expect("need");
    drop(probe);
    // Two fp16 requests fit, a third does not.
    let budget = 2 * fp16 + fp16 * 3 / 4;
    assert!(
        7 * mse3 <= budget,
        "fp16 {fp16} B, mse-3 {mse3} B per request"
    );
    let engine = Engine::start(
        loaded,
        EngineConfig {
            kv_budget: Some(budget),
            ..EngineConfig::default()
        },
    );
    let most = run_all(&engine, &reg, "turboquant-mse-3bit", 7, budget);
    assert!(
        most >= 7,
        "only {most} turboquant-mse-3bit requests ran at once"
    );
    let most = run_all(&engine, &reg, "fp16", 3, budget);
    assert_eq!(most, 2, "fp16 requests running at once");
    let st = engine.stats();
    assert_eq!(st.admitted, 10);
    // The ended requests' caches stay held, as many as the budget takes.
    assert!(st.prefix_entries > 0 && st.prefix_bytes <= budget, "{st:?}");
    eprintln!(
        "budget {budget} B: fp16 reserves {fp16} B per request, turboquant-mse-3bit {mse3} B ({:.1}x)",
        fp16 as f64 / mse3 as f64
    );
}

async fn post(base: &str, body: serde_json::Value, method: &str) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .header("x-kv-cache-method", method)
        .json(&body)
        .send()
        .await
        .expect("request")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_never_fits_is_a_400_and_a_full_queue_a_429() {
    let model = default_gguf();
    let server = Server::start(&[
        "--model",
        model.to_str().expect("utf-8 path"),
        "--kv-budget",
        "60MiB",
        "--max-running",
        "1",
        "--max-waiting",
        "1",
        "--cache-presets",
        workspace_root()
            .join("configs/cache")
            .to_str()
            .expect("utf-8 path"),
    ]);
    let base = server.base.clone();
    assert!(
        server.log_text().contains("kvq KV budget: 60.00 MiB"),
        "{}",
        server.log_text()
    );
    // 8000 fp16 positions of SmolLM2 take ~190 MB; the 3-bit presets fit in 60 MiB.
    let big = serde_json::json!({"prompt": "Hello", "max_tokens": 8000});
    let resp = post(&base, big.clone(), "fp16").await;
    assert_eq!(resp.status(), 400);
    let v: serde_json::Value = resp.json().await.expect("json");
    let e = &v["error"];
    let msg = e["message"].as_str().expect("message");
    assert_eq!(e["type"], "invalid_request_error");
    assert_eq!(e["code"], "kv_cache_budget_exceeded");
    assert_eq!(e["param"], "max_tokens");
    assert!(
        msg.contains("as fp16") && msg.contains("KV budget is 60.00 MiB"),
        "{msg}"
    );
    assert!(msg.contains("turboquant-mse-3bit needs"), "{msg}");
    assert!(!msg.contains("fp16 needs"), "{msg}");
    eprintln!("{msg}");
    // The same request under a preset that fits runs.
    let resp = post(
        &base,
        serde_json::json!({"prompt": "Hello", "max_tokens": 4}),
        "turboquant-mse-3bit",
    )
    .await;
    assert_eq!(resp.status(), 200);

    // One runs, one waits, the rest are told to come back.
    let long = serde_json::json!({"prompt": "Once upon a time", "max_tokens": 200, "stream": true});
    let sends = (0..4).map(|_| post(&base, long.clone(), "fp16"));
    let resps = futures::future::join_all(sends).await;
    let mut statuses = Vec::new();
    for r in resps {
        let status = r.status().as_u16();
        if status == 429 {
            assert_eq!(
                r.headers().get("retry-after").and_then(|h| h.to_str().ok()),
                Some("1")
            );
            let v: serde_json::Value = r.json().await.expect("json");
            assert_eq!(v["error"]["code"], "overloaded");
        } else {
            let _ = r.text().await;
        }
        statuses.push(status);
    }
    assert!(statuses.contains(&429), "{statuses:?}");
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 429),
        "{statuses:?}"
    );

    let metrics = reqwest::get(format!("{base}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    let budget: Option<f64> = metrics
        .lines()
        .find_map(|l| l.strip_prefix("kvq_kv_budget_bytes "))
        .and_then(|v| v.trim().parse().ok());
    assert_eq!(budget, Some(62914560.0), "{metrics}");
    for want in [
        "kvq_kv_reserved_bytes{method=\"fp16\"}",
        "kvq_requests_rejected_total{reason=\"kv_budget\"} 1",
        "kvq_requests_rejected_total{reason=\"queue_full\"}",
        "kvq_requests_admitted_total",
        "kvq_requests_waiting",
    ] {
        assert!(metrics.contains(want), "/metrics lacks {want}:\n{metrics}");
    }
}
