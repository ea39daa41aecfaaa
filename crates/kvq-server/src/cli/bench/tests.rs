//! Unit tests of `kvq bench`: stats, merging runs, llama-bench parsing, the table.

use super::*;

fn row(n: usize, threads: usize, pp: &[f64], tg: &[f64]) -> BenchRow {
    BenchRow {
        engine: "kvq".into(),
        model: "m".into(),
        method: "fp16".into(),
        bits: 16,
        prompt_tokens: n,
        gen_tokens: 128,
        threads,
        pp_tps: Stats::new(pp.to_vec()).unwrap(),
        tg_tps: Stats::new(tg.to_vec()).unwrap(),
        kv_resident_bytes: 10,
        peak_rss_bytes: Some(20),
        llama_cpp: None,
    }
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
    let dir = std::env::temp_dir().join(format!("kvq-bench-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let a = dir.join("a.json");
    let b = dir.join("b.json");
    std::fs::write(
        &a,
        serde_json::to_string(&[row(128, 2, &[10.0], &[5.0])]).unwrap(),
    )
    .unwrap();
    std::fs::write(
        &b,
        serde_json::to_string(&[row(128, 2, &[30.0], &[7.0])]).unwrap(),
    )
    .unwrap();
    let rows = merge_runs(&[a, b]).unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].pp_tps.median, 20.0);
    assert_eq!(rows[0].tg_tps.samples, vec![5.0, 7.0]);

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
    let l = LlamaBench::read(&[ll]).unwrap().compare(&rows[0]);
    assert_eq!(l.pp_tps.as_ref().unwrap().median, 40.0);
    assert_eq!(l.pp_ratio, Some(0.5));
    assert_eq!((l.tg_depth, l.tg_ratio), (128, Some(0.6)));
    assert_eq!(l.tg_tps_depth0.unwrap().median, 12.0);
    let table = render_table(&[BenchRow {
        llama_cpp: Some(
            LlamaBench::read(&[dir.join("llama.json")])
                .unwrap()
                .compare(&rows[0]),
        ),
        ..rows[0].clone()
    }]);
    assert!(
        table.contains("0.50×") && table.contains("@ d128"),
        "{table}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn llama_bench_json_that_is_not_a_list_is_an_error() {
    let dir = std::env::temp_dir().join(format!("kvq-bench-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("x.json");
    std::fs::write(&p, "{}").unwrap();
    assert!(LlamaBench::read(std::slice::from_ref(&p)).is_err());
    assert!(merge_runs(&[p]).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}
