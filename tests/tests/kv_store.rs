//! `kvq serve --kv-store` with the real binary and SmolLM2: a server stopped with SIGTERM saves
//! its held prefixes (fp16 and a compressed preset, the latter as codes); a server started on
//! the same directory answers the conversation's next turn with `cached_tokens` > 0 and exactly
//! what a server that never stopped answers (the same text and logprobs). Files another model
//! made, and ones damaged on disk, are skipped with a log line and the request is still served.

use kvq_tests::server::Server;
use kvq_tests::{default_gguf, scratch_dir, workspace_root};
use serde_json::{Value, json};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const METHODS: [&str; 2] = ["fp16", "turboquant-mse-4bit"];

fn start(store: Option<&Path>) -> Server {
    let model = default_gguf();
    let presets = workspace_root().join("configs/cache");
    let mut args = vec![
        "--model".to_string(),
        model.display().to_string(),
        "--cache-presets".into(),
        presets.display().to_string(),
    ];
    if let Some(d) = store {
        args.extend(["--kv-store".into(), d.display().to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Server::start(&args)
}

/// SIGTERM, then waits for a clean exit.
fn stop(mut srv: Server) -> String {
    let killed = Command::new("kill")
        .args(["-TERM", &srv.pid().to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let status = srv.wait_exit(Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}: {}",
        srv.log_text()
    );
    srv.log_text()
}

/// The first turn: a passage long enough that prefilling it again is most of a turn's work.
fn first_turn() -> Vec<Value> {
    let passage = "The river rose in the spring and the town moved its market to the hill. \
                   Every year the farmers argued about the bridge, and every year it stood. "
        .repeat(12);
    vec![json!({"role": "user", "content": format!("{passage}\nWhat moved to the hill?")})]
}

/// Posts a greedy chat; returns (reply, logprobs, cached tokens).
fn chat(base: &str, method: &str, messages: &[Value]) -> (String, Value, u64) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let body = json!({
            "messages": messages, "max_tokens": 16, "temperature": 0, "logprobs": true,
        });
        let v: Value = reqwest::Client::new()
            .post(format!("{base}/v1/chat/completions"))
            .header("x-kv-cache-method", method)
            .json(&body)
            .send()
            .await
            .expect("post")
            .json()
            .await
            .expect("json");
        let reply = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_else(|| panic!("{method}: {v}"))
            .to_string();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or_else(|| panic!("{method}: no cached_tokens in {v}"));
        (reply, v["choices"][0]["logprobs"].clone(), cached)
    })
}

fn second_turn(reply: &str) -> Vec<Value> {
    let mut m = first_turn();
    m.push(json!({"role": "assistant", "content": reply}));
    m.push(json!({"role": "user", "content": "And what did the farmers argue about?"}));
    m
}

fn metrics(base: &str) -> String {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        reqwest::get(format!("{base}/metrics"))
            .await
            .expect("metrics")
            .text()
            .await
            .expect("text")
    })
}

/// The prefix files in `dir`: (tensor files, metadata files).
fn files(dir: &Path) -> (Vec<std::path::PathBuf>, Vec<std::path::PathBuf>) {
    let mut st = Vec::new();
    let mut js = Vec::new();
    for e in std::fs::read_dir(dir).expect("dir").flatten() {
        let p = e.path();
        match p.extension().and_then(|x| x.to_str()) {
            Some("safetensors") => st.push(p),
            Some("json") => js.push(p),
            _ => {}
        }
    }
    (st, js)
}

#[test]
fn a_restarted_server_continues_a_conversation_warm_and_exactly() {
    let dir = scratch_dir("kv-store-restart");
    // Never stopped: the reference for both turns.
    let warm = start(None);
    let mut expect = Vec::new();
    for m in METHODS {
        let (reply, _, cached) = chat(&warm.base, m, &first_turn());
        assert_eq!(cached, 0, "{m}");
        let (reply2, lp2, cached2) = chat(&warm.base, m, &second_turn(&reply));
        assert!(cached2 > 200, "{m}: warm second turn reused {cached2}");
        expect.push((reply, reply2, lp2, cached2));
    }
    drop(warm);

    let first = start(Some(&dir));
    for (m, (reply, ..)) in METHODS.iter().zip(&expect) {
        let (r, _, _) = chat(&first.base, m, &first_turn());
        assert_eq!(&r, reply, "{m}: first turn");
    }
    let log = stop(first);
    assert!(log.contains("kvq kv store: saved 2 held prefixes"), "{log}");
    let (st, js) = files(&dir);
    assert_eq!((st.len(), js.len()), (2, 2), "{st:?} {js:?}");

    let again = start(Some(&dir));
    assert!(
        again.log_text().contains("holds 2 prefixes"),
        "{}",
        again.log_text()
    );
    for (m, (reply, reply2, lp2, cached2)) in METHODS.iter().zip(&expect) {
        let (r, lp, cached) = chat(&again.base, m, &second_turn(reply));
        assert_eq!(
            cached, *cached2,
            "{m}: restored as much as a warm server reuses"
        );
        assert_eq!(
            &r, reply2,
            "{m}: the same reply as a server that never stopped"
        );
        assert_eq!(&lp, lp2, "{m}: the same logprobs, bit for bit");
    }
    let text = metrics(&again.base);
    assert!(text.contains("kvq_kv_store_restored_total 2"), "{text}");
    drop(again);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn damaged_or_foreign_files_are_skipped_and_requests_still_answer() {
    let dir = scratch_dir("kv-store-damaged");
    let first = start(Some(&dir));
    let mut replies = Vec::new();
    for m in METHODS {
        replies.push(chat(&first.base, m, &first_turn()).0);
    }
    stop(first);
    let (st, js) = files(&dir);
    assert_eq!(js.len(), 2);
    // One file's tensors changed on disk, the other's metadata claims another model.
    let fp16 = js
        .iter()
        .position(|p| std::fs::read_to_string(p).is_ok_and(|t| t.contains("\"fp16/")))
        .expect("the fp16 prefix");
    let tensors = js[fp16].with_extension("safetensors");
    assert!(st.contains(&tensors));
    let mut bytes = std::fs::read(&tensors).expect("read");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    std::fs::write(&tensors, bytes).expect("write");
    let other = &js[1 - fp16];
    let mut meta: Value =
        serde_json::from_slice(&std::fs::read(other).expect("read")).expect("json");
    meta["model_hash"] = json!("0".repeat(64));
    std::fs::write(other, serde_json::to_vec(&meta).expect("json")).expect("write");

    let srv = start(Some(&dir));
    for (m, reply) in METHODS.iter().zip(&replies) {
        let (r, _, cached) = chat(&srv.base, m, &second_turn(reply));
        assert_eq!(cached, 0, "{m}: nothing trusted");
        assert!(!r.is_empty(), "{m}");
    }
    let log = srv.log_text();
    assert!(log.contains("made by another model"), "{log}");
    assert!(log.contains("corrupted"), "{log}");
    assert!(!tensors.exists(), "the damaged prefix is removed");
    assert!(other.exists(), "another model's file is left alone");
    drop(srv);
    let _ = std::fs::remove_dir_all(&dir);
}
