//! End-to-end test of `kvq eval`: the real binary on the default model scores a short text in
//! two chunks of 64 tokens with fp16 and turboquant-mse, and writes the JSON rows (exactly the
//! documented keys) and the plot.

use kvq_tests::server::kvq_bin;
use kvq_tests::{default_gguf, scratch_dir};
use std::process::Command;

/// Public domain (Dickens, A Tale of Two Cities, 1859): well over 128 tokens.
const TEXT: &str = "It was the best of times, it was the worst of times, it was the age of \
wisdom, it was the age of foolishness, it was the epoch of belief, it was the epoch of \
incredulity, it was the season of Light, it was the season of Darkness, it was the spring of \
hope, it was the winter of despair, we had everything before us, we had nothing before us, we \
were all going direct to Heaven, we were all going direct the other way - in short, the period \
was so far like the present period, that some of its noisiest authorities insisted on its being \
received, for good or for evil, in the superlative degree of comparison only.\n\n\
There were a king with a large jaw and a queen with a plain face, on the throne of England; \
there were a king with a large jaw and a queen with a fair face, on the throne of France. In \
both countries it was clearer than crystal to the lords of the State preserves of loaves and \
fishes, that things in general were settled for ever.\n";

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

#[test]
fn eval_writes_ppl_rows_for_fp16_and_turboquant() {
    let dir = scratch_dir("eval-cli");
    let text = dir.join("text.txt");
    std::fs::write(&text, TEXT).expect("write text");
    let json = dir.join("eval.json");
    let png = dir.join("eval.png");
    let mut cmd = Command::new(kvq_bin());
    cmd.arg("eval")
        .arg("--model")
        .arg(default_gguf())
        .arg("--text")
        .arg(&text)
        .args([
            "--ctx",
            "64",
            "--chunks",
            "2",
            "--methods",
            "turboquant-mse",
        ])
        .arg("--json")
        .arg(&json);
    let plot = std::path::Path::new(FONT).is_file();
    if plot {
        cmd.arg("--plot").arg(&png).arg("--plot-font").arg(FONT);
    }
    let out = cmd.output().expect("run kvq eval");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "kvq eval failed:\n{stdout}\n{stderr}");
    assert!(
        stderr.contains("2 chunks of 64 fed in pieces"),
        "stderr should say what was scored:\n{stderr}"
    );
    assert!(stdout.contains("KLD vs fp16"), "table:\n{stdout}");

    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json written"))
            .expect("valid json");
    let rows = rows.as_array().expect("a JSON list");
    assert_eq!(
        rows.len(),
        2,
        "fp16 (the baseline, always first) and turboquant-mse"
    );
    let mut want = vec![
        "delta_pct",
        "key_bits",
        "kv_bytes_per_token",
        "method",
        "ppl",
        "value_bits",
    ];
    want.sort_unstable();
    for row in rows {
        let mut keys: Vec<&str> = row
            .as_object()
            .expect("an object")
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        assert_eq!(keys, want, "{row}");
    }
    let num = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    let (fp16, tq) = (&rows[0], &rows[1]);
    assert_eq!(fp16["method"], "fp16");
    assert_eq!(tq["method"], "turboquant-mse");
    assert_eq!(num(fp16, "delta_pct"), 0.0);
    let ppl = num(fp16, "ppl");
    // A 135M model on Dickens, second halves of 64-token chunks: far from 1 and from uniform.
    assert!(
        ppl.is_finite() && (2.0..500.0).contains(&ppl),
        "fp16 ppl {ppl}"
    );
    let tq_ppl = num(tq, "ppl");
    assert!(
        tq_ppl.is_finite() && tq_ppl > 1.0,
        "turboquant ppl {tq_ppl}"
    );
    assert!((num(tq, "delta_pct") - (tq_ppl / ppl - 1.0) * 100.0).abs() < 1e-6);
    for r in rows {
        for k in ["key_bits", "value_bits", "kv_bytes_per_token"] {
            assert!(num(r, k) > 0.0, "{k} of {r}");
        }
    }
    // fp16 holds 16 bits per element (here more: its 256-token blocks are amortized over 64).
    assert!(num(fp16, "key_bits") >= 16.0);
    if plot {
        let bytes = std::fs::read(&png).expect("plot written");
        assert!(bytes.starts_with(b"\x89PNG"), "a PNG");
    }
}
