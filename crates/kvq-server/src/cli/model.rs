//! Finding the model to load (the default one or `--model`: a path, or a Hugging Face Hub id
//! made local by kvq-hub) and loading it with an indicatif progress bar on stderr.

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use kvq_hub::{HubConfig, ModelSpec};
use kvq_models::LoadedModel;
use std::path::{Path, PathBuf};

/// The model to load: where its files are, and the id to serve it under when that is not the
/// loader's own (a Hub id is served under the id the user gave).
#[derive(Debug, Clone)]
pub struct ModelChoice {
    pub path: PathBuf,
    pub id: Option<String>,
}

/// `--model` if given (an existing path as it is; a Hub id downloaded into, or found in, the
/// hub cache), else the default model, which must exist.
pub async fn resolve_model(model: Option<&Path>) -> anyhow::Result<ModelChoice> {
    let Some(model) = model else {
        let path = kvq_models::default_model_path();
        if !path.exists() {
            bail!(
                "the default model {} is missing: run `scripts/fetch-models` to download it \
                 (or set KVQ_MODELS_DIR, or pass --model PATH or --model org/repo)",
                path.display()
            );
        }
        return Ok(ModelChoice { path, id: None });
    };
    // A path that exists needs no UTF-8; everything else is text to parse.
    let spec = match model.to_str() {
        _ if model.exists() => ModelSpec::Local(model.to_path_buf()),
        Some(text) => kvq_hub::parse_model_spec(text)?,
        None => bail!("{}: no such file or directory", model.display()),
    };
    match spec {
        ModelSpec::Local(path) => Ok(ModelChoice { path, id: None }),
        ModelSpec::Hub(id) => {
            let cfg = HubConfig::from_env()?;
            let started = std::time::Instant::now();
            let resolved = kvq_hub::resolve(&cfg, &id).await?;
            tracing::info!(
                model = %resolved.id,
                commit = %resolved.commit,
                path = %resolved.path.display(),
                downloaded_mib = format_args!("{:.1}", resolved.downloaded as f64 / 1048576.0),
                secs = format_args!("{:.2}", started.elapsed().as_secs_f64()),
                "model files ready{}",
                if resolved.from_cache { " (from the hub cache, offline)" } else { "" }
            );
            Ok(ModelChoice {
                path: resolved.path,
                id: Some(resolved.id),
            })
        }
    }
}

/// Loads `choice` onto `device` on a blocking thread, showing tensors loaded as a progress bar.
pub async fn load_with_progress(
    choice: &ModelChoice,
    device: super::device::DeviceArg,
) -> anyhow::Result<LoadedModel> {
    let device = device.resolve()?;
    let path = choice.path.clone();
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{spinner} loading {msg} [{bar:30}] {pos}/{len} tensors")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(choice.id.clone().unwrap_or_else(|| {
        path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        )
    }));
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
    let mut model =
        model.with_context(|| format!("could not load the model {}", path.display()))?;
    if let Some(id) = &choice.id {
        model.info.id = id.clone();
    }
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
