//! `kvq bench`: prompt (prefill) and decode tokens/s per KV cache method and prompt length,
//! measured the way llama.cpp's `llama-bench` does (random prompt tokens, one batched prefill,
//! then one token per step), printed as a table, written as JSON rows and drawn as a PNG bar
//! chart; optionally side by side with `llama-bench -o json` results (`--compare-llama-bench`).
//!
//! `--from-json` skips measuring: it merges the rows of earlier runs (their samples pooled), so
//! interleaved rounds of kvq and llama.cpp on a noisy machine can be reported as one result.

use super::model::{load_with_progress, resolve_model_path};
use anyhow::{Context, bail, ensure};
use clap::Args;
use comfy_table::{Cell, CellAlignment, Table, presets::ASCII_MARKDOWN};
use kvq_cache::{CacheRegistry, CacheSpec};
use kvq_models::model::{Model, SeqStep};
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// A GGUF file or a Hugging Face model directory (default: SmolLM2-135M-Instruct).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Prompt lengths to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "128,512")]
    pub prompt_tokens: Vec<usize>,
    /// Tokens to decode after each prompt.
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// KV cache methods to measure, comma-separated registry names.
    #[arg(long, value_delimiter = ',', default_value = "fp16")]
    pub methods: Vec<String>,
    /// Timed repetitions of each (method, prompt length); the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Skip the untimed warm-up run before each (method, prompt length).
    #[arg(long)]
    pub no_warmup: bool,
    /// Seed of the random prompt tokens.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Write the rows as a JSON list to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw a PNG bar chart of prompt and decode tokens/s to this file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// A TrueType font for the plot's text (default: DejaVu Sans or Liberation Sans from
    /// /usr/share/fonts; env KVQ_PLOT_FONT).
    #[arg(long, env = "KVQ_PLOT_FONT")]
    pub plot_font: Option<PathBuf>,
    /// `llama-bench -o json` outputs (comma-separated or repeated) to compare with: their
    /// samples are pooled; decode is matched on depth (`-d N`) = prompt length where present.
    #[arg(long, value_delimiter = ',')]
    pub compare_llama_bench: Vec<PathBuf>,
    /// Report earlier `kvq bench --json` outputs instead of measuring (samples pooled).
    #[arg(long, value_delimiter = ',')]
    pub from_json: Vec<PathBuf>,
}

/// Median, extremes and every sample of one throughput, tokens/s.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Stats {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub samples: Vec<f64>,
}

impl Stats {
    fn new(samples: Vec<f64>) -> Option<Stats> {
        let mut s: Vec<f64> = samples.into_iter().filter(|x| x.is_finite()).collect();
        if s.is_empty() {
            return None;
        }
        s.sort_by(f64::total_cmp);
        let n = s.len();
        let median = if n % 2 == 1 {
            s[n / 2]
        } else {
            (s[n / 2 - 1] + s[n / 2]) / 2.0
        };
        Some(Stats {
            median,
            min: s[0],
            max: s[n - 1],
            samples: s,
        })
    }
}

/// llama.cpp's numbers for the same prompt length, from `llama-bench -o json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LlamaCpp {
    /// Prompt processing of `prompt_tokens` tokens (`pp N`).
    pub pp_tps: Option<Stats>,
    /// Decode of `gen_tokens` tokens after `tg_depth` tokens of context (`tg G @ dN`).
    pub tg_tps: Option<Stats>,
    /// Context depth of `tg_tps`: the prompt length when llama-bench ran with `-d`, else 0.
    pub tg_depth: usize,
    /// Decode from an empty context (`tg G`), llama-bench's default test.
    pub tg_tps_depth0: Option<Stats>,
    /// kvq median / llama.cpp median.
    pub pp_ratio: Option<f64>,
    pub tg_ratio: Option<f64>,
    pub build_commit: Option<String>,
    /// llama-bench's `-t`, matched to kvq's thread count.
    pub n_threads: u64,
}

