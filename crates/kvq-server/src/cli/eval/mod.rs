//! `kvq eval`: perplexity per KV cache method, with llama.cpp's `llama-perplexity` protocol
//! (chunks of `--ctx` tokens on fresh caches, the second half of each scored), against the fp16
//! cache as the baseline (delta, mean KL divergence, same top token); printed as a table,
//! written as JSON rows and drawn as a PNG (delta vs bits per element).

mod plot;
mod ppl;
#[cfg(test)]
mod tests;

use super::model::{load_with_progress, resolve_model};
use anyhow::{Context, bail, ensure};
use clap::Args;
use comfy_table::{Cell, CellAlignment, Table, presets::ASCII_MARKDOWN};
use indicatif::{ProgressBar, ProgressStyle};
use kvq_cache::{CacheRegistry, CacheSpec, ResolvedCache};
use kvq_models::model::Model;
use kvq_server::calibration::registry_for;
use ppl::{Acc, PIECE, feed, make_chunks, score_chunk, scored_range, split_pieces};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Instant;

/// The method every run evaluates first, as the baseline.
const BASELINE: &str = "fp16";

#[derive(Debug, Args)]
pub struct EvalArgs {
    /// A GGUF file, a Hugging Face model directory, or a Hub id (org/repo[:QUANT][@REVISION])
    /// (default: SmolLM2-135M-Instruct).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Where the model and its KV caches run: cpu, cuda, cuda:N, metal or auto (CUDA when
    /// this binary has it and a GPU answers, else the CPU).
    #[arg(long, default_value = "auto")]
    pub device: crate::cli::device::DeviceArg,
    /// The text to score (UTF-8), tokenized whole once.
    #[arg(long, required_unless_present = "replot")]
    pub text: Option<PathBuf>,
    /// Tokens per chunk (llama-perplexity's `-c`); the second half of each chunk is scored.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// KV cache methods, comma-separated registry names, each optionally `name@bits`
    /// (e.g. `fp16,turboquant-mse@3`). fp16 is always evaluated first, as the baseline.
    #[arg(long, value_delimiter = ',', default_value = BASELINE)]
    pub methods: Vec<String>,
    /// Evaluate at most this many chunks (llama-perplexity's `--chunks`).
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Most tokens per forward call. Any split gives every cache the state of one-token
    /// generation; pieces under 32 tokens also run the dense layers with the one-token kernel
    /// (Q8_1) instead of the f32 GEMM of longer pieces: bit-identical to generation, slower.
    #[arg(long, default_value_t = PIECE)]
    pub piece: usize,
    /// Directory of cache presets [default: configs/cache when it exists].
    #[arg(long)]
    pub cache_presets: Option<PathBuf>,
    /// Write the rows as a JSON list to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw a PNG of the perplexity delta vs bits per element to this file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// A TrueType font for the plot's text (default: DejaVu Sans or Liberation Sans from
    /// /usr/share/fonts; env KVQ_PLOT_FONT).
    #[arg(long, env = "KVQ_PLOT_FONT")]
    pub plot_font: Option<PathBuf>,
    /// Draw `--plot` from the rows of an earlier `--json` instead of evaluating (give the
    /// `--ctx` it was made at, for llama.cpp's q4_0 reference line).
    #[arg(long, requires = "plot", conflicts_with = "text")]
    pub replot: Option<PathBuf>,
    /// With `--replot`: the model the rows are from (llama.cpp's q4_0 line is drawn for the
    /// default model only, where it was measured).
    #[arg(long, default_value = "SmolLM2-135M-Instruct")]
    pub replot_model: String,
}

/// One method's result, as `--json` writes it (exactly these keys).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalRow {
    /// The resolved method name, plus `@bits` when bits were given.
    pub method: String,
    /// Bits per key element the cache holds after a chunk (codes, norms, window, sinks).
    pub key_bits: f64,
    /// Bits per value element, likewise.
    pub value_bits: f64,
    pub ppl: f64,
    /// (ppl / fp16's ppl - 1) * 100.
    pub delta_pct: f64,
    /// Resident cache bytes after a chunk / the chunk's tokens.
    pub kv_bytes_per_token: f64,
}

/// A method to evaluate: its label and its factory.
pub struct Method {
    pub label: String,
    pub cache: ResolvedCache,
}

/// What one method accumulated over every chunk.
#[derive(Debug, Clone, Default)]
pub struct MethodResult {
    pub acc: Acc,
    /// Seconds spent in forward passes and scoring.
    pub secs: f64,
    /// (key, value) bytes the cache held after the last chunk.
    pub key_bytes: usize,
    pub value_bytes: usize,
}

