//! API keys on the real `kvq serve` binary: `/v1` routes need `Authorization: Bearer` with a key
//! from `--api-key`, `KVQ_API_KEY` or `--api-key-file` (401 `invalid_api_key` otherwise, in
//! OpenAI's error shape, which the official Python client raises as `AuthenticationError`);
//! `/health` stays open, `/metrics` too unless `--metrics-need-key`; keys never reach the log;
//! listening beyond loopback without a key logs a warning.

use kvq_tests::default_gguf;
use kvq_tests::server::Server;
use std::process::Command;

const FLAG_KEY: &str = "sk-kvq-flag-8c1e";
const FILE_KEY: &str = "sk-kvq-file-27d0";
const ENV_KEY: &str = "sk-kvq-env-5b93";

fn model() -> &'static str {
    let p = Box::leak(Box::new(default_gguf()));
    p.to_str().expect("utf-8 path")
}

/// `GET base + path`, or for `/v1/chat/completions` a 4-token chat completion of `model`
/// (the served id), with `key`: (status, headers, JSON body or Null).
fn call(
    (base, model): (&str, &str),
    path: &str,
    key: Option<&str>,
) -> (u16, reqwest::header::HeaderMap, serde_json::Value) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let client = reqwest::Client::new();
        let url = format!("{base}{path}");
        let mut req = match path {
            "/v1/chat/completions" => client.post(&url).json(&serde_json::json!({
                "model": model,
                "messages": [{"role": "user", "content": "Say hi."}],
                "max_tokens": 4,
                "temperature": 0
            })),
            _ => client.get(&url),
        };
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        let resp = req.send().await.expect("request");
        let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
        let text = resp.text().await.expect("body");
        let body = serde_json::from_str(&text).unwrap_or(serde_json::Value::Null);
        (status, headers, body)
    })
}

fn assert_unauthorized(base: &str, path: &str, key: Option<&str>) {
    let (status, headers, body) = call((base, ""), path, key);
    assert_eq!(status, 401, "{path} with {key:?}: {body}");
    assert_eq!(body["error"]["code"], "invalid_api_key", "{body}");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty())
    );
    assert_eq!(
        headers.get("www-authenticate").map(|v| v.as_bytes()),
        Some(&b"Bearer"[..])
    );
    if let Some(k) = key {
        assert!(!body.to_string().contains(k), "the key is echoed: {body}");
    }
}

#[test]
fn keys_guard_the_api_and_nothing_else() {
    let dir = std::env::temp_dir().join(format!("kvq-auth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("keys.txt");
    std::fs::write(&file, format!("# shared keys\n{FILE_KEY}\n")).expect("key file");
    let server = Server::start_on(
        "127.0.0.1",
        &[
            "--model",
            model(),
            "--api-key-file",
            file.to_str().expect("utf-8"),
        ],
        &[("KVQ_API_KEY", ENV_KEY)],
    );
    let base = &server.base;
    let (_, _, models) = call((base, ""), "/v1/models", Some(ENV_KEY));
    let id = models["data"][0]["id"]
        .as_str()
        .expect("a model id")
        .to_string();
    for path in ["/v1/models", "/v1/chat/completions"] {
        assert_unauthorized(base, path, None);
        assert_unauthorized(base, path, Some("sk-wrong"));
        assert_unauthorized(base, path, Some(&ENV_KEY[..ENV_KEY.len() - 1]));
        for key in [ENV_KEY, FILE_KEY] {
            let (status, _, body) = call((base, &id), path, Some(key));
            assert_eq!(status, 200, "{path}: {body}");
        }
    }
    assert_eq!(call((base, ""), "/health", None).0, 200);
    assert_eq!(
        call((base, ""), "/metrics", None).0,
        200,
        "/metrics is open by default"
    );
    // The official client raises AuthenticationError on a wrong key and works with a right one.
    let script = r#"
import sys, openai
base = sys.argv[1] + "/v1"
try:
    openai.OpenAI(base_url=base, api_key="sk-wrong").models.list()
    print("wrong key accepted")
except openai.AuthenticationError as e:
    print("rejected", e.status_code, e.code)
print("models", [m.id for m in openai.OpenAI(base_url=base, api_key=sys.argv[2]).models.list()])
"#;
    let out = Command::new("python3")
        .args(["-c", script, base, FILE_KEY])
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && stdout.contains("rejected 401 invalid_api_key")
            && stdout.contains("models ["),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let log = server.log.lock().map(|l| l.join("\n")).unwrap_or_default();
    assert!(log.contains("API keys required"), "{log}");
    for key in [ENV_KEY, FILE_KEY, "sk-wrong"] {
        assert!(!log.contains(key), "a key reached the log:\n{log}");
    }
    drop(server);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn metrics_behind_the_key_and_the_open_network_warning() {
    let server = Server::start_on(
        "0.0.0.0",
        &[
            "--model",
            model(),
            "--api-key",
            FLAG_KEY,
            "--metrics-need-key",
        ],
        &[],
    );
    let base = server.base.replace("0.0.0.0", "127.0.0.1");
    assert_unauthorized(&base, "/metrics", None);
    assert_eq!(call((&base, ""), "/metrics", Some(FLAG_KEY)).0, 200);
    assert_eq!(call((&base, ""), "/health", None).0, 200);
    let log = server.log.lock().map(|l| l.join("\n")).unwrap_or_default();
    assert!(!log.contains("without an API key"), "{log}");
    assert!(!log.contains(FLAG_KEY), "{log}");
    drop(server);
    // The same address without a key: open to the network, said so.
    let open = Server::start_on("0.0.0.0", &["--model", model()], &[]);
    let base = open.base.replace("0.0.0.0", "127.0.0.1");
    assert_eq!(call((&base, ""), "/v1/models", None).0, 200);
    let log = open.log.lock().map(|l| l.join("\n")).unwrap_or_default();
    assert!(log.contains("without an API key"), "{log}");
}
