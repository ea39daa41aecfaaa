//! `--isolate`: the parent re-runs this executable once per (method, ctx) pair, narrowed to that
//! pair and writing its rows to a temporary `--json`, then merges the rows. Peak RSS (VmHWM) is
//! per process, so only this way is each row's RSS that method's alone (the model and its cache).
//! Children inherit stderr, so their progress shows; their stdout (the table) is dropped.

use super::{BenchArgs, BenchRow};
use anyhow::{Context, ensure};
use kvq_models::model::ModelConfig;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

/// Whether to isolate: `--isolate` / `--no-isolate` (the last given wins), else when more than
/// one pair is measured.
pub(super) fn wanted(args: &BenchArgs) -> bool {
    if args.no_isolate {
        false
    } else {
        args.isolate || args.methods.len() * args.prompt_tokens.len() > 1
    }
}

/// The arguments of the child measuring `method` at `ctx`: the parent's options narrowed to that
/// pair, without reporting (`--plot`, `--compare-llama-bench`), in this process (`--no-isolate`).
pub(super) fn child_args(
    args: &BenchArgs,
    choice: &super::super::model::ModelChoice,
    method: &str,
    ctx: usize,
    json: &Path,
) -> Vec<OsString> {
    let mut a: Vec<OsString> = vec!["bench".into(), "--no-isolate".into()];
    let mut opt = |name: &str, value: OsString| {
        a.push(name.into());
        a.push(value);
    };
    opt("--model", choice.path.as_os_str().into());
    if let Some(id) = &choice.id {
        opt("--model-id", id.into());
    }
    opt("--methods", method.into());
    opt("--ctx", ctx.to_string().into());
    opt("--gen-tokens", args.gen_tokens.to_string().into());
    opt("--sequences", args.sequences.to_string().into());
    opt("--device", args.device.to_string().into());
    opt("--repeats", args.repeats.to_string().into());
    opt("--seed", args.seed.to_string().into());
    opt("--prefill-chunk", args.prefill_chunk.to_string().into());
    opt("--json", json.into());
    if let Some(dir) = &args.cache_presets {
        opt("--cache-presets", dir.into());
    }
    if args.no_warmup {
        a.push("--no-warmup".into());
    }
    if args.shared_prompt {
        a.push("--shared-prompt".into());
    }
    a
}

/// A scratch directory removed when dropped (also when a child fails).
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The model's context length from its metadata alone (GGUF header or config.json), so a ctx
/// too deep fails before any child runs; `None` when it cannot be read (the children check).
pub(super) fn context_length(model: &Path) -> Option<usize> {
    let cfg = if model.is_dir() {
        ModelConfig::from_hf_json(&std::fs::read_to_string(model.join("config.json")).ok()?)
    } else {
        let mut file = std::fs::File::open(model).ok()?;
        let content = candle_core::quantized::gguf_file::Content::read(&mut file).ok()?;
        ModelConfig::from_gguf(&content)
    };
    cfg.ok().map(|c| c.context_length)
}

/// Measures every (method, ctx) pair in a child process of its own, methods outermost.
pub(super) fn measure(
    args: &BenchArgs,
    choice: &super::super::model::ModelChoice,
) -> anyhow::Result<Vec<BenchRow>> {
    let model = choice.path.as_path();
    if let Some(ctx) = context_length(model) {
        super::check_context(args, ctx)?;
    }
    let exe = std::env::current_exe().context("could not find this executable to re-run")?;
    let dir = std::env::temp_dir().join(format!("kvq-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("could not create {}", dir.display()))?;
    let dir = Scratch(dir);
    let pairs: Vec<(&str, usize)> = args
        .methods
        .iter()
        .flat_map(|m| args.prompt_tokens.iter().map(move |&n| (m.as_str(), n)))
        .collect();
    let total = pairs.len();
    let started = Instant::now();
    let mut rows = Vec::new();
    for (i, (method, ctx)) in pairs.into_iter().enumerate() {
        let json = dir.0.join(format!("{i}.json"));
        let tag = format!("[{}/{total}] {method} ctx={ctx}", i + 1);
        eprintln!("{tag}: measuring in a child process");
        let t0 = Instant::now();
        let status = Command::new(&exe)
            .args(child_args(args, choice, method, ctx, &json))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .status()
            .with_context(|| format!("could not start {}", exe.display()))?;
        let secs = t0.elapsed().as_secs_f64();
        ensure!(
            status.success(),
            "{tag}: the child process failed ({status}) after {secs:.1} s"
        );
        let text = std::fs::read_to_string(&json)
            .with_context(|| format!("{tag}: the child wrote no {}", json.display()))?;
        let mut child: Vec<BenchRow> = serde_json::from_str(&text)
            .with_context(|| format!("{tag}: {} is not a bench output", json.display()))?;
        ensure!(!child.is_empty(), "{tag}: the child measured no row");
        for r in &mut child {
            r.child_wall_s = Some(secs);
        }
        let peak = child[0].peak_rss_bytes.map_or("-".into(), |b| {
            format!("{:.1} MiB", super::memory::mib(b as f64))
        });
        eprintln!("{tag}: child done in {secs:.1} s (peak RSS {peak})");
        rows.extend(child);
    }
    eprintln!(
        "{total} child process(es) in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(rows)
}