/// Parses `--methods` (`name` or `name@bits`), resolves each through the registry and puts the
/// fp16 baseline first; a method listed twice (same name and bits) is evaluated once.
pub fn parse_methods(list: &[String], registry: &CacheRegistry) -> anyhow::Result<Vec<Method>> {
    let resolve = |item: &str| -> anyhow::Result<Method> {
        let (name, bits) = match item.split_once('@') {
            Some((n, b)) => {
                let b: u8 = b
                    .trim()
                    .parse()
                    .with_context(|| format!("--methods {item}: bits must be a number"))?;
                (n, Some(b))
            }
            None => (item, None),
        };
        let cache = registry
            .resolve(&CacheSpec {
                method: Some(name.to_string()),
                bits,
            })
            .with_context(|| format!("--methods {item}"))?;
        let label = match bits {
            Some(b) => format!("{}@{b}", cache.name),
            None => cache.name.clone(),
        };
        Ok(Method { label, cache })
    };
    let mut out = vec![resolve(BASELINE)?];
    for item in list.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        let m = resolve(item)?;
        let dup = out
            .iter()
            .any(|o| o.cache.name == m.cache.name && o.cache.bits == m.cache.bits);
        if !dup {
            out.push(m);
        }
    }
    Ok(out)
}

pub async fn run(args: EvalArgs) -> anyhow::Result<()> {
    if let (Some(json), Some(out)) = (&args.replot, &args.plot) {
        let text = std::fs::read_to_string(json)
            .with_context(|| format!("could not read {}", json.display()))?;
        let rows: Vec<EvalRow> = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a `kvq eval --json` file", json.display()))?;
        let font = super::bench::plot::find_font(args.plot_font.as_deref())?;
        let file = json.file_name().map_or_else(
            || json.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        let title = format!(
            "{}: perplexity vs KV cache bits, ctx {} (from {file})",
            args.replot_model, args.ctx
        );
        plot::draw(&rows, out, &font, &title, &args.replot_model, args.ctx)
            .with_context(|| format!("could not draw the plot {}", out.display()))?;
        eprintln!("wrote {}", out.display());
        return Ok(());
    }
    let Some(text_path) = &args.text else {
        bail!("--text is needed unless --replot is given");
    };
    let choice = resolve_model(args.model.as_deref()).await?;
    // VecInfer finds (or makes, on first use) the calibration of this model on its own.
    let mut registry = registry_for(&choice.path);
    super::presets::load(&mut registry, args.cache_presets.as_deref())?;
    let methods = parse_methods(&args.methods, &registry)?;
    let text = std::fs::read_to_string(text_path)
        .with_context(|| format!("could not read {}", text_path.display()))?;
    // Find the plot's font before the long run, not after it.
    let font = match &args.plot {
        Some(_) => Some(super::bench::plot::find_font(args.plot_font.as_deref())?),
        None => None,
    };
    let loaded = load_with_progress(&choice, args.device).await?;
    let ctx = args.ctx;
    let model_ctx = loaded.model.config().context_length;
    ensure!(
        ctx <= model_ctx,
        "--ctx {ctx} exceeds the model's context length {model_ctx}"
    );
    // llama.cpp: common_tokenize(text, add_special = true), then BOS on each chunk's first
    // token iff the vocabulary adds BOS (GGUF tokenizer.ggml.add_bos_token).
    let tok = &loaded.tokenizer;
    let tokens = tok
        .encode(&text, true)
        .context("could not tokenize the text")?;
    let bos = if tok.adds_bos_token() {
        tok.bos_token_id()
    } else {
        None
    };
    let chunks = make_chunks(&tokens, ctx, args.chunks, bos)?;
    ensure!(args.piece >= 1, "--piece must be at least 1");
    let piece = args.piece;
    eprintln!(
        "{}: {} tokens, {} chunks of {ctx} fed in pieces of at most {piece}, {} scored \
         positions each, BOS per chunk: {}",
        loaded.info.id,
        tokens.len(),
        chunks.len(),
        scored_range(ctx).len(),
        bos.map_or("no".to_string(), |b| format!("yes ({b})")),
    );

    let bar = ProgressBar::new((chunks.len() * methods.len()) as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} {msg} [{bar:30}] {pos}/{len} ({elapsed}, eta {eta})",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let task_bar = bar.clone();
    let labels: Vec<String> = methods.iter().map(|m| m.label.clone()).collect();
    let bar_labels = labels.clone();
    let n_chunks = chunks.len();
    let cfg = loaded.model.config().clone();
    let model_id = loaded.info.id.clone();
    let results = tokio::task::spawn_blocking(move || {
        evaluate(
            &loaded.model,
            &chunks,
            &methods,
            piece,
            &mut |ci, mi, base| {
                task_bar.set_message(format!(
                    "chunk {}/{n_chunks} {} (fp16 PPL so far {:.3})",
                    ci + 1,
                    bar_labels[mi],
                    base.ppl()
                ));
                task_bar.inc(1);
            },
        )
    })
    .await
    .context("the evaluation task failed")?;
    bar.finish_and_clear();
    let results = results?;
    let elems = ctx * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim;
    let rows = make_rows(&labels, &results, ctx, elems);
    for (label, r) in labels.iter().zip(&results) {
        eprintln!(
            "{label}: {:.1} s for {n_chunks} chunks ({:.2} s per chunk)",
            r.secs,
            r.secs / n_chunks as f64
        );
    }
    println!("{}", render_table(&rows, &results));
    println!(
        "ctx {ctx}; bits/elem count every byte the cache holds after a chunk of {ctx} tokens \
         (codes, norms, scales, fp16 window and sinks amortized over {ctx}); PPL ± as \
         llama-perplexity; KLD and same top vs fp16 over the same positions."
    );
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&rows)?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("could not write {}", path.display()))?;
    }
    if let (Some(path), Some(font)) = (&args.plot, &font) {
        let title =
            format!("{model_id}: perplexity vs KV cache bits, ctx {ctx}, {n_chunks} chunks");
        plot::draw(&rows, path, font, &title, &model_id, ctx)
            .with_context(|| format!("could not draw the plot {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// Evaluates every chunk with every method, chunk-outer and method-inner, each chunk on fresh
/// caches; the first method is the baseline the others' log-probabilities are compared with.
/// Chunks are fed in pieces of at most `piece` tokens; `progress(chunk, method, baseline so
/// far)` after each (chunk, method).
pub fn evaluate(
    model: &Model,
    chunks: &[Vec<u32>],
    methods: &[Method],
    piece: usize,
    progress: &mut dyn FnMut(usize, usize, &Acc),
) -> anyhow::Result<Vec<MethodResult>> {
    let vocab = model.config().vocab_size;
    let mut results = vec![MethodResult::default(); methods.len()];
    for (ci, chunk) in chunks.iter().enumerate() {
        let pieces = split_pieces(chunk.len(), piece);
        let mut base: Option<Vec<f32>> = None;
        for (mi, m) in methods.iter().enumerate() {
            let t0 = Instant::now();
            let mut caches = model.new_caches(m.cache.factory.as_ref())?;
            let rows = feed(
                model,
                &mut caches,
                chunk,
                &pieces,
                scored_range(chunk.len()),
            )
            .with_context(|| format!("{}: chunk {}", m.label, ci + 1))?;
            let r = &mut results[mi];
            let logp = score_chunk(chunk, vocab, rows, base.as_deref(), &mut r.acc)?;
            r.secs += t0.elapsed().as_secs_f64();
            (r.key_bytes, r.value_bytes) = caches.resident_split();
            drop(caches);
            if mi == 0 {
                base = Some(logp);
            }
            progress(ci, mi, &results[0].acc);
        }
    }
    Ok(results)
}

/// The JSON rows; `elems` is the number of key (or value) elements of one chunk
/// (ctx * layers * kv heads * head_dim).
pub fn make_rows(
    labels: &[String],
    results: &[MethodResult],
    ctx: usize,
    elems: usize,
) -> Vec<EvalRow> {
    let base = results.first().map_or(f64::NAN, |r| r.acc.ppl());
    let bits = |bytes: usize| bytes as f64 * 8.0 / elems.max(1) as f64;
    labels
        .iter()
        .zip(results)
        .map(|(label, r)| {
            let ppl = r.acc.ppl();
            EvalRow {
                method: label.clone(),
                key_bits: bits(r.key_bytes),
                value_bits: bits(r.value_bytes),
                ppl,
                delta_pct: (ppl / base - 1.0) * 100.0,
                kv_bytes_per_token: (r.key_bytes + r.value_bytes) as f64 / ctx.max(1) as f64,
            }
        })
        .collect()
}

/// The table: one row per method, the baseline first.
pub fn render_table(rows: &[EvalRow], results: &[MethodResult]) -> String {
    let mut table = Table::new();
    table.load_style(ASCII_MARKDOWN).set_header(vec![
        "method",
        "key bits/elem",
        "value bits/elem",
        "PPL",
        "Δ vs fp16",
        "KV bytes/token",
        "KLD vs fp16",
        "same top",
        "time",
    ]);
    for (i, (row, r)) in rows.iter().zip(results).enumerate() {
        let ppl = match r.acc.ppl_err() {
            Some(e) => format!("{:.4} ± {e:.4}", row.ppl),
            None => format!("{:.4}", row.ppl),
        };
        let (kld, top) = if i == 0 {
            ("baseline".to_string(), "baseline".to_string())
        } else {
            (
                r.acc.mean_kld().map_or("-".into(), |k| format!("{k:.6}")),
                r.acc
                    .same_top_pct()
                    .map_or("-".into(), |p| format!("{p:.2}%")),
            )
        };
        table.add_row(vec![
            Cell::new(&row.method),
            Cell::new(format!("{:.3}", row.key_bits)),
            Cell::new(format!("{:.3}", row.value_bits)),
            Cell::new(ppl),
            Cell::new(format!("{:+.2}%", row.delta_pct)),
            Cell::new(format!("{:.1}", row.kv_bytes_per_token)),
            Cell::new(kld),
            Cell::new(top),
            Cell::new(format!("{:.1} s", r.secs)),
        ]);
    }
    for i in 1..table.column_count() {
        if let Some(c) = table.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    table.to_string()
}
