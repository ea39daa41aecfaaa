//! `--model org/repo` end to end, with the real `kvq` binary against a fake Hugging Face Hub on
//! loopback (`HF_ENDPOINT`) and a fresh hub cache (`HF_HOME`): a GGUF picked by `:QUANT` from a
//! repo of several, downloaded through a cut connection (resumed) and served; the same id
//! served again with `HF_HUB_OFFLINE=1` without one connection, and with the Hub gone; a split
//! GGUF whose download is killed halfway and resumed by the next run; a gated, sharded
//! safetensors checkpoint that needs `HF_TOKEN`; and the documented errors.

use kvq_tests::fake_hub::{FakeHub, Fault, HubFile, HubRepo, Tripwire};
use kvq_tests::hub_fixtures::{repo_of_dir, split_gguf, tiny_checkpoint};
use kvq_tests::server::{Run, Server, run_kvq};
use kvq_tests::{default_gguf, golden, scratch_dir};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const Q4_1: &str = "SmolLM2-135M-Instruct-Q4_1.gguf";

/// The environment of a kvq run against `endpoint` with the cache under `home`.
fn env<'a>(home: &'a Path, endpoint: &'a str) -> Vec<(&'a str, Option<&'a str>)> {
    let mut e: Vec<(&str, Option<&str>)> = [
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_TOKEN_PATH",
        "HF_HUB_OFFLINE",
    ]
    .map(|k| (k, None))
    .to_vec();
    e.push(("HF_HOME", Some(home.to_str().expect("utf-8 path"))));
    e.push(("HF_ENDPOINT", Some(endpoint)));
    e
}

fn with<'a>(
    mut e: Vec<(&'a str, Option<&'a str>)>,
    k: &'a str,
    v: &'a str,
) -> Vec<(&'a str, Option<&'a str>)> {
    e.retain(|(name, _)| *name != k);
    e.push((k, Some(v)));
    e
}

fn block<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(f)
}

fn get(url: &str) -> (u16, Value) {
    block(async {
        let r = reqwest::get(url).await.expect("GET");
        (r.status().as_u16(), r.json().await.expect("json"))
    })
}

fn post(url: &str, body: &Value) -> (u16, Value) {
    block(async {
        let r = reqwest::Client::new()
            .post(url)
            .header("x-kv-cache-method", "f32")
            .json(body)
            .send()
            .await
            .expect("POST");
        (r.status().as_u16(), r.json().await.expect("json"))
    })
}

/// `/v1/models` lists `id`, and a chat request naming it is answered.
fn lists_and_chats(server: &Server, id: &str) {
    let (status, models) = get(&format!("{}/v1/models", server.base));
    assert_eq!(status, 200, "{models}");
    assert_eq!(models["data"][0]["id"], id, "{models}");
    let body = json!({"model": id, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]});
    let (status, chat) = post(&format!("{}/v1/chat/completions", server.base), &body);
    assert_eq!(status, 200, "{chat}");
    assert_eq!(chat["model"], id);
    assert!(
        chat["usage"]["completion_tokens"].as_u64() > Some(0),
        "{chat}"
    );
}

/// The golden greedy completion, so the downloaded weights are the real ones, bit for bit.
fn answers_golden(server: &Server) {
    let case = &golden()["cases"][0];
    let body = json!({"prompt": case["prompt"], "temperature": 0, "max_tokens": 50});
    let (status, v) = post(&format!("{}/v1/completions", server.base), &body);
    assert_eq!(status, 200, "{v}");
    let want = case["greedy_text"].as_str().expect("text");
    assert_eq!(v["choices"][0]["text"], want.trim_end_matches("<|im_end|>"));
}

fn repo_dir(home: &Path, repo: &str) -> PathBuf {
    home.join("hub")
        .join(format!("models--{}", repo.replace('/', "--")))
}