/// One measured configuration.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchRow {
    pub engine: String,
    pub model: String,
    pub method: String,
    pub bits: u8,
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub threads: usize,
    /// Prompt tokens / prefill seconds.
    pub pp_tps: Stats,
    /// Generated tokens / decode seconds (one forward and a greedy pick per token).
    pub tg_tps: Stats,
    /// Bytes the KV cache holds after prompt + generated tokens.
    pub kv_resident_bytes: usize,
    /// The process's peak resident set (VmHWM) when the row was done.
    pub peak_rss_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub llama_cpp: Option<LlamaCpp>,
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let mut rows = if args.from_json.is_empty() {
        measure_all(&args).await?
    } else {
        merge_runs(&args.from_json)?
    };
    if !args.compare_llama_bench.is_empty() {
        let llama = LlamaBench::read(&args.compare_llama_bench)?;
        for row in &mut rows {
            row.llama_cpp = Some(llama.compare(row));
        }
    }
    println!("{}", render_table(&rows));
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&rows)?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("could not write {}", path.display()))?;
    }
    if let Some(path) = &args.plot {
        let font = plot::find_font(args.plot_font.as_deref())?;
        plot::draw(&rows, path, &font)
            .with_context(|| format!("could not draw the plot {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

async fn measure_all(args: &BenchArgs) -> anyhow::Result<Vec<BenchRow>> {
    ensure!(!args.prompt_tokens.is_empty(), "--prompt-tokens is empty");
    ensure!(
        args.prompt_tokens.iter().all(|&n| n >= 1),
        "--prompt-tokens must be at least 1"
    );
    ensure!(args.gen_tokens >= 1, "--gen-tokens must be at least 1");
    ensure!(args.repeats >= 1, "--repeats must be at least 1");
    let registry = CacheRegistry::builtin();
    let methods = args
        .methods
        .iter()
        .map(|m| {
            registry
                .resolve(&CacheSpec {
                    method: Some(m.clone()),
                    bits: None,
                })
                .with_context(|| format!("--methods {m}"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let path = resolve_model_path(args.model.clone())?;
    let loaded = load_with_progress(path).await?;
    let ctx = loaded.model.config().context_length;
    for &n in &args.prompt_tokens {
        ensure!(
            n + args.gen_tokens <= ctx,
            "{n} prompt + {} generated tokens exceed the context length {ctx}",
            args.gen_tokens
        );
    }
    let model_id = loaded.info.id.clone();
    let plan = Plan {
        prompt_tokens: args.prompt_tokens.clone(),
        gen_tokens: args.gen_tokens,
        repeats: args.repeats,
        warmup: !args.no_warmup,
        seed: args.seed,
    };
    tokio::task::spawn_blocking(move || {
        let mut rows = Vec::new();
        for m in &methods {
            for &n in &plan.prompt_tokens {
                let row = measure(&loaded.model, &model_id, m, n, &plan)?;
                eprintln!(
                    "{} n={n}: pp {:.1} tok/s, tg {:.1} tok/s",
                    m.name, row.pp_tps.median, row.tg_tps.median
                );
                rows.push(row);
            }
        }
        Ok(rows)
    })
    .await
    .context("the benchmark task failed")?
}

struct Plan {
    prompt_tokens: Vec<usize>,
    gen_tokens: usize,
    repeats: usize,
    warmup: bool,
    seed: u64,
}

/// Times of one prefill of `n` random tokens and `g` greedy decode steps on fresh caches.
struct Run {
    prefill_s: f64,
    decode_s: f64,
    kv_bytes: usize,
}

fn run_once(
    model: &Model,
    cache: &kvq_cache::ResolvedCache,
    prompt: &[u32],
    g: usize,
) -> anyhow::Result<Run> {
    let mut caches = model.new_caches(cache.factory.as_ref())?;
    let t0 = Instant::now();
    let logits = model.forward(&mut [SeqStep {
        tokens: prompt,
        cache: &mut caches,
        all_logits: false,
    }])?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let mut next = greedy(&logits)?;
    let t1 = Instant::now();
    for _ in 0..g {
        let logits = model.forward(&mut [SeqStep {
            tokens: &[next],
            cache: &mut caches,
            all_logits: false,
        }])?;
        next = greedy(&logits)?;
    }
    let decode_s = t1.elapsed().as_secs_f64();
    Ok(Run {
        prefill_s,
        decode_s,
        kv_bytes: caches.resident_bytes(),
    })
}

/// The most likely next token of the only sequence.
fn greedy(logits: &[candle_core::Tensor]) -> anyhow::Result<u32> {
    let row = logits
        .first()
        .context("the model returned no logits")?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let best = row
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i as u32)
        .context("empty logits")?;
    Ok(best)
}

fn measure(
    model: &Model,
    model_id: &str,
    cache: &kvq_cache::ResolvedCache,
    n: usize,
    plan: &Plan,
) -> anyhow::Result<BenchRow> {
    let vocab = model.config().vocab_size as u32;
    let mut rng = StdRng::seed_from_u64(plan.seed ^ (n as u64).rotate_left(32));
    let prompt: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab)).collect();
    if plan.warmup {
        run_once(model, cache, &prompt, plan.gen_tokens.min(4))?;
    }
    let mut pp = Vec::with_capacity(plan.repeats);
    let mut tg = Vec::with_capacity(plan.repeats);
    let mut kv_bytes = 0;
    for _ in 0..plan.repeats {
        let r = run_once(model, cache, &prompt, plan.gen_tokens)?;
        pp.push(n as f64 / r.prefill_s);
        tg.push(plan.gen_tokens as f64 / r.decode_s);
        kv_bytes = r.kv_bytes;
    }
    Ok(BenchRow {
        engine: "kvq".into(),
        model: model_id.into(),
        method: cache.name.clone(),
        bits: cache.bits,
        prompt_tokens: n,
        gen_tokens: plan.gen_tokens,
        threads: candle_core::utils::get_num_threads(),
        pp_tps: Stats::new(pp).context("no prefill timing")?,
        tg_tps: Stats::new(tg).context("no decode timing")?,
        kv_resident_bytes: kv_bytes,
        peak_rss_bytes: peak_rss_bytes(),
        llama_cpp: None,
    })
}

/// VmHWM from /proc/self/status, in bytes (Linux only).
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line
        .trim_start_matches("VmHWM:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// Pools the samples of rows with the same model, method and lengths from earlier runs.
fn merge_runs(paths: &[PathBuf]) -> anyhow::Result<Vec<BenchRow>> {
    type Key = (String, String, usize, usize, usize);
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
            );
            match merged.get_mut(&key) {
                Some(m) => {
                    let pp = [m.pp_tps.samples.clone(), row.pp_tps.samples].concat();
                    let tg = [m.tg_tps.samples.clone(), row.tg_tps.samples].concat();
                    m.pp_tps = Stats::new(pp).context("no prefill samples")?;
                    m.tg_tps = Stats::new(tg).context("no decode samples")?;
                    m.kv_resident_bytes = m.kv_resident_bytes.max(row.kv_resident_bytes);
                    m.peak_rss_bytes = m.peak_rss_bytes.max(row.peak_rss_bytes);
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

/// One test of `llama-bench -o json`; unknown fields are ignored.
#[derive(Debug, Deserialize)]
struct LlamaTest {
    n_prompt: usize,
    n_gen: usize,
    #[serde(default)]
    n_depth: usize,
    samples_ts: Vec<f64>,
    #[serde(default)]
    build_commit: Option<String>,
    n_threads: u64,
}

/// Every llama-bench test read, samples pooled per (threads, prompt, generated, depth).
struct LlamaBench {
    samples: BTreeMap<(u64, usize, usize, usize), Vec<f64>>,
    build_commit: Option<String>,
}

impl LlamaBench {
    fn read(paths: &[PathBuf]) -> anyhow::Result<LlamaBench> {
        let mut out = LlamaBench {
            samples: BTreeMap::new(),
            build_commit: None,
        };
        for path in paths {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("could not read {}", path.display()))?;
            let tests: Vec<LlamaTest> = serde_json::from_str(&text).with_context(|| {
                format!("{} is not a `llama-bench -o json` output", path.display())
            })?;
            for t in tests {
                out.samples
                    .entry((t.n_threads, t.n_prompt, t.n_gen, t.n_depth))
                    .or_default()
                    .extend(t.samples_ts);
                out.build_commit = out.build_commit.or(t.build_commit);
            }
        }
        Ok(out)
    }

    fn stats(&self, key: (u64, usize, usize, usize)) -> Option<Stats> {
        self.samples.get(&key).and_then(|s| Stats::new(s.clone()))
    }

    fn compare(&self, row: &BenchRow) -> LlamaCpp {
        let (n, g, t) = (row.prompt_tokens, row.gen_tokens, row.threads as u64);
        let pp = self.stats((t, n, 0, 0));
        let tg0 = self.stats((t, 0, g, 0));
        let (tg, depth) = match self.stats((t, 0, g, n)) {
            Some(s) => (Some(s), n),
            None => (tg0.clone(), 0),
        };
        let ratio = |kvq: &Stats, l: &Option<Stats>| l.as_ref().map(|l| kvq.median / l.median);
        LlamaCpp {
            pp_ratio: ratio(&row.pp_tps, &pp),
            tg_ratio: ratio(&row.tg_tps, &tg),
            pp_tps: pp,
            tg_tps: tg,
            tg_depth: depth,
            tg_tps_depth0: tg0,
            build_commit: self.build_commit.clone(),
            n_threads: t,
        }
    }
}

fn fmt_stats(s: &Stats) -> String {
    format!("{:.1} ({:.1}–{:.1})", s.median, s.min, s.max)
}

fn fmt_opt(s: &Option<Stats>) -> String {
    s.as_ref().map_or_else(|| "-".into(), fmt_stats)
}

fn fmt_ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "-".into(), |r| format!("{r:.2}×"))
}

fn fmt_mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0))
}

/// The rows as a Markdown-compatible table; llama.cpp columns when compared.
fn render_table(rows: &[BenchRow]) -> String {
    let compared = rows.iter().any(|r| r.llama_cpp.is_some());
    let mut header = vec!["method", "threads", "prompt", "gen", "kvq pp tok/s"];
    if compared {
        header.extend(["llama.cpp pp tok/s", "pp ratio"]);
    }
    header.push("kvq tg tok/s");
    if compared {
        header.extend(["llama.cpp tg tok/s", "tg ratio"]);
    }
    header.extend(["KV bytes", "peak RSS"]);
    let mut table = Table::new();
    table.load_style(ASCII_MARKDOWN).set_header(header);
    for r in rows {
        let mut cells = vec![
            Cell::new(&r.method),
            Cell::new(r.threads),
            Cell::new(r.prompt_tokens),
            Cell::new(r.gen_tokens),
            Cell::new(fmt_stats(&r.pp_tps)),
        ];
        let l = r.llama_cpp.as_ref();
        if compared {
            cells.push(Cell::new(l.map_or("-".into(), |l| fmt_opt(&l.pp_tps))));
            cells.push(Cell::new(fmt_ratio(l.and_then(|l| l.pp_ratio))));
        }
        cells.push(Cell::new(fmt_stats(&r.tg_tps)));
        if compared {
            cells.push(Cell::new(l.map_or("-".into(), |l| {
                format!("{} @ d{}", fmt_opt(&l.tg_tps), l.tg_depth)
            })));
            cells.push(Cell::new(fmt_ratio(l.and_then(|l| l.tg_ratio))));
        }
        cells.push(Cell::new(r.kv_resident_bytes));
        cells.push(Cell::new(r.peak_rss_bytes.map_or("-".into(), fmt_mib)));
        table.add_row(cells);
    }
    for i in 1..table.column_count() {
        if let Some(c) = table.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    table.to_string()
}

/// The PNG chart: prompt and decode tokens/s side by side, one bar per engine and method, grouped
/// by prompt length.
mod plot;
#[cfg(test)]
mod tests;
