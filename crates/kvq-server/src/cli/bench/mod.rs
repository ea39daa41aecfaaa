//! `kvq bench`: speed and memory per KV cache method and context length (`--ctx`). Prompt
//! (prefill) and decode tokens/s are measured the way llama.cpp's `llama-bench` does (random
//! prompt tokens, then one token per step at that depth), the prompt fed in chunks of
//! `--prefill-chunk` tokens as `kvq serve` does; memory is the cache's resident bytes and the
//! process's RSS (after the model load, at the end with the cache alive, and the peak). With more
//! than one (method, ctx) pair each runs in a child process of its own (`--isolate`,
//! isolate.rs), so every row's RSS is that method's alone. Printed as a table, written as JSON
//! rows and drawn as PNG bar charts (speed, and memory beside it); optionally side by side with
//! `llama-bench -o json` results (`--compare-llama-bench`).
//!
//! `--from-json` skips measuring: it merges the rows of earlier runs (their samples pooled), so
//! interleaved rounds of kvq and llama.cpp on a noisy machine can be reported as one result.

use super::model::{ModelChoice, load_with_progress, resolve_model};
use anyhow::{Context, ensure};
use clap::Args;
use kvq_cache::{CacheSpec, LayerCaches, ResolvedCache};
use kvq_models::model::{Model, SeqStep};
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Instant;

