//! Finding the model to load (the default one or `--model`) and loading it with an indicatif
//! progress bar on stderr.

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use kvq_models::LoadedModel;
use std::path::PathBuf;

/// `--model` if given, else the default model, which must exist.
pub fn resolve_model_path(model: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(path) = model {
        return Ok(path);
    }
    let path = kvq_models::default_model_path();
    if !path.exists() {
        bail!(
            "the default model {} is missing: run `scripts/fetch-models` to download it \
             (or set KVQ_MODELS_DIR, or pass --model PATH)",
            path.display()
        );
    }
    Ok(path)
}

/// Loads `path` onto `device` on a blocking thread, showing tensors loaded as a progress bar.
pub async fn load_with_progress(
    path: PathBuf,
    device: super::device::DeviceArg,
) -> anyhow::Result<LoadedModel> {
    let device = device.resolve()?;
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{spinner} loading {msg} [{bar:30}] {pos}/{len} tensors")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    ));
    let task_bar = bar.clone();
    let task_path = path.clone();
    let started = std::time::Instant::now();
    let model = tokio::task::spawn_blocking(move || {
        kvq_models::load_on(&task_path, &device, &mut |done, total| {
            if task_bar.length() != Some(total) {
                task_bar.set_length(total);
            }
            task_bar.set_position(done);
        })
    })
    .await
    .context("the model loading task failed")?;
    bar.finish_and_clear();
    let model = model.with_context(|| format!("could not load the model {}", path.display()))?;
    tracing::info!(
        model = %model.info.id,
        architecture = %model.info.architecture,
        layers = model.info.n_layers,
        context = model.info.context_length,
        secs = format_args!("{:.2}", started.elapsed().as_secs_f64()),
        "model loaded"
    );
    Ok(model)
}