/// Waits until `cond` holds (true) or `secs` pass (false).
fn wait_for(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < until {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[test]
fn a_gguf_by_quant_downloads_through_a_cut_then_serves_offline_and_without_the_hub() {
    let started = Instant::now();
    let gguf = std::fs::read(default_gguf()).expect("read the model");
    let len = gguf.len() as u64;
    let repo = "kvq-test/SmolLM2-135M-Instruct-GGUF";
    let q8 = "SmolLM2-135M-Instruct-Q8_0.gguf";
    let file = |path: &str, data: Vec<u8>, lfs| HubFile {
        path: path.into(),
        data: data.into(),
        lfs,
    };
    let hub = FakeHub::start(vec![HubRepo {
        id: repo.into(),
        commit: COMMIT.into(),
        files: vec![
            file("README.md", b"# SmolLM2 GGUF\n".to_vec(), false),
            file(Q4_1, gguf, true),
            // Listed to be chosen against; never to be fetched.
            file(q8, vec![0u8; 4096], true),
        ],
        token: None,
    }]);
    hub.fault(Fault::Cut {
        file: Q4_1.into(),
        at: len / 2,
        times: 1,
    });
    let home = scratch_dir("hub-gguf");
    let given = format!("{repo}:q4_1");
    let server = Server::start_with(&["--model", &given], &env(&home, &hub.endpoint));
    lists_and_chats(&server, &given);
    answers_golden(&server);
    let log = server.log_text();
    assert!(
        log.contains("interrupted") && log.contains("resuming"),
        "{log}"
    );
    // The second try went on from what the first had finished, not from byte 0.
    let served = hub.served(Q4_1);
    let cut = served
        .iter()
        .position(|s| s.start <= len / 2 && len / 2 <= s.end)
        .expect("the cut transfer");
    let after = &served[cut + 1..];
    assert!(after.iter().all(|s| s.start > 0), "{served:?}");
    assert!(after.iter().any(|s| s.start <= len / 2), "{served:?}");
    assert!(
        hub.bytes_sent(Q4_1) < len + len / 4,
        "{}",
        hub.bytes_sent(Q4_1)
    );
    assert!(
        hub.served(q8).is_empty(),
        "the other quantization was fetched"
    );
    // The hub cache's layout, as huggingface_hub writes and reads it.
    let dir = repo_dir(&home, repo);
    let read = |p: PathBuf| std::fs::read_to_string(p).expect("read");
    assert_eq!(read(dir.join("refs/main")), COMMIT);
    assert!(!dir.join("refs").join(COMMIT).exists());
    let pointer = dir.join("snapshots").join(COMMIT).join(Q4_1);
    let sha = hub.sha256(repo, Q4_1).expect("sha");
    let target = std::fs::read_link(&pointer).expect("a link");
    assert_eq!(target, Path::new("../../blobs").join(&sha));
    assert_eq!(std::fs::metadata(&pointer).expect("blob").len(), len);
    let leftovers: Vec<_> = std::fs::read_dir(dir.join("blobs"))
        .expect("blobs")
        .filter_map(|e| e.ok().map(|e| e.file_name()))
        .collect();
    assert_eq!(leftovers, [std::ffi::OsString::from(&sha)]);
    drop(server);
    drop(hub);

    // Offline: the same id from the cache, and not one connection anywhere.
    let wire = Tripwire::start();
    let offline = with(env(&home, &wire.endpoint), "HF_HUB_OFFLINE", "1");
    let server = Server::start_with(&["--model", &given], &offline);
    lists_and_chats(&server, &given);
    drop(server);
    assert_eq!(wire.connections(), 0);
    // Without HF_HUB_OFFLINE, a Hub that does not answer leaves the cache to stand in.
    let gone = wire.endpoint.clone();
    drop(wire);
    let server = Server::start_with(&["--model", &given], &env(&home, &gone));
    assert!(
        server.log_text().contains("from the hub cache"),
        "{}",
        server.log_text()
    );
    lists_and_chats(&server, &given);
    drop(server);
    let _ = std::fs::remove_dir_all(&home);
    eprintln!("gguf hub test: {:.1} s", started.elapsed().as_secs_f64());
}

#[test]
fn a_split_gguf_download_killed_halfway_resumes_in_the_next_run() {
    let started = Instant::now();
    let parts_dir = scratch_dir("hub-split-src");
    let parts = split_gguf(&default_gguf(), &parts_dir, "SmolLM2-135M-Instruct-Q4_1");
    let repo = "kvq-test/SmolLM2-135M-Instruct-split-GGUF";
    let hub = FakeHub::start(vec![repo_of_dir(repo, COMMIT, &parts_dir, None)]);
    let first = parts[0]
        .file_name()
        .expect("name")
        .to_string_lossy()
        .into_owned();
    let first_len = std::fs::metadata(&parts[0]).expect("part").len();
    let at = first_len * 3 / 5;
    hub.fault(Fault::Stall {
        file: first.clone(),
        at,
    });
    let home = scratch_dir("hub-split");
    let e = env(&home, &hub.endpoint);
    let mut killed = Server::spawn_with(&["--model", repo], &e);
    let stalled = wait_for(120, || hub.bytes_sent(&first) >= at);
    assert!(
        stalled,
        "the download never reached the stall: {}",
        killed.log_text()
    );
    assert!(!killed.wait_listening(Duration::from_millis(300)));
    drop(killed);
    hub.clear_faults();
    let before = hub.served(&first).len();
    let server = Server::start_with(&["--model", repo], &e);
    let resumed = &hub.served(&first)[before];
    assert!(
        resumed.start > 0 && resumed.start <= at,
        "the next run began at byte {} of {first_len}",
        resumed.start
    );
    lists_and_chats(&server, repo);
    answers_golden(&server);
    let snapshot = repo_dir(&home, repo).join("snapshots").join(COMMIT);
    for p in &parts {
        let name = p.file_name().expect("name");
        let want = std::fs::metadata(p).expect("part").len();
        assert_eq!(
            std::fs::metadata(snapshot.join(name)).expect("part").len(),
            want
        );
    }
    drop(server);
    let _ = std::fs::remove_dir_all(&home);
    let _ = std::fs::remove_dir_all(&parts_dir);
    eprintln!("split hub test: {:.1} s", started.elapsed().as_secs_f64());
}

/// `kvq generate` of 6 greedy tokens from `model`.
fn generate(model: &str, env: &[(&str, Option<&str>)]) -> Run {
    let args = [
        "generate",
        "--model",
        model,
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "6",
        "--kv-cache-method",
        "f32",
    ];
    run_kvq(&args, env, Duration::from_secs(120))
}

fn fails_with(run: &Run, texts: &[&str]) {
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    for t in texts {
        assert!(run.stderr.contains(t), "missing '{t}' in:\n{}", run.stderr);
    }
}

/// The tiny checkpoint's directory, written once per test binary.
fn tiny_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = scratch_dir("hub-tiny-src");
        tiny_checkpoint(&dir, &default_gguf());
        dir
    })
}