pub use llama::LlamaCpp;

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// A GGUF file, a Hugging Face model directory, or a Hub id (org/repo[:QUANT][@REVISION])
    /// (default: SmolLM2-135M-Instruct).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The id to report the model under (what a Hub id resolved to is a snapshot path; the
    /// parent passes the id on to its children).
    #[arg(long, hide = true)]
    pub model_id: Option<String>,
    /// Where the model and its KV caches run: cpu, cuda, cuda:N, metal or auto (CUDA when
    /// this binary has it and a GPU answers, else the CPU).
    #[arg(long, default_value = "auto")]
    pub device: crate::cli::device::DeviceArg,
    /// Context depths to measure, comma-separated: a prompt of that many random tokens, then
    /// decode at that depth.
    #[arg(
        long,
        visible_alias = "ctx",
        value_delimiter = ',',
        default_value = "128,512"
    )]
    pub prompt_tokens: Vec<usize>,
    /// Tokens to decode after each prompt.
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Sequences run together: each step is one batched forward over all of them (their
    /// prompt chunks, then one token each); tokens/s count every sequence's tokens.
    #[arg(long, default_value_t = 1)]
    pub sequences: usize,
    /// With --sequences above 1: prefill the prompt for one sequence and copy its caches to the
    /// others (`KvCache::fork`, as a prefix cache would), so deep contexts of many sequences
    /// are measured without prefilling each; decode still reads every sequence's own cache.
    /// Prompt tokens/s are then one sequence's (the copies included).
    #[arg(long)]
    pub shared_prompt: bool,
    /// Prompt tokens per forward pass, as the server's scheduler feeds them.
    #[arg(long, default_value_t = kvq_engine::EngineConfig::default().prefill_chunk)]
    pub prefill_chunk: usize,
    /// KV cache methods to measure, comma-separated registry names or presets.
    #[arg(long, value_delimiter = ',', default_value = "fp16")]
    pub methods: Vec<String>,
    /// Timed repetitions of each (method, ctx); the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Skip the untimed warm-up (one prefill chunk and 4 decode steps) before each (method, ctx).
    #[arg(long)]
    pub no_warmup: bool,
    /// Measure each (method, ctx) in a child process of its own, so the RSS columns are that
    /// method's alone [default: on when more than one pair is measured].
    #[arg(long, overrides_with = "no_isolate")]
    pub isolate: bool,
    /// Measure every pair in this process (RSS at end and peak then accumulate down the rows).
    #[arg(long, overrides_with = "isolate")]
    pub no_isolate: bool,
    /// Seed of the random prompt tokens.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Directory of cache presets [default: configs/cache when it exists].
    #[arg(long)]
    pub cache_presets: Option<PathBuf>,
    /// Write the rows as a JSON list to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw a PNG bar chart of prompt and decode tokens/s to this file, and one of KV cache MiB
    /// and peak RSS beside it (OUT-memory.png).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// A TrueType font for the plot's text (default: DejaVu Sans or Liberation Sans from
    /// /usr/share/fonts; env KVQ_PLOT_FONT).
    #[arg(long, env = "KVQ_PLOT_FONT")]
    pub plot_font: Option<PathBuf>,
    /// `llama-bench -o json` outputs (comma-separated or repeated) to compare with: their
    /// samples are pooled; decode is matched on depth (`-d N`) = prompt length where present;
    /// fp16 rows against llama.cpp's f16 cache, compressed ones against q4_0 (`-ctk`/`-ctv`). A
    /// file `X.json.maxrss` beside `X.json` (`/usr/bin/time -f %M -o`) gives that process's
    /// peak RSS in KiB.
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

/// One measured configuration. Fields added after the first version are `serde(default)`, so
/// older `--json` files still merge (`--from-json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchRow {
    pub engine: String,
    pub model: String,
    pub method: String,
    pub bits: u8,
    /// The context depth: prompt tokens prefilled before decoding.
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub threads: usize,
    /// Sequences decoded together in each batched forward.
    #[serde(default = "one")]
    pub sequences: usize,
    /// Whether the sequences' caches were copied from one prefill (`--shared-prompt`).
    #[serde(default)]
    pub shared_prompt: bool,
    /// Where it ran (`cpu`, `cuda:0`).
    #[serde(default = "cpu")]
    pub device: String,
    /// Prompt tokens per prefill forward pass (0: unknown, rows from before chunking).
    #[serde(default)]
    pub prefill_chunk: usize,
    /// Prompt tokens / prefill seconds.
    pub pp_tps: Stats,
    /// Generated tokens / decode seconds (one forward and a greedy pick per token).
    pub tg_tps: Stats,
    /// This row's decode tokens/s over fp16's at the same ctx (derived).
    #[serde(default)]
    pub tg_vs_fp16: Option<f64>,
    /// Bytes the KV cache holds after prompt + generated tokens.
    pub kv_resident_bytes: usize,
    /// Positions the cache held then (prompt + generated).
    #[serde(default)]
    pub kv_tokens: usize,
    /// `kv_resident_bytes / kv_tokens` (derived).
    #[serde(default)]
    pub kv_bytes_per_token: f64,
    /// fp16's resident KV bytes at the same ctx over this row's: times smaller (derived).
    #[serde(default)]
    pub kv_vs_fp16: Option<f64>,
    /// The process's resident set (VmRSS) right after the model was loaded.
    #[serde(default)]
    pub rss_loaded_bytes: Option<u64>,
    /// VmRSS when the row was done, the last run's caches still alive.
    #[serde(default)]
    pub rss_end_bytes: Option<u64>,
    /// The process's peak resident set (VmHWM) when the row was done.
    pub peak_rss_bytes: Option<u64>,
    /// Memory in use on the GPU when the row was done, the last run's caches alive (CUDA: the
    /// card's total less its free memory; Metal: the device's allocated size); `None` on the CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_used_bytes: Option<u64>,
    /// Whether the process measured this row alone (then its RSS numbers are this row's only).
    #[serde(default)]
    pub isolated: bool,
    /// Seconds of warm-up and timed runs (the model load not included).
    #[serde(default)]
    pub measure_s: f64,
    /// Wall seconds of the child process that measured the row (`--isolate`; model load included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub child_wall_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub llama_cpp: Option<LlamaCpp>,
}

fn one() -> usize {
    1
}

