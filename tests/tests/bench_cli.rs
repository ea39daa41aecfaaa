//! End-to-end test of `kvq bench --sequences 2 --shared-prompt`: the real binary on the default
//! model prefills one sequence, copies its caches to the second, and decodes both; the caches
//! it reports hold what two prefilled sequences hold, for fp16 and a compressed method.

use kvq_tests::server::kvq_bin;
use kvq_tests::{default_gguf, scratch_dir};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

fn bench(json: &Path, shared: bool) -> Vec<Value> {
    let mut cmd = Command::new(kvq_bin());
    cmd.arg("bench")
        .arg("--model")
        .arg(default_gguf())
        .args(["--device", "cpu", "--methods", "fp16,turboquant-mse"])
        .args(["--ctx", "80", "--gen-tokens", "4", "--sequences", "2"])
        .args(["--repeats", "1", "--no-warmup", "--no-isolate"])
        .arg("--json")
        .arg(json);
    if shared {
        cmd.arg("--shared-prompt");
    }
    let out = cmd.output().expect("run kvq bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "kvq bench failed:\n{stdout}\n{stderr}"
    );
    if shared {
        assert!(stdout.contains("fp16 x2 shared"), "table:\n{stdout}");
    }
    let text = std::fs::read_to_string(json).expect("json written");
    serde_json::from_str::<Vec<Value>>(&text).expect("json rows")
}

#[test]
fn shared_prompt_caches_hold_what_prefilled_ones_do() {
    let dir = scratch_dir("bench-cli");
    let shared = bench(&dir.join("shared.json"), true);
    let each = bench(&dir.join("each.json"), false);
    assert_eq!(shared.len(), 2);
    for (s, e) in shared.iter().zip(&each) {
        let method = s["method"].as_str().expect("method");
        assert_eq!(s["method"], e["method"]);
        assert_eq!(s["shared_prompt"], Value::Bool(true), "{method}");
        assert_eq!(e["shared_prompt"], Value::Bool(false), "{method}");
        assert_eq!(s["sequences"], 2, "{method}");
        // Both sequences hold the prompt and the generated tokens.
        assert_eq!(s["kv_tokens"], 2 * (80 + 4), "{method}");
        let (sb, eb) = (
            s["kv_resident_bytes"].as_f64().expect("bytes"),
            e["kv_resident_bytes"].as_f64().expect("bytes"),
        );
        // A copy holds its rows without the original's spare capacity, never more.
        assert!(
            sb > 0.8 * eb && sb <= eb,
            "{method}: shared {sb} bytes, prefilled {eb}"
        );
        assert!(
            s["tg_tps"]["median"].as_f64().expect("tg") > 0.0,
            "{method}"
        );
    }
}
