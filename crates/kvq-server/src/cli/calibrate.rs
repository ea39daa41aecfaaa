//! `kvq calibrate`: runs the model over a text with capturing caches and trains VecInfer's
//! smoothing factors and k-means codebooks (both sub_dims, 4 and 8) with progress bars; writes
//! `vecinfer.safetensors` and `vecinfer.json` to `--out`, by default where the server looks for
//! them: `$KVQ_CACHE_DIR` (or `~/.cache/kvq`) `/calibration/<model sha256>/`.

use super::model::{load_with_progress, resolve_model};
use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use kvq_cache::methods::vecinfer::calibration::Smoothing;
use kvq_server::calibration::{
    CalibrateOptions, Source, Stage, cache_dir, calibrate, calibration_dir, file_stem, model_hash,
};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, Args)]
pub struct CalibrateArgs {
    /// A GGUF file, a Hugging Face model directory, or a Hub id (org/repo[:QUANT][@REVISION])
    /// (default: SmolLM2-135M-Instruct).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The text to run (plain UTF-8). Never calibrate on the text you evaluate on.
    #[arg(long)]
    pub text: PathBuf,
    /// Directory for the two files [default: $KVQ_CACHE_DIR or ~/.cache/kvq, then
    /// calibration/<model sha256>/, where the server looks].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Most tokens of the text to run.
    #[arg(long, default_value_t = CalibrateOptions::full().tokens)]
    pub tokens: usize,
    /// Sub-vectors sampled per k-means run.
    #[arg(long, default_value_t = CalibrateOptions::full().kmeans_samples)]
    pub samples: usize,
    /// Most Lloyd iterations per k-means run.
    #[arg(long, default_value_t = CalibrateOptions::full().kmeans_iters)]
    pub iters: usize,
    /// Hadamard rotation seed (a preset's `seed` parameter) [default: the built-in one].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Key smoothing: VecInfer's sqrt(max|K|) (key-max), SmoothQuant's sqrt(max|K| / max|Q|)
    /// (balanced), 1 / rms(Q) (query-rms) or none (off).
    #[arg(long, value_enum, default_value_t = SmoothingArg::KeyMax)]
    pub smoothing: SmoothingArg,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SmoothingArg {
    KeyMax,
    Balanced,
    QueryRms,
    Off,
}

impl From<SmoothingArg> for Smoothing {
    fn from(s: SmoothingArg) -> Self {
        match s {
            SmoothingArg::KeyMax => Smoothing::KeyMax,
            SmoothingArg::Balanced => Smoothing::Balanced,
            SmoothingArg::QueryRms => Smoothing::QueryRms,
            SmoothingArg::Off => Smoothing::Off,
        }
    }
}

fn bar(len: u64, what: &str) -> ProgressBar {
    let b = ProgressBar::new(len);
    b.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    b.set_message(what.to_string());
    b
}

pub async fn run(args: CalibrateArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.tokens >= 16, "--tokens must be at least 16");
    anyhow::ensure!(
        args.samples >= 256,
        "--samples must be at least 256 (one per centroid)"
    );
    anyhow::ensure!(args.iters >= 1, "--iters must be at least 1");
    let text = std::fs::read_to_string(&args.text)
        .with_context(|| format!("could not read the text {}", args.text.display()))?;
    let text_name = args.text.file_name().map_or_else(
        || args.text.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let choice = resolve_model(args.model.as_deref()).await?;
    let path = choice.path.clone();
    let hashing = bar(0, "hashing the model");
    hashing.enable_steady_tick(std::time::Duration::from_millis(120));
    let hash_path = path.clone();
    let hash = tokio::task::spawn_blocking(move || model_hash(&hash_path))
        .await
        .context("the hashing task failed")?
        .with_context(|| format!("could not hash the model {}", path.display()))?;
    hashing.finish_and_clear();
    let model = load_with_progress(&choice, super::device::DeviceArg::Cpu).await?;
    let opts = CalibrateOptions {
        tokens: args.tokens,
        kmeans_samples: args.samples,
        kmeans_iters: args.iters,
        seed: args
            .seed
            .unwrap_or(kvq_cache::methods::vecinfer::DEFAULT_SEED),
        smoothing: args.smoothing.into(),
        ..CalibrateOptions::full()
    };
    let dir = args
        .out
        .clone()
        .unwrap_or_else(|| calibration_dir(&cache_dir(), &hash));
    let started = Instant::now();
    let task_hash = hash.clone();
    let cal = tokio::task::spawn_blocking(move || {
        let (tokens, layers) = (bar(0, "running the model"), bar(0, "k-means per layer"));
        let mut progress = |stage: Stage, done: u64, total: u64| {
            let b = match stage {
                Stage::Model => &tokens,
                Stage::KMeans => {
                    tokens.finish_and_clear();
                    &layers
                }
            };
            b.set_length(total);
            b.set_position(done);
        };
        let src = Source {
            model_hash: &task_hash,
            text: &text,
            text_name: &text_name,
        };
        let cal = calibrate(&model, &src, &opts, &mut progress);
        layers.finish_and_clear();
        cal
    })
    .await
    .context("the calibration task failed")?
    .context("calibration failed")?;
    let (st, json) = cal
        .write(&dir, &file_stem(cal.meta.seed))
        .context("could not write the calibration")?;
    eprintln!(
        "calibrated {} ({} layers, sub_dims {:?}) on {} tokens of {} in {:.1}s\nwrote {}\nwrote {}",
        cal.meta.model_name,
        cal.meta.n_layers,
        cal.meta.sub_dims,
        cal.meta.tokens,
        cal.meta.text_name,
        started.elapsed().as_secs_f64(),
        st.display(),
        json.display()
    );
    if args.out.is_some() {
        eprintln!(
            "the server looks in {}",
            calibration_dir(&cache_dir(), &hash).display()
        );
    }
    Ok(())
}