fn cpu() -> String {
    "cpu".into()
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let mut rows = if !args.from_json.is_empty() {
        rows::merge_runs(&args.from_json)?
    } else {
        validate(&args)?;
        let mut choice = resolve_model(args.model.as_deref()).await?;
        if let Some(id) = &args.model_id {
            choice.id = Some(id.clone());
        }
        let path = choice.path.clone();
        // Resolving here also makes a missing VecInfer calibration once, in this process, not in
        // a child whose peak RSS it would inflate; an unknown name fails before anything runs.
        let methods = resolve_methods(&args, &path)?;
        if isolate::wanted(&args) {
            isolate::measure(&args, &choice)?
        } else {
            measure_all(&args, &choice, methods).await?
        }
    };
    rows::derive(&mut rows);
    if !args.compare_llama_bench.is_empty() {
        let llama = llama::LlamaBench::read(&args.compare_llama_bench)?;
        for row in &mut rows {
            row.llama_cpp = llama.compare(row);
        }
    }
    println!("{}", table::render_table(&rows));
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&rows)?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("could not write {}", path.display()))?;
    }
    if let Some(path) = &args.plot {
        let font = plot::find_font(args.plot_font.as_deref())?;
        plot::register_font(&font)?;
        plot::draw(&rows, path)
            .with_context(|| format!("could not draw the plot {}", path.display()))?;
        eprintln!("wrote {}", path.display());
        let memory = memory_plot_path(path);
        plot::draw_memory(&rows, &memory)
            .with_context(|| format!("could not draw the plot {}", memory.display()))?;
        eprintln!("wrote {}", memory.display());
    }
    Ok(())
}

/// `OUT.png` -> `OUT-memory.png`, beside it.
fn memory_plot_path(path: &Path) -> PathBuf {
    let stem = path
        .file_stem()
        .map_or_else(|| "bench".into(), |s| s.to_string_lossy().into_owned());
    let ext = path
        .extension()
        .map_or_else(|| "png".into(), |e| e.to_string_lossy().into_owned());
    path.with_file_name(format!("{stem}-memory.{ext}"))
}

fn validate(args: &BenchArgs) -> anyhow::Result<()> {
    ensure!(!args.prompt_tokens.is_empty(), "--ctx is empty");
    ensure!(
        args.prompt_tokens.iter().all(|&n| n >= 1),
        "--ctx must be at least 1"
    );
    ensure!(!args.methods.is_empty(), "--methods is empty");
    ensure!(args.gen_tokens >= 1, "--gen-tokens must be at least 1");
    ensure!(
        args.prefill_chunk >= 1,
        "--prefill-chunk must be at least 1"
    );
    ensure!(args.repeats >= 1, "--repeats must be at least 1");
    ensure!(
        (1..=256).contains(&args.sequences),
        "--sequences must be between 1 and 256"
    );
    Ok(())
}

/// Every ctx plus the generated tokens must fit the model's context length `ctx`.
fn check_context(args: &BenchArgs, ctx: usize) -> anyhow::Result<()> {
    let g = args.gen_tokens;
    for &n in &args.prompt_tokens {
        ensure!(
            n + g <= ctx,
            "--ctx {n} + --gen-tokens {g} exceed the model's context length {ctx}: the deepest \
             ctx that leaves room for {g} generated tokens is {}",
            ctx.saturating_sub(g)
        );
    }
    Ok(())
}

/// `--methods` through the model's registry (built-in methods, VecInfer calibrated for the
/// model, and the presets).
fn resolve_methods(args: &BenchArgs, path: &Path) -> anyhow::Result<Vec<ResolvedCache>> {
    let mut registry = kvq_server::calibration::registry_for(path);
    super::presets::load(&mut registry, args.cache_presets.as_deref())?;
    args.methods
        .iter()
        .map(|m| {
            registry
                .resolve(&CacheSpec {
                    method: Some(m.clone()),
                    bits: None,
                })
                .with_context(|| format!("--methods {m}"))
        })
        .collect()
}