#[test]
fn a_gated_sharded_checkpoint_needs_its_token_and_bad_ids_say_why() {
    let started = Instant::now();
    let dir = tiny_dir();
    let (gated, corrupt) = ("kvq-test/tiny-llama", "kvq-test/tiny-llama-broken");
    let shard = "model-00001-of-00002.safetensors";
    let quants = HubRepo {
        id: "kvq-test/many-quants-GGUF".into(),
        commit: COMMIT.into(),
        files: ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-Q8_0.gguf"]
            .map(|p| HubFile {
                path: p.into(),
                data: vec![0u8; 64].into(),
                lfs: true,
            })
            .into(),
        token: None,
    };
    let hub = FakeHub::start(vec![
        repo_of_dir(gated, COMMIT, dir, Some("hf_kvq_test")),
        repo_of_dir(corrupt, COMMIT, dir, None),
        quants,
    ]);
    hub.fault(Fault::Corrupt {
        file: shard.into(),
        at: 1000,
    });
    let home = scratch_dir("hub-tiny");
    let e = env(&home, &hub.endpoint);

    let denied = generate(gated, &e);
    fails_with(
        &denied,
        &["kvq-test/tiny-llama: access denied (HTTP 401", "HF_TOKEN"],
    );
    let missing = generate("kvq-test/no-such-model", &e);
    fails_with(
        &missing,
        &[
            "kvq-test/no-such-model: no such model repository",
            "HF_TOKEN",
        ],
    );
    let broken = generate(corrupt, &e);
    fails_with(&broken, &[&format!("{shard} is corrupt: its sha256 is")]);
    let snapshot = repo_dir(&home, corrupt).join("snapshots").join(COMMIT);
    assert!(!snapshot.join(shard).exists(), "the corrupt file stays");
    let several = generate("kvq-test/many-quants-GGUF:q4_k", &e);
    fails_with(
        &several,
        &["':q4_k' matches several GGUF files", "m-Q4_K_M.gguf"],
    );
    let none = generate("kvq-test/many-quants-GGUF:Q2_K", &e);
    fails_with(&none, &["its quantizations are: Q4_K_M, Q4_K_S, Q8_0"]);
    let offline = with(e.clone(), "HF_HUB_OFFLINE", "1");
    let uncached = generate("kvq-test/many-quants-GGUF", &offline);
    fails_with(
        &uncached,
        &["HF_HUB_OFFLINE is set", "is not in the hub cache"],
    );
    assert!(hub.served("m-Q4_K_M.gguf").is_empty());
    hub.clear_faults();

    let local = generate(dir.to_str().expect("utf-8"), &e);
    assert_eq!(local.code, Some(0), "{}", local.stderr);
    assert!(!local.stdout.trim().is_empty());
    let token = with(e.clone(), "HF_TOKEN", "hf_kvq_test");
    let hubbed = generate(gated, &token);
    assert_eq!(hubbed.code, Some(0), "{}", hubbed.stderr);
    assert_eq!(
        hubbed.stdout, local.stdout,
        "the checkpoint came through unchanged"
    );
    // Pinned to its commit, from the cache, without the Hub.
    let requests = hub.requests();
    let pinned = generate(
        &format!("{gated}@{COMMIT}"),
        &with(offline, "HF_TOKEN", "x"),
    );
    assert_eq!(pinned.code, Some(0), "{}", pinned.stderr);
    assert_eq!(pinned.stdout, local.stdout);
    assert_eq!(hub.requests(), requests);
    eprintln!(
        "checkpoint hub test: {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// `tests/clients/hf_cache.py MODE REPO FILES...` (the official huggingface_hub package) with
/// `env`; its stdout, one `sha256 path` line per file.
fn hf_cache_py(mode: &str, repo: &str, files: &[String], env: &[(&str, Option<&str>)]) -> String {
    let script = kvq_tests::workspace_root().join("tests/clients/hf_cache.py");
    let mut cmd = Command::new("python3");
    cmd.arg(script).args([mode, repo]).args(files);
    for (k, v) in env {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    let out = cmd.output().expect("python3 runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        !stderr.contains("No module named 'huggingface_hub'"),
        "the huggingface_hub package is missing: scripts/test installs it"
    );
    assert!(
        out.status.success(),
        "hf_cache.py {mode} {repo}:\n{stdout}\n{stderr}"
    );
    stdout
}

#[test]
fn kvq_and_the_python_huggingface_hub_read_each_others_downloads() {
    let started = Instant::now();
    let dir = tiny_dir();
    let (theirs, ours) = ("kvq-test/fetched-by-python", "kvq-test/fetched-by-kvq");
    let hub = FakeHub::start(vec![
        repo_of_dir(theirs, COMMIT, dir, None),
        repo_of_dir(ours, COMMIT, dir, None),
    ]);
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .expect("fixture")
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect();
    files.sort();
    let home = scratch_dir("hub-python");
    let e = env(&home, &hub.endpoint);
    let fetched = hf_cache_py("fetch", theirs, &files, &e);
    let local = generate(dir.to_str().expect("utf-8"), &e);
    assert_eq!(local.code, Some(0), "{}", local.stderr);
    let offline = with(e.clone(), "HF_HUB_OFFLINE", "1");
    let requests = hub.requests();
    let from_theirs = generate(theirs, &offline);
    assert_eq!(from_theirs.code, Some(0), "{}", from_theirs.stderr);
    assert_eq!(from_theirs.stdout, local.stdout);
    assert_eq!(hub.requests(), requests, "offline, kvq asked the Hub");
    let from_ours = generate(ours, &e);
    assert_eq!(from_ours.code, Some(0), "{}", from_ours.stderr);
    assert_eq!(from_ours.stdout, local.stdout);
    let found = hf_cache_py("find", ours, &files, &offline);
    let sums = |text: &str| -> Vec<String> {
        text.lines()
            .filter_map(|l| l.split_whitespace().next().map(String::from))
            .collect()
    };
    assert_eq!(sums(&found), sums(&fetched));
    assert_eq!(sums(&found).len(), files.len());
    let _ = std::fs::remove_dir_all(&home);
    eprintln!(
        "python interop hub test: {:.1} s",
        started.elapsed().as_secs_f64()
    );
}
