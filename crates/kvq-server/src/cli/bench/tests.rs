//! Tests of `kvq bench`: stats, merging runs, llama-bench parsing, the ratios to fp16, the table,
//! the JSON rows old and new, the isolation options, the charts, and the real binary end to end.

use super::llama::LlamaBench;
use super::rows::{derive, merge_runs};
use super::table::render_table;
use super::*;
use clap::Parser;

fn row(n: usize, threads: usize, pp: &[f64], tg: &[f64]) -> BenchRow {
    BenchRow {
        engine: "kvq".into(),
        model: "m".into(),
        method: "fp16".into(),
        bits: 16,
        prompt_tokens: n,
        gen_tokens: 128,
        threads,
        sequences: 1,
        shared_prompt: false,
        device: "cpu".into(),
        prefill_chunk: 512,
        pp_tps: Stats::new(pp.to_vec()).unwrap(),
        tg_tps: Stats::new(tg.to_vec()).unwrap(),
        tg_vs_fp16: None,
        kv_resident_bytes: 10,
        kv_tokens: 0,
        kv_bytes_per_token: 0.0,
        kv_vs_fp16: None,
        rss_loaded_bytes: Some(5),
        rss_end_bytes: Some(15),
        peak_rss_bytes: Some(20),
        device_used_bytes: None,
        isolated: true,
        measure_s: 1.0,
        child_wall_s: None,
        llama_cpp: None,
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvq-bench-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `kvq bench ARGS` parsed as the binary would.
fn parse(args: &[&str]) -> BenchArgs {
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }
    Cli::parse_from(std::iter::once("bench").chain(args.iter().copied())).bench
}

#[test]
fn stats_median_min_max() {
    let s = Stats::new(vec![3.0, 1.0, 2.0, f64::NAN]).unwrap();
    assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
    assert_eq!(Stats::new(vec![4.0, 1.0]).unwrap().median, 2.5);
    assert!(Stats::new(vec![]).is_none());
}

#[test]
fn merges_runs_and_compares_with_llama_bench() {
    let dir = scratch("merge");
    let a = dir.join("a.json");
    let b = dir.join("b.json");
    std::fs::write(
        &a,
        serde_json::to_string(&[row(128, 2, &[10.0], &[5.0])]).unwrap(),
    )
    .unwrap();
    let mut later = row(128, 2, &[30.0], &[7.0]);
    later.peak_rss_bytes = Some(25);
    later.isolated = false;
    std::fs::write(&b, serde_json::to_string(&[later]).unwrap()).unwrap();
    let rows = merge_runs(&[a, b]).unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].pp_tps.median, 20.0);
    assert_eq!(rows[0].tg_tps.samples, vec![5.0, 7.0]);
    assert_eq!(rows[0].peak_rss_bytes, Some(25));
    assert!(!rows[0].isolated);

    let ll = dir.join("llama.json");
    std::fs::write(
        &ll,
        r#"[
          {"n_prompt": 128, "n_gen": 0, "n_depth": 0, "n_threads": 2, "samples_ts": [40.0]},
          {"n_prompt": 0, "n_gen": 128, "n_depth": 0, "n_threads": 2, "samples_ts": [12.0]},
          {"n_prompt": 0, "n_gen": 128, "n_depth": 128, "n_threads": 2, "samples_ts": [10.0]},
          {"n_prompt": 128, "n_gen": 0, "n_depth": 0, "n_threads": 1, "samples_ts": [99.0]}
        ]"#,
    )
    .unwrap();
    let l = LlamaBench::read(std::slice::from_ref(&ll))
        .unwrap()
        .compare(&rows[0])
        .unwrap();
    assert_eq!(l.cache_type, "f16");
    assert_eq!((l.peak_rss_bytes, l.rss_ratio), (None, None));
    assert_eq!(l.pp_tps.as_ref().unwrap().median, 40.0);
    assert_eq!(l.pp_ratio, Some(0.5));
    assert_eq!((l.tg_depth, l.tg_ratio), (128, Some(0.6)));
    assert_eq!(l.tg_tps_depth0.as_ref().unwrap().median, 12.0);
    let table = render_table(&[BenchRow {
        llama_cpp: Some(l),
        ..rows[0].clone()
    }]);
    assert!(
        table.contains("0.50×") && table.contains("@ d128"),
        "{table}"
    );
    assert!(table.contains("accumulate"), "not isolated:\n{table}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Compressed rows meet llama.cpp's q4_0 tests, fp16 rows its f16 ones; a `.maxrss` file beside
/// an output gives its process's peak RSS, and a row with no test of its type gets nothing.
#[test]
fn compares_each_method_with_its_cache_type_and_peak_rss() {
    let dir = scratch("types");
    let f16 = dir.join("f16-d2048.json");
    let q4 = dir.join("q4-d2048.json");
    let test = |t: &str, ts: f64| {
        format!(
            r#"{{"n_prompt": 0, "n_gen": 64, "n_depth": 2048, "n_threads": 2, "type_k": "{t}",
                "type_v": "{t}", "samples_ts": [{ts}]}}"#
        )
    };
    std::fs::write(&f16, format!("[{}]", test("f16", 50.0))).unwrap();
    std::fs::write(dir.join("f16-d2048.json.maxrss"), "204800\n").unwrap();
    std::fs::write(&q4, format!("[{}]", test("q4_0", 40.0))).unwrap();
    std::fs::write(dir.join("q4-d2048.json.maxrss"), "102400").unwrap();
    let llama = LlamaBench::read(&[f16.clone(), q4.clone()]).unwrap();

    let mut fp16 = row(2048, 2, &[100.0], &[60.0]);
    fp16.gen_tokens = 64;
    fp16.peak_rss_bytes = Some(100 << 20);
    let mut mse = BenchRow {
        method: "turboquant-mse-4bit".into(),
        bits: 4,
        tg_tps: Stats::new(vec![80.0]).unwrap(),
        ..fp16.clone()
    };
    let l = llama.compare(&fp16).unwrap();
    assert_eq!((l.cache_type.as_str(), l.tg_depth), ("f16", 2048));
    assert_eq!(l.tg_ratio, Some(1.2));
    assert_eq!(l.peak_rss_bytes, Some(200 << 20));
    assert_eq!(l.rss_ratio, Some(0.5));
    let q = llama.compare(&mse).unwrap();
    assert_eq!((q.cache_type.as_str(), q.tg_ratio), ("q4_0", Some(2.0)));
    assert_eq!(
        (q.peak_rss_bytes, q.rss_ratio),
        (Some(100 << 20), Some(1.0))
    );
    mse.llama_cpp = Some(q);
    let table = render_table(&[mse.clone()]);
    assert!(
        table.contains("q4_0") && table.contains("RSS ratio"),
        "{table}"
    );

    // Only the f16 file read: the compressed row has nothing to meet.
    let only_f16 = LlamaBench::read(std::slice::from_ref(&f16)).unwrap();
    assert!(only_f16.compare(&mse).is_none());
    // A .maxrss that is not a number is an error naming it.
    std::fs::write(dir.join("q4-d2048.json.maxrss"), "lots").unwrap();
    let err = LlamaBench::read(std::slice::from_ref(&q4)).err().unwrap();
    assert!(
        format!("{err:#}").contains("q4-d2048.json.maxrss"),
        "{err:#}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn llama_bench_json_that_is_not_a_list_is_an_error() {
    let dir = scratch("bad");
    let p = dir.join("x.json");
    std::fs::write(&p, "{}").unwrap();
    assert!(LlamaBench::read(std::slice::from_ref(&p)).is_err());
    assert!(merge_runs(&[p]).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// fp16 and a compressed method at two contexts, fp16 missing at the second.
fn two_methods() -> Vec<BenchRow> {
    let mut fp16 = row(512, 2, &[100.0], &[40.0]);
    fp16.gen_tokens = 32;
    fp16.kv_resident_bytes = 544 * 23040;
    fp16.kv_tokens = 544;
    let tq = BenchRow {
        method: "turboquant-mse-3bit".into(),
        bits: 3,
        tg_tps: Stats::new(vec![30.0]).unwrap(),
        kv_resident_bytes: 544 * 23040 / 4,
        rss_end_bytes: Some(300 << 20),
        peak_rss_bytes: Some(320 << 20),
        ..fp16.clone()
    };
    let tq_long = BenchRow {
        prompt_tokens: 2048,
        kv_tokens: 0,
        ..tq.clone()
    };
    vec![fp16, tq, tq_long]
}

#[test]
fn ratios_to_fp16_at_the_same_ctx() {
    let mut rows = two_methods();
    derive(&mut rows);
    assert_eq!(rows[0].kv_vs_fp16, Some(1.0));
    assert_eq!(rows[0].tg_vs_fp16, Some(1.0));
    assert_eq!(rows[0].kv_bytes_per_token, 23040.0);
    assert_eq!(rows[1].kv_vs_fp16, Some(4.0));
    assert_eq!(rows[1].tg_vs_fp16, Some(0.75));
    assert_eq!(rows[1].kv_bytes_per_token, 5760.0);
    // No fp16 row at 2048: no ratios; kv_tokens from the lengths when a row lacks it.
    assert_eq!((rows[2].kv_vs_fp16, rows[2].tg_vs_fp16), (None, None));
    assert_eq!(rows[2].kv_tokens, 2048 + 32);
    let bytes = (544 * 23040 / 4) as f64 / (2048 + 32) as f64;
    assert_eq!(rows[2].kv_bytes_per_token, bytes);
}

#[test]
fn table_has_speed_and_memory_columns() {
    let mut rows = two_methods();
    derive(&mut rows);
    let table = render_table(&rows);
    for col in [
        "| method",
        "ctx |",
        "pp tok/s",
        "tg tok/s",
        "tg vs fp16",
        "KV MiB",
        "KV bytes/token",
        "KV vs fp16 (× smaller)",
        "RSS at end MiB",
        "peak RSS MiB",
    ] {
        assert!(table.contains(col), "{col} missing:\n{table}");
    }
    assert!(!table.contains("threads |"), "one thread count:\n{table}");
    let tq = table
        .lines()
        .find(|l| l.contains("turboquant-mse-3bit") && l.contains(" 512 |"))
        .unwrap_or_else(|| panic!("no 512 row:\n{table}"));
    // 0.75× the fp16 decode speed, 2.99 MiB, 5760 bytes/token, 4× smaller, 300 and 320 MiB.
    for cell in ["0.75×", "2.99", "5760", "4.00×", "300.0", "320.0"] {
        assert!(tq.contains(cell), "{cell} missing: {tq}");
    }
    assert!(
        table.contains("each row measured in its own process") && table.contains("chunk 512"),
        "{table}"
    );
    assert!(!table.contains("GPU used MiB"), "CPU rows:\n{table}");
}

/// GPU rows carry the memory in use on the card: a column of its own, in the JSON only when
/// measured; the CPU has none to report.
#[test]
fn gpu_rows_show_the_memory_in_use_on_the_card() {
    assert_eq!(memory::device_used_bytes(&candle_core::Device::Cpu), None);
    let mut rows = two_methods();
    for (r, mib) in rows.iter_mut().zip([20_000u64, 17_000, 17_500]) {
        r.device = "cuda:0".into();
        r.device_used_bytes = Some(mib << 20);
    }
    derive(&mut rows);
    let table = render_table(&rows);
    assert!(table.contains("GPU used MiB"), "{table}");
    let tq = table
        .lines()
        .find(|l| l.contains("turboquant-mse-3bit") && l.contains(" 512 |"))
        .unwrap_or_else(|| panic!("no 512 row:\n{table}"));
    assert!(tq.contains("17000.0") && tq.contains("(cuda:0)"), "{tq}");
    let v: serde_json::Value = serde_json::to_value(&rows).unwrap();
    assert_eq!(
        v[0]["device_used_bytes"],
        serde_json::json!(20_000u64 << 20)
    );
    let cpu = serde_json::to_value(two_methods()).unwrap();
    assert!(cpu[0].get("device_used_bytes").is_none(), "{}", cpu[0]);
}

#[test]
fn json_rows_round_trip_and_old_rows_still_merge() {
    let mut rows = two_methods();
    derive(&mut rows);
    rows[1].child_wall_s = Some(3.5);
    let text = serde_json::to_string(&rows).unwrap();
    let back: Vec<BenchRow> = serde_json::from_str(&text).unwrap();
    assert_eq!(back[1].kv_vs_fp16, Some(4.0));
    assert_eq!(back[1].rss_end_bytes, Some(300 << 20));
    assert_eq!(back[1].kv_bytes_per_token, 5760.0);
    assert_eq!(
        (back[1].child_wall_s, back[0].child_wall_s),
        (Some(3.5), None)
    );
    assert_eq!(serde_json::to_string(&back).unwrap(), text);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    for key in [
        "kv_bytes_per_token",
        "kv_vs_fp16",
        "tg_vs_fp16",
        "rss_loaded_bytes",
        "rss_end_bytes",
        "peak_rss_bytes",
        "prefill_chunk",
        "isolated",
    ] {
        assert!(v[1].get(key).is_some(), "{key} missing in {}", v[1]);
    }

    // A row from before the memory fields: they default, and derive fills what it can.
    let mut old = v[0].clone();
    for key in [
        "prefill_chunk",
        "tg_vs_fp16",
        "kv_tokens",
        "kv_bytes_per_token",
        "kv_vs_fp16",
        "rss_loaded_bytes",
        "rss_end_bytes",
        "isolated",
        "measure_s",
    ] {
        old.as_object_mut().unwrap().remove(key);
    }
    let dir = scratch("old");
    let p = dir.join("old.json");
    std::fs::write(&p, serde_json::to_string(&[old]).unwrap()).unwrap();
    let mut merged = merge_runs(&[p]).unwrap();
    derive(&mut merged);
    assert_eq!(merged[0].prefill_chunk, 0);
    assert_eq!(merged[0].kv_tokens, 512 + 32);
    assert_eq!(merged[0].kv_vs_fp16, Some(1.0));
    assert_eq!(merged[0].rss_end_bytes, None);
    assert!(render_table(&merged).contains("prefill chunk -"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn proc_status_and_memory_plot_path() {
    let status = "Name:\tkvq\nVmHWM:\t  123456 kB\nVmRSS:\t    2048 kB\n";
    assert_eq!(memory::parse_kib(status, "VmHWM:"), Some(123456));
    assert_eq!(memory::parse_kib(status, "VmRSS:"), Some(2048));
    assert_eq!(memory::parse_kib(status, "VmSwap:"), None);
    if cfg!(target_os = "linux") {
        let (rss, peak) = (
            memory::rss_bytes().unwrap(),
            memory::peak_rss_bytes().unwrap(),
        );
        assert!(rss > 0 && peak >= rss, "rss {rss}, peak {peak}");
    }
    assert_eq!(
        memory_plot_path(Path::new("/tmp/bench/ctx.png")),
        Path::new("/tmp/bench/ctx-memory.png")
    );
    assert_eq!(
        memory_plot_path(Path::new("out")),
        Path::new("out-memory.png")
    );
}

#[test]
fn ctx_alias_chunk_default_and_isolation() {
    let a = parse(&["--ctx", "512,2048", "--methods", "fp16"]);
    assert_eq!(a.prompt_tokens, vec![512, 2048]);
    assert_eq!(
        a.prefill_chunk,
        kvq_engine::EngineConfig::default().prefill_chunk
    );
    assert!(isolate::wanted(&a), "two pairs isolate by default");
    assert!(!isolate::wanted(&parse(&["--ctx", "64"])), "one pair");
    assert!(isolate::wanted(&parse(&["--ctx", "64", "--isolate"])));
    assert!(!isolate::wanted(&parse(&[
        "--ctx",
        "64,128",
        "--no-isolate"
    ])));
    assert!(isolate::wanted(&parse(&["--no-isolate", "--isolate"])));

    let a = parse(&[
        "--ctx",
        "64,128",
        "--methods",
        "fp16,turboquant-mse-3bit",
        "--gen-tokens",
        "4",
        "--prefill-chunk",
        "32",
        "--no-warmup",
        "--plot",
        "x.png",
        "--json",
        "all.json",
    ]);
    let choice = crate::cli::model::ModelChoice {
        path: "snapshots/abc".into(),
        id: Some("org/repo:Q4_K_M".into()),
    };
    let child = isolate::child_args(&a, &choice, "turboquant-mse-3bit", 128, Path::new("t.json"));
    let child: Vec<&str> = child.iter().map(|s| s.to_str().unwrap()).collect();
    assert_eq!(child[0], "bench");
    let narrowed = parse(&child[1..]);
    assert_eq!(narrowed.methods, vec!["turboquant-mse-3bit"]);
    assert_eq!(narrowed.prompt_tokens, vec![128]);
    assert_eq!(narrowed.model.as_deref(), Some(Path::new("snapshots/abc")));
    assert_eq!(narrowed.model_id.as_deref(), Some("org/repo:Q4_K_M"));
    assert_eq!(narrowed.json.as_deref(), Some(Path::new("t.json")));
    assert_eq!((narrowed.gen_tokens, narrowed.prefill_chunk), (4, 32));
    assert!(narrowed.no_warmup && narrowed.plot.is_none());
    assert!(!isolate::wanted(&narrowed));
}

#[test]
fn charts_of_speed_and_memory() {
    let Ok(font) = plot::find_font(None) else {
        eprintln!("no system font: chart test skipped");
        return;
    };
    plot::register_font(&font).unwrap();
    let mut rows = two_methods();
    derive(&mut rows);
    let dir = scratch("plot");
    let (speed, memory) = (dir.join("b.png"), dir.join("b-memory.png"));
    plot::draw(&rows, &speed).unwrap();
    plot::draw_memory(&rows, &memory).unwrap();
    for p in [&speed, &memory] {
        let bytes = std::fs::read(p).unwrap();
        assert!(bytes.starts_with(b"\x89PNG"), "{} is no PNG", p.display());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ctx_past_the_context_length_fails_early_with_the_deepest_valid_ctx() {
    let args = parse(&["--ctx", "512,8192", "--gen-tokens", "32"]);
    check_context(&parse(&["--ctx", "8160", "--gen-tokens", "32"]), 8192).unwrap();
    let err = check_context(&args, 8192).unwrap_err().to_string();
    assert!(err.contains("--ctx 8192") && err.contains("8160"), "{err}");
    let model = default_model();
    if model.exists() {
        assert_eq!(isolate::context_length(&model), Some(8192));
    }
    assert_eq!(
        isolate::context_length(Path::new("/nonexistent.gguf")),
        None
    );
}

/// The workspace root: presets and the default model are found from there.
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// SmolLM2-135M-Instruct Q4_1 in `$KVQ_MODELS_DIR`, else the workspace's models/.
fn default_model() -> PathBuf {
    std::env::var_os("KVQ_MODELS_DIR")
        .map_or_else(|| workspace_root().join("models"), PathBuf::from)
        .join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// The real `kvq` binary (`$KVQ_BIN`, else target/<profile>/kvq beside this test's deps/).
fn kvq_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("KVQ_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().unwrap();
    let p = exe.parent().and_then(Path::parent).unwrap().join("kvq");
    assert!(
        p.exists(),
        "{} is missing: build it first (cargo build --release --bin kvq)",
        p.display()
    );
    p
}

#[test]
fn isolated_children_measure_fp16_and_turboquant_end_to_end() {
    let root = workspace_root();
    let model = default_model();
    assert!(
        model.exists(),
        "{} is missing: run scripts/fetch-models",
        model.display()
    );
    let dir = scratch("e2e");
    let json = dir.join("rows.json");
    let out = std::process::Command::new(kvq_bin())
        .current_dir(&root)
        .arg("bench")
        .arg("--model")
        .arg(&model)
        .args(["--ctx", "64", "--gen-tokens", "4", "--repeats", "1"])
        .args(["--methods", "fp16,turboquant-mse-3bit", "--isolate"])
        .arg("--json")
        .arg(&json)
        .output()
        .expect("run kvq bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "kvq bench failed:\n{stdout}\n{stderr}"
    );
    for tag in ["[1/2] fp16 ctx=64", "[2/2] turboquant-mse-3bit ctx=64"] {
        assert!(stderr.contains(tag), "no child progress {tag}:\n{stderr}");
    }
    assert!(stdout.contains("peak RSS MiB"), "table:\n{stdout}");
    let rows: Vec<BenchRow> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).expect("bench JSON rows");
    assert_eq!(rows.len(), 2, "{rows:?}");
    let (fp16, tq) = (&rows[0], &rows[1]);
    assert_eq!(
        (fp16.method.as_str(), tq.method.as_str()),
        ("fp16", "turboquant-mse-3bit")
    );
    for r in &rows {
        assert_eq!((r.prompt_tokens, r.kv_tokens), (64, 68), "{r:?}");
        assert!(r.isolated && r.child_wall_s.is_some(), "{r:?}");
        let (loaded, end, peak) = (
            r.rss_loaded_bytes.expect("rss after load"),
            r.rss_end_bytes.expect("rss at end"),
            r.peak_rss_bytes.expect("peak rss"),
        );
        assert!(
            loaded > 0 && end > 0 && peak >= end && peak >= loaded,
            "{r:?}"
        );
    }
    assert!(
        tq.kv_resident_bytes < fp16.kv_resident_bytes,
        "compressed {} vs fp16 {}",
        tq.kv_resident_bytes,
        fp16.kv_resident_bytes
    );
    assert!(
        tq.kv_vs_fp16.unwrap() > 1.0 && tq.tg_vs_fp16.is_some(),
        "{tq:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