/// Measures every (method, ctx) pair in this process, methods outermost.
async fn measure_all(
    args: &BenchArgs,
    choice: &ModelChoice,
    methods: Vec<ResolvedCache>,
) -> anyhow::Result<Vec<BenchRow>> {
    let loaded = load_with_progress(choice, args.device).await?;
    let rss_loaded = memory::rss_bytes();
    check_context(args, loaded.model.config().context_length)?;
    let model_id = loaded.info.id.clone();
    let device = super::device::describe(loaded.model.device());
    let plan = Plan {
        sequences: args.sequences,
        shared_prompt: args.shared_prompt && args.sequences > 1,
        device,
        prompt_tokens: args.prompt_tokens.clone(),
        gen_tokens: args.gen_tokens,
        prefill_chunk: args.prefill_chunk,
        repeats: args.repeats,
        warmup: !args.no_warmup,
        seed: args.seed,
        isolated: methods.len() * args.prompt_tokens.len() == 1,
        rss_loaded,
    };
    tokio::task::spawn_blocking(move || {
        let mut rows = Vec::new();
        for m in &methods {
            for &n in &plan.prompt_tokens {
                let row = measure(&loaded.model, &model_id, m, n, &plan)?;
                eprintln!(
                    "{} ctx={n}: pp {:.1} tok/s, tg {:.1} tok/s, KV {:.2} MiB, peak RSS {}",
                    m.name,
                    row.pp_tps.median,
                    row.tg_tps.median,
                    memory::mib(row.kv_resident_bytes as f64),
                    row.peak_rss_bytes.map_or("-".into(), |b| {
                        format!("{:.1} MiB", memory::mib(b as f64))
                    }),
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
    sequences: usize,
    shared_prompt: bool,
    device: String,
    prompt_tokens: Vec<usize>,
    gen_tokens: usize,
    prefill_chunk: usize,
    repeats: usize,
    warmup: bool,
    seed: u64,
    /// One pair in this process: its RSS numbers are its own.
    isolated: bool,
    rss_loaded: Option<u64>,
}

/// Times of one chunked prefill of `n` random tokens and `g` greedy decode steps on fresh caches
/// of `sequences` sequences batched together, and those caches. With `shared`, one sequence is
/// prefilled and its caches copied to the others (timed with the prefill).
struct Run {
    prefill_s: f64,
    decode_s: f64,
    caches: Vec<LayerCaches>,
}

fn run_once(
    model: &Model,
    cache: &ResolvedCache,
    prompt: &[u32],
    chunk: usize,
    g: usize,
    sequences: usize,
    shared: bool,
) -> anyhow::Result<Run> {
    let prefilled = if shared { 1 } else { sequences };
    let mut caches = (0..prefilled)
        .map(|_| model.new_caches(cache.factory.as_ref()))
        .collect::<Result<Vec<_>, _>>()?;
    let t0 = Instant::now();
    let mut logits = Vec::new();
    for piece in prompt.chunks(chunk.max(1)) {
        let mut steps: Vec<SeqStep<'_>> = caches
            .iter_mut()
            .map(|c| SeqStep {
                tokens: piece,
                cache: c,
                all_logits: false,
            })
            .collect();
        logits = model.forward(&mut steps)?;
    }
    let mut next = greedy(&logits)?;
    if caches.len() < sequences {
        let copies = (caches.len()..sequences)
            .map(|_| caches[0].fork())
            .collect::<Result<Vec<_>, _>>()?;
        caches.extend(copies);
        next = vec![next[0]; sequences];
    }
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for _ in 0..g {
        let mut steps: Vec<SeqStep<'_>> = caches
            .iter_mut()
            .zip(&next)
            .map(|(c, t)| SeqStep {
                tokens: std::slice::from_ref(t),
                cache: c,
                all_logits: false,
            })
            .collect();
        let logits = model.forward(&mut steps)?;
        next = greedy(&logits)?;
    }
    let decode_s = t1.elapsed().as_secs_f64();
    Ok(Run {
        prefill_s,
        decode_s,
        caches,
    })
}

/// The most likely next token of each sequence (the pick reads the logits back, so the timings
/// include every step's device work).
fn greedy(logits: &[candle_core::Tensor]) -> anyhow::Result<Vec<u32>> {
    anyhow::ensure!(!logits.is_empty(), "the model returned no logits");
    logits
        .iter()
        .map(|l| {
            let row = l.flatten_all()?.to_vec1::<f32>()?;
            row.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(i, _)| i as u32)
                .context("empty logits")
        })
        .collect()
}

fn measure(
    model: &Model,
    model_id: &str,
    cache: &ResolvedCache,
    n: usize,
    plan: &Plan,
) -> anyhow::Result<BenchRow> {
    let started = Instant::now();
    let vocab = model.config().vocab_size as u32;
    let mut rng = StdRng::seed_from_u64(plan.seed ^ (n as u64).rotate_left(32));
    let prompt: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab)).collect();
    if plan.warmup {
        // One chunk warms every kernel of prefill and decode without doubling the cost of long
        // contexts; its caches are dropped at once.
        let head = &prompt[..n.min(plan.prefill_chunk)];
        run_once(
            model,
            cache,
            head,
            plan.prefill_chunk,
            plan.gen_tokens.min(4),
            plan.sequences,
            plan.shared_prompt,
        )?;
    }
    let mut pp = Vec::with_capacity(plan.repeats);
    let mut tg = Vec::with_capacity(plan.repeats);
    let mut last: Option<Run> = None;
    for i in 0..plan.repeats {
        // The previous run's caches go first, so two never coexist (peak RSS).
        drop(last.take());
        let r = run_once(
            model,
            cache,
            &prompt,
            plan.prefill_chunk,
            plan.gen_tokens,
            plan.sequences,
            plan.shared_prompt,
        )?;
        if n >= 2048 {
            eprintln!(
                "  {} ctx={n} run {}/{}: prefill {:.1} s, decode of {} tokens {:.1} s",
                cache.name,
                i + 1,
                plan.repeats,
                r.prefill_s,
                plan.gen_tokens,
                r.decode_s
            );
        }
        let seqs = plan.sequences as f64;
        let prefilled = if plan.shared_prompt { 1.0 } else { seqs };
        pp.push(prefilled * n as f64 / r.prefill_s);
        tg.push(seqs * plan.gen_tokens as f64 / r.decode_s);
        last = Some(r);
    }
    let last = last.context("no timed run")?;
    // Read while the last run's caches are still alive.
    let rss_end_bytes = memory::rss_bytes();
    let peak_rss_bytes = memory::peak_rss_bytes();
    let device_used_bytes = memory::device_used_bytes(model.device());
    Ok(BenchRow {
        engine: "kvq".into(),
        model: model_id.into(),
        method: cache.name.clone(),
        bits: cache.bits,
        prompt_tokens: n,
        gen_tokens: plan.gen_tokens,
        threads: candle_core::utils::get_num_threads(),
        sequences: plan.sequences,
        shared_prompt: plan.shared_prompt,
        device: plan.device.clone(),
        prefill_chunk: plan.prefill_chunk,
        pp_tps: Stats::new(pp).context("no prefill timing")?,
        tg_tps: Stats::new(tg).context("no decode timing")?,
        tg_vs_fp16: None,
        kv_resident_bytes: last.caches.iter().map(LayerCaches::resident_bytes).sum(),
        kv_tokens: last.caches.iter().map(LayerCaches::len).sum(),
        kv_bytes_per_token: 0.0,
        kv_vs_fp16: None,
        rss_loaded_bytes: plan.rss_loaded,
        rss_end_bytes,
        peak_rss_bytes,
        device_used_bytes,
        isolated: plan.isolated,
        measure_s: started.elapsed().as_secs_f64(),
        child_wall_s: None,
        llama_cpp: None,
    })
}

/// `--isolate`: one child process per (method, ctx), rows merged.
mod isolate;
/// `--compare-llama-bench`: llama.cpp's numbers beside each row.
mod llama;
/// VmRSS and VmHWM of this process.
mod memory;
/// The PNG charts: tokens/s (prompt and decode) and memory (KV cache and peak RSS), one bar per
/// engine and method, grouped by ctx (its font helpers are shared with `kvq eval`).
pub(super) mod plot;
/// `--from-json` merging and the fields derived across rows (ratios to fp16).
mod rows;
/// The summary line and the table.
mod table;
#[cfg(test)]
mod tests;
