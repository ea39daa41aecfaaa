//! Running a calibration: the model reads a text through capturing caches (exact f32 attention,
//! every post-RoPE key and value recorded), then each layer's smoothing factors and k-means
//! codebooks are trained from what it captured.

use super::CalibrateError;
use kvq_cache::codec::kmeans::KMeansConfig;
use kvq_cache::methods::vecinfer::calibration::{
    CalibrationMeta, FORMAT, Smoothing, TrainOptions, VecInferCalibration, train_layer, utc_now,
};
use kvq_cache::methods::vecinfer::capture::CaptureFactory;
use kvq_cache::methods::vecinfer::codec::CENTROIDS;
use kvq_cache::methods::vecinfer::{DEFAULT_SEED, METHOD};
use kvq_models::LoadedModel;
use kvq_models::model::SeqStep;
use std::time::Instant;

/// How much text and how much k-means work a calibration does.
#[derive(Debug, Clone, PartialEq)]
pub struct CalibrateOptions {
    /// Most tokens of the text to run (the text is cut there).
    pub tokens: usize,
    /// Tokens per forward pass.
    pub chunk: usize,
    /// The text runs as independent sequences of at most this many tokens (keys far into a
    /// long sequence are not what a typical context holds).
    pub seq_len: usize,
    /// Sub-vectors per k-means run (a random subset of all captured ones).
    pub kmeans_samples: usize,
    /// Most Lloyd iterations per k-means run.
    pub kmeans_iters: usize,
    /// Rotation seed (the caches' `seed` parameter).
    pub seed: u64,
    /// Sub-vector lengths to train codebooks for (4: 2-bit, 8: 1-bit).
    pub sub_dims: Vec<usize>,
    /// How the key smoothing factors are chosen.
    pub smoothing: Smoothing,
    /// One codebook per sub-position (else one per layer).
    pub per_position: bool,
}

impl CalibrateOptions {
    /// `kvq calibrate`'s defaults: 8192 tokens (as 4 sequences of 2048), 16384 samples per
    /// codebook, up to 10 Lloyd iterations.
    pub fn full() -> Self {
        Self {
            tokens: 8192,
            chunk: 512,
            seq_len: 2048,
            kmeans_samples: 16_384,
            kmeans_iters: 10,
            seed: DEFAULT_SEED,
            sub_dims: vec![4, 8],
            smoothing: Smoothing::KeyMax,
            per_position: true,
        }
    }

    /// The server's first-use calibration: small enough to finish in seconds on two cores.
    pub fn first_use() -> Self {
        Self {
            tokens: 2048,
            kmeans_samples: 4096,
            kmeans_iters: 8,
            ..Self::full()
        }
    }
}

/// What a calibration is doing, for progress reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Running the model over the text (progress in tokens).
    Model,
    /// Training codebooks (progress in layers).
    KMeans,
}

/// Where the text and the model come from, for the metadata.
pub struct Source<'a> {
    pub model_hash: &'a str,
    pub text: &'a str,
    pub text_name: &'a str,
}

/// Calibrates VecInfer for `model` on `src.text`; `progress(stage, done, total)` as it goes.
pub fn calibrate(
    model: &LoadedModel,
    src: &Source<'_>,
    opts: &CalibrateOptions,
    progress: &mut dyn FnMut(Stage, u64, u64),
) -> Result<VecInferCalibration, CalibrateError> {
    let started = Instant::now();
    let mut ids = model.tokenizer.encode(src.text, true)?;
    ids.truncate(opts.tokens);
    if ids.len() < 16 {
        return Err(CalibrateError::Invalid(format!(
            "{} has only {} tokens; calibration needs at least 16",
            src.text_name,
            ids.len()
        )));
    }
    let factory = CaptureFactory::new(opts.smoothing.needs_queries());
    let total = ids.len() as u64;
    let mut done = 0u64;
    progress(Stage::Model, 0, total);
    // A long text runs as several sequences.
    let seq_len = opts.seq_len.min(model.info.context_length).max(1);
    for seq in ids.chunks(seq_len) {
        let mut caches = model.model.new_caches(&factory)?;
        for chunk in seq.chunks(opts.chunk.max(1)) {
            model.model.forward(&mut [SeqStep {
                tokens: chunk,
                cache: &mut caches,
                all_logits: false,
            }])?;
            done += chunk.len() as u64;
            progress(Stage::Model, done, total);
        }
    }
    let captured = factory.take();
    tracing::info!(
        tokens = done,
        secs = format_args!("{:.1}", started.elapsed().as_secs_f64()),
        "calibration: keys and values captured"
    );
    let train = TrainOptions {
        sub_dims: opts.sub_dims.clone(),
        kmeans: KMeansConfig {
            k: CENTROIDS,
            iters: opts.kmeans_iters,
            max_samples: opts.kmeans_samples,
            ..KMeansConfig::default()
        },
        seed: opts.seed,
        smoothing: opts.smoothing,
        per_position: opts.per_position,
    };
    let n = captured.len() as u64;
    progress(Stage::KMeans, 0, n);
    let mut layers = Vec::with_capacity(captured.len());
    for (i, cap) in captured.iter().enumerate() {
        layers.push(train_layer(i, cap, &train)?);
        progress(Stage::KMeans, i as u64 + 1, n);
    }
    tracing::info!(
        layers = n,
        secs = format_args!("{:.1}", started.elapsed().as_secs_f64()),
        "calibration: codebooks trained"
    );
    let info = &model.info;
    let cal = VecInferCalibration {
        meta: CalibrationMeta {
            format: FORMAT,
            method: METHOD.into(),
            model_hash: src.model_hash.into(),
            model_name: info.id.clone(),
            text_name: src.text_name.into(),
            text_sha256: super::sha256_hex(src.text.as_bytes()),
            tokens: ids.len(),
            sub_dims: opts.sub_dims.clone(),
            centroids: CENTROIDS,
            seed: opts.seed,
            smoothing: opts.smoothing.name().into(),
            per_position: opts.per_position,
            n_layers: info.n_layers,
            n_kv_heads: info.n_kv_heads,
            head_dim: info.head_dim,
            kmeans_samples: opts.kmeans_samples,
            kmeans_iters: opts.kmeans_iters,
            date: utc_now(),
            kvq_version: env!("CARGO_PKG_VERSION").into(),
            seconds: started.elapsed().as_secs_f64(),
        },
        layers,
    };
    cal.validate()?;
    Ok(cal)
}
