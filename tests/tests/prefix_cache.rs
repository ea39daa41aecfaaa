//! The prefix cache with the real SmolLM2: a request whose prompt starts with an ended
//! request's tokens continues from its caches (compressed ones as codes) and reports the reused
//! tokens as `cached_tokens`, and its output is exactly a fresh engine's: the same tokens and
//! bit-identical logprobs, for fp16 and every preset, when the common prefix is the whole held
//! state, when it ends inside the fp16 window (a truncation back into it), and when it ends
//! before the key center is fixed. Over HTTP, a chat's second turn reports its cached tokens
//! and /metrics counts the hit. Conversations sharing only a system prompt reuse it under every
//! method (a compressed one through a copy held at the shared prefix).
//!
//! The engine picks the reuse point so that the rest is prefilled as a fresh prefill does it
//! (a tile boundary, the same GEMM; kvq-engine's prefix.rs): `cached_tokens` is that point. A
//! chat's reply was decoded one token at a time, through the q8-activation path, so a next
//! turn reusing it equals that sequence continuing, not a from-scratch prefill of the same
//! text (the two matmul paths differ by ~0.5% with or without any caching); that case checks
//! the reuse only (the cache-level tests, `fork_tests.rs`, show the caches continue exactly).

use kvq_cache::methods::vecinfer::calibration::{FixedCalibration, VecInferCalibration};
use kvq_cache::{CacheRegistry, CacheSpec};
use kvq_engine::{Engine, EngineConfig, GenerationEvent, GenerationRequest, SamplingParams};
use kvq_tests::server::Server;
use kvq_tests::{default_gguf, workspace_root};
use std::sync::Arc;

/// What one request gave: its tokens, each token's logprob bits, the cached prompt tokens.
#[derive(Debug, PartialEq)]
struct Run {
    tokens: Vec<u32>,
    logprob_bits: Vec<u32>,
    cached: usize,
}

fn registry(n_layers: usize, n_kv: usize, d: usize) -> CacheRegistry {
    let mut reg = CacheRegistry::builtin();
    // Exactness does not depend on the codebooks' quality: random ones, no calibration run.
    let cal = VecInferCalibration::random(n_layers, n_kv, d, 5);
    reg.set_calibration(Arc::new(FixedCalibration(Arc::new(cal))));
    reg.load_presets(&workspace_root().join("configs/cache"))
        .expect("presets");
    reg
}

fn run(
    rt: &tokio::runtime::Runtime,
    engine: &Engine,
    reg: &CacheRegistry,
    method: &str,
    prompt: &[u32],
    max_tokens: usize,
) -> Run {
    let cache = reg
        .resolve(&CacheSpec {
            method: Some(method.into()),
            bits: None,
        })
        .expect("method");
    let req = GenerationRequest {
        prompt: prompt.to_vec(),
        max_tokens: Some(max_tokens),
        sampling: SamplingParams::greedy(),
        stop: Vec::new(),
        stop_on_eos: false,
        constraint: None,
        logprobs: Some(0),
        cache,
    };
    let mut rx = engine.submit(req).expect("submit");
    rt.block_on(async {
        let mut out = Run {
            tokens: Vec::new(),
            logprob_bits: Vec::new(),
            cached: usize::MAX,
        };
        while let Some(ev) = rx.recv().await {
            match ev {
                GenerationEvent::Delta { token, logprob, .. } => {
                    out.tokens.extend(token);
                    out.logprob_bits
                        .extend(logprob.map(|l| l.logprob.to_bits()));
                }
                GenerationEvent::Finished { usage, .. } => {
                    out.cached = usage.cached_tokens;
                    return out;
                }
                GenerationEvent::Error(e) => panic!("{method}: {e}"),
            }
        }
        panic!("{method}: the stream ended without Finished")
    })
}

/// Ordinary token ids, distinct per `salt`.
fn ids(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 300 + (i * 11 + salt * 97) % 8000)
        .collect()
}

fn cat(parts: &[&[u32]]) -> Vec<u32> {
    parts.concat()
}

