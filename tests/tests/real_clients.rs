//! Real clients against the real `kvq serve` binary: the official `openai` Python package
//! (chat streaming and not, the cache-method header, error cases), `curl -N` checking the raw
//! SSE lines, and `kvq generate` on the command line.

use kvq_tests::server::{Server, kvq_bin};
use kvq_tests::{default_gguf, golden, workspace_root};
use std::process::Command;

#[test]
fn openai_python_client_and_curl() {
    let server = Server::start(&["--model", default_gguf().to_str().expect("utf-8 path")]);
    let script = workspace_root().join("tests/clients/openai_client.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(&server.base)
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("No module named 'openai'"),
        "the openai package is missing: scripts/test installs it (pip install openai)"
    );
    assert!(
        out.status.success() && stdout.contains(" passed, 0 failed"),
        "openai client checks failed:\n{stdout}\n{stderr}"
    );
    let curl = workspace_root().join("tests/clients/curl_sse.sh");
    let out = Command::new("bash")
        .arg(&curl)
        .arg(&server.base)
        .output()
        .expect("bash runs");
    assert!(
        out.status.success(),
        "curl SSE check failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn generate_streams_the_golden_completion_to_stdout() {
    let case = &golden()["cases"][1];
    let lp = std::env::temp_dir().join(format!("kvq-logprobs-{}.jsonl", std::process::id()));
    let out = Command::new(kvq_bin())
        .args(["generate", "--model"])
        .arg(default_gguf())
        .args(["--prompt", case["prompt"].as_str().expect("prompt")])
        .args(["--max-tokens", "20", "--kv-cache-method", "f32"])
        .arg("--logprobs-out")
        .arg(&lp)
        .args(["--top-logprobs", "3"])
        .output()
        .expect("kvq generate runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.trim_end_matches('\n'),
        case["greedy_text"].as_str().expect("text")
    );
    // One line per generated token; greedy picks the most likely, alternatives in order.
    let written = std::fs::read_to_string(&lp).expect("logprobs file");
    let _ = std::fs::remove_file(&lp);
    let lines: Vec<serde_json::Value> = written
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    assert_eq!(lines.len(), 20);
    let mut text = String::new();
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["i"], i);
        let top = l["top"].as_array().expect("top");
        assert_eq!(top.len(), 3, "{l}");
        assert_eq!(top[0]["id"], l["id"], "greedy takes the top token: {l}");
        let lps: Vec<f64> = top
            .iter()
            .map(|t| t["logprob"].as_f64().expect("lp"))
            .collect();
        assert!(lps.windows(2).all(|w| w[0] >= w[1]) && lps[0] <= 0.0, "{l}");
        text.push_str(l["token"].as_str().expect("token"));
    }
    assert_eq!(text, case["greedy_text"].as_str().expect("text"));
}

#[test]
fn generate_with_an_unknown_method_fails_cleanly() {
    let out = Command::new(kvq_bin())
        .args(["generate", "--model"])
        .arg(default_gguf())
        .args(["--prompt", "hi", "--kv-cache-method", "nope"])
        .output()
        .expect("kvq generate runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("fp16"),
        "error should list valid methods: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn every_cache_method_and_preset_streams_through_the_openai_client() {
    let presets = workspace_root().join("configs/cache");
    let server = Server::start(&[
        "--model",
        default_gguf().to_str().expect("utf-8 path"),
        "--cache-presets",
        presets.to_str().expect("utf-8 path"),
    ]);
    let methods = [
        "fp16",
        "turboquant-mse",
        "turboquant-prod",
        "turboquant-rvq",
        "qjl",
        "vecinfer",
        "turboquant-mse-4bit",
        "turboquant-mse-3bit",
        "turboquant-prod-4bit",
        "turboquant-prod-3bit",
        "turboquant-rvq-4bit",
        "turboquant-rvq-2bit",
        "qjl-4bit",
        "qjl-3bit",
        "vecinfer-2bit",
        "vecinfer-1bit",
    ];
    let out = Command::new("python3")
        .arg(workspace_root().join("tests/clients/openai_methods.py"))
        .arg(&server.base)
        .args(methods)
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains(" passed, 0 failed"),
        "openai method checks failed:\n{stdout}\n{stderr}"
    );
    // Every check ran: one stream per method, the size comparison, the concurrent run.
    assert!(
        stdout.contains(&format!("{} passed, 0 failed", methods.len() + 2)),
        "{stdout}"
    );
}
