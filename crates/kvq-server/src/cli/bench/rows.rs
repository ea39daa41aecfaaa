//! Rows after measuring: pooling the samples of earlier runs (`--from-json`) and the fields
//! derived from several rows (bytes per token, the ratios to fp16 at the same context).

use super::{BenchRow, Stats};
use anyhow::{Context, bail};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// The method every ratio is taken against.
pub(super) const BASELINE: &str = "fp16";

/// Fills `kv_tokens` (rows from before it existed), `kv_bytes_per_token`, `kv_vs_fp16` and
/// `tg_vs_fp16`: the fp16 row of the same engine, model, threads and lengths is the baseline
/// (the ratios stay `None` without one).
pub(super) fn derive(rows: &mut [BenchRow]) {
    for r in rows.iter_mut() {
        if r.kv_tokens == 0 {
            r.kv_tokens = r.sequences.max(1) * (r.prompt_tokens + r.gen_tokens);
        }
        r.kv_bytes_per_token = r.kv_resident_bytes as f64 / r.kv_tokens.max(1) as f64;
    }
    let same = |a: &BenchRow, b: &BenchRow| {
        a.engine == b.engine
            && a.model == b.model
            && a.threads == b.threads
            && a.sequences == b.sequences
            && a.shared_prompt == b.shared_prompt
            && a.device == b.device
            && a.prompt_tokens == b.prompt_tokens
            && a.gen_tokens == b.gen_tokens
    };
    let baselines: Vec<Option<(usize, f64)>> = rows
        .iter()
        .map(|r| {
            rows.iter()
                .find(|b| b.method == BASELINE && same(b, r))
                .map(|b| (b.kv_resident_bytes, b.tg_tps.median))
        })
        .collect();
    for (r, base) in rows.iter_mut().zip(baselines) {
        let Some((kv, tg)) = base else {
            r.kv_vs_fp16 = None;
            r.tg_vs_fp16 = None;
            continue;
        };
        r.kv_vs_fp16 = (r.kv_resident_bytes > 0).then(|| kv as f64 / r.kv_resident_bytes as f64);
        r.tg_vs_fp16 = (tg > 0.0).then(|| r.tg_tps.median / tg);
    }
}

/// Pools the samples of rows with the same model, method and lengths from earlier runs; memory
/// numbers keep their largest value.
pub(super) fn merge_runs(paths: &[PathBuf]) -> anyhow::Result<Vec<BenchRow>> {
    // Rows of other sequence counts or devices are other configurations, never pooled.
    type Key = (
        String,
        String,
        usize,
        usize,
        usize,
        usize,
        usize,
        bool,
        String,
    );
    let mut merged: BTreeMap<Key, BenchRow> = BTreeMap::new();
    let mut order = Vec::new();
    for path in paths {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("could not read {}", path.display()))?;
        let rows: Vec<BenchRow> = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a `kvq bench --json` output", path.display()))?;
        for row in rows {
            let key = (
                row.model.clone(),
                row.method.clone(),
                row.threads,
                row.prompt_tokens,
                row.gen_tokens,
                row.prefill_chunk,
                row.sequences,
                row.shared_prompt,
                row.device.clone(),
            );
            match merged.get_mut(&key) {
                Some(m) => {
                    let pp = [m.pp_tps.samples.clone(), row.pp_tps.samples].concat();
                    let tg = [m.tg_tps.samples.clone(), row.tg_tps.samples].concat();
                    m.pp_tps = Stats::new(pp).context("no prefill samples")?;
                    m.tg_tps = Stats::new(tg).context("no decode samples")?;
                    m.kv_resident_bytes = m.kv_resident_bytes.max(row.kv_resident_bytes);
                    m.kv_tokens = m.kv_tokens.max(row.kv_tokens);
                    m.rss_loaded_bytes = m.rss_loaded_bytes.max(row.rss_loaded_bytes);
                    m.rss_end_bytes = m.rss_end_bytes.max(row.rss_end_bytes);
                    m.peak_rss_bytes = m.peak_rss_bytes.max(row.peak_rss_bytes);
                    m.isolated &= row.isolated;
                    m.measure_s += row.measure_s;
                    m.child_wall_s = match (m.child_wall_s, row.child_wall_s) {
                        (Some(a), Some(b)) => Some(a + b),
                        (a, b) => a.or(b),
                    };
                }
                None => {
                    order.push(key.clone());
                    merged.insert(
                        key,
                        BenchRow {
                            llama_cpp: None,
                            ..row
                        },
                    );
                }
            }
        }
    }
    if order.is_empty() {
        bail!("--from-json: no rows in {} file(s)", paths.len());
    }
    Ok(order
        .into_iter()
        .filter_map(|k| merged.remove(&k))
        .collect())
}