/// An engine with the prefix cache, one without (a fresh prefill every time), the registry of
/// presets, a runtime, and every method: fp16 then the presets.
fn setup() -> (
    Engine,
    Engine,
    CacheRegistry,
    tokio::runtime::Runtime,
    Vec<String>,
) {
    let load = || kvq_models::load(&default_gguf(), &mut |_, _| {}).expect("model");
    let warm_model = load();
    let cfg = warm_model.model.config().clone();
    let reg = registry(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim);
    let warm = Engine::start(warm_model, EngineConfig::default());
    let fresh = Engine::start(
        load(),
        EngineConfig {
            prefix_cache: None,
            ..EngineConfig::default()
        },
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut methods = vec!["fp16".to_string()];
    let mut presets: Vec<String> = std::fs::read_dir(workspace_root().join("configs/cache"))
        .expect("presets")
        .filter_map(|e| {
            let p = e.ok()?.path();
            (p.extension()? == "toml").then(|| p.file_stem()?.to_str().map(String::from))?
        })
        .collect();
    presets.sort();
    assert!(presets.len() >= 10, "presets: {presets:?}");
    methods.extend(presets);
    (warm, fresh, reg, rt, methods)
}

#[test]
fn reused_prefixes_give_a_fresh_engines_output_for_every_method() {
    let (warm, fresh, reg, rt, methods) = setup();
    let tail = |salt: u32| ids(40, salt);
    for (m, method) in methods.iter().enumerate() {
        let salt = m as u32 * 5;
        // Turn 1: 208 prompt tokens held (its one generated token is never fed), all exact.
        let a = ids(208, salt);
        let first = run(&rt, &warm, &reg, method, &a, 1);
        assert_eq!(first.cached, 0, "{method}: nothing held yet");
        // The common prefix ends 8 positions before the held state's end, inside every
        // preset's fp16 window: the copy goes back to the tile boundary 192, 16 positions
        // (the entry stays).
        let inside = cat(&[&a[..200], &tail(salt + 1)]);
        // The whole held state, then new tokens: taken whole.
        let whole = cat(&[&a, &tail(salt + 2)]);
        for (what, prompt, cached) in [("inside the window", &inside, 192), ("whole", &whole, 208)]
        {
            let w = run(&rt, &warm, &reg, method, prompt, 16);
            let f = run(&rt, &fresh, &reg, method, prompt, 16);
            assert_eq!(w.cached, cached, "{method}, {what}: cached tokens");
            assert_eq!(
                f.cached, 0,
                "{method}, {what}: the fresh engine holds nothing"
            );
            assert_eq!(w.tokens, f.tokens, "{method}, {what}: tokens");
            assert_eq!(
                w.logprob_bits, f.logprob_bits,
                "{method}, {what}: logprobs differ from a fresh prefill"
            );
        }
        // Before the key center is fixed (4 sinks + 16 rows): 36 held, 16 reused (20 back:
        // every row is kept until the center is fixed).
        let short = ids(36, salt + 3);
        run(&rt, &warm, &reg, method, &short, 1);
        let early = cat(&[&short[..17], &tail(salt + 4)]);
        let w = run(&rt, &warm, &reg, method, &early, 16);
        let f = run(&rt, &fresh, &reg, method, &early, 16);
        assert_eq!(w.cached, 16, "{method}, before the center: cached tokens");
        assert_eq!(
            (w.tokens, w.logprob_bits),
            (f.tokens, f.logprob_bits),
            "{method}, before the center: output differs from a fresh prefill"
        );
        // A chat's next turn: the reply's 79 decoded positions are reused too (past the
        // exact ones by more than EXACT_SLACK), so nothing is prefilled twice.
        let b = ids(208, salt + 5);
        let reply = run(&rt, &warm, &reg, method, &b, 80);
        let next = cat(&[&b, &reply.tokens[..79], &tail(salt + 6)]);
        let w = run(&rt, &warm, &reg, method, &next, 4);
        assert_eq!(w.cached, 287, "{method}, next turn: cached tokens");
    }
    let st = warm.stats();
    assert_eq!(st.prefix_hits, 4 * methods.len() as u64);
    assert!(st.prefix_entries > 0 && st.prefix_bytes > 0);
}

/// Conversations that share only a system prompt: a compressed conversation's caches cannot go
/// back to its end (only REWIND positions past the window are fp16), so the second
/// conversation holds a copy at the shared prefix while it prefills (cut there, its own output
/// unchanged) and the third continues from that copy, exactly as a fresh prefill.
#[test]
fn a_shared_system_prompt_is_reused_for_every_method() {
    let (warm, fresh, reg, rt, methods) = setup();
    for (m, method) in methods.iter().enumerate() {
        let salt = 1000 + m as u32 * 5;
        let system = ids(100, salt);
        let conv = |s: u32| cat(&[&system, &ids(40, salt + s)]);
        let first = run(&rt, &warm, &reg, method, &conv(1), 4);
        assert_eq!(first.cached, 0, "{method}: nothing held yet");
        for (turn, s) in [("second", 2), ("third", 3)] {
            let prompt = conv(s);
            let w = run(&rt, &warm, &reg, method, &prompt, 8);
            let f = run(&rt, &fresh, &reg, method, &prompt, 8);
            assert_eq!(
                (&w.tokens, &w.logprob_bits),
                (&f.tokens, &f.logprob_bits),
                "{method}, {turn} conversation: output differs from a fresh prefill"
            );
            if turn == "third" || method == "fp16" {
                // The tile boundary below 100 whose rest (44 rows) takes the fresh GEMM.
                assert_eq!(w.cached, 96, "{method}, {turn} conversation: cached tokens");
            }
        }
    }
    let st = warm.stats();
    assert!(st.prefix_hits >= methods.len() as u64, "{st:?}");
}

#[test]
fn a_chats_second_turn_reports_cached_tokens_over_http() {
    let model = default_gguf();
    let model = model.to_str().expect("path");
    let presets = workspace_root().join("configs/cache");
    let presets = presets.to_str().expect("path");
    let srv = Server::start(&["--model", model, "--cache-presets", presets]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let client = reqwest::Client::new();
        let url = format!("{}/v1/chat/completions", srv.base);
        let mut messages =
            vec![serde_json::json!({"role": "user", "content": "Name three colors."})];
        let mut cached = Vec::new();
        for turn in 0..2 {
            let body = serde_json::json!({
                "messages": messages, "max_tokens": 12, "temperature": 0,
            });
            let v: serde_json::Value = client
                .post(&url)
                .header("x-kv-cache-method", "turboquant-mse-4bit")
                .json(&body)
                .send()
                .await
                .expect("post")
                .json()
                .await
                .expect("json");
            let reply = v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_else(|| panic!("turn {turn}: {v}"))
                .to_string();
            cached.push(v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64());
            messages.push(serde_json::json!({"role": "assistant", "content": reply}));
            messages.push(serde_json::json!({"role": "user", "content": "And three more?"}));
        }
        assert_eq!(cached[0], Some(0), "{cached:?}");
        assert!(
            cached[1].is_some_and(|c| c >= 16),
            "second turn: {cached:?}"
        );
        let metrics = client
            .get(format!("{}/metrics", srv.base))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("text");
        assert!(
            metrics.contains("kvq_prefix_cache_hits_total 1"),
            "{metrics}"
        );
    });
}
