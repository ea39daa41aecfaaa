//! VecInfer calibration for the served model, found or made on its own: [`registry_for`] gives
//! the cache registry a [`ModelCalibration`] source that, the first time a request asks for
//! `vecinfer`, loads `<cache dir>/calibration/<model sha256>/vecinfer.{safetensors,json}`
//! (written by `kvq calibrate`), or, when there is none, calibrates on the public-domain text
//! shipped with kvq (configs/calibration/), logs that it did, and saves the result for next
//! time. Concurrent first requests wait for the one run.

mod run;

pub use run::{CalibrateOptions, Source, Stage, calibrate};

use kvq_cache::methods::vecinfer::calibration::{VecInferCalibration, file_paths};
use kvq_cache::methods::vecinfer::{DEFAULT_SEED, METHOD};
use kvq_cache::params::VecInferParams;
use kvq_cache::registry::CalibrationSource;
use kvq_cache::{CacheError, CacheRegistry};
use sha2::{Digest, Sha256};
use std::any::Any;
use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Instant;

/// The calibration text shipped with kvq: Julius Caesar, Act I to Act II Scene I (public
/// domain). Never the evaluation text (Macbeth).
pub const SHIPPED_TEXT: &str = include_str!("../../../../configs/calibration/julius_caesar.txt");
/// Its file name, recorded in the metadata.
pub const SHIPPED_TEXT_NAME: &str = "julius_caesar.txt";

/// What can go wrong while calibrating.
#[derive(Debug, thiserror::Error)]
pub enum CalibrateError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Model(#[from] kvq_models::ModelError),
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error("{0}")]
    Invalid(String),
}

/// `$KVQ_CACHE_DIR`, else `~/.cache/kvq`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("KVQ_CACHE_DIR") {
        return PathBuf::from(d);
    }
    std::env::var_os("HOME")
        .map_or_else(std::env::temp_dir, PathBuf::from)
        .join(".cache/kvq")
}

/// Where the calibration of the model with content hash `model_hash` lives under `root`.
pub fn calibration_dir(root: &Path, model_hash: &str) -> PathBuf {
    root.join("calibration").join(model_hash)
}

/// File stem of the calibration for rotation seed `seed`.
pub fn file_stem(seed: u64) -> String {
    if seed == DEFAULT_SEED {
        METHOD.to_string()
    } else {
        format!("{METHOD}-seed{seed}")
    }
}

/// Lowercase hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CalibrateError + '_ {
    move |source| CalibrateError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Streams a file through sha256.
fn hash_file(path: &Path) -> Result<[u8; 32], CalibrateError> {
    let mut f = std::fs::File::open(path).map_err(io(path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().into())
}

/// The content hash identifying a model's weights: the sha256 of a GGUF file (of a split one,
/// the sha256 over its parts' sha256s, in order); for a Hugging Face directory (a hub snapshot
/// is one), the sha256 over each weight file's name and sha256, in name order.
pub fn model_hash(path: &Path) -> Result<String, CalibrateError> {
    if !path.exists() {
        return Err(CalibrateError::Invalid(format!(
            "{} not found",
            path.display()
        )));
    }
    if !path.is_dir() {
        let parts = kvq_models::files::gguf_shards(path)
            .map_err(|e| CalibrateError::Invalid(e.to_string()))?;
        if let [single] = parts.as_slice() {
            return Ok(hex(&hash_file(single)?));
        }
        let mut h = Sha256::new();
        for part in &parts {
            h.update(hash_file(part)?);
        }
        return Ok(hex(&h.finalize()));
    }
    // The files the loader reads (an index's shards, else the usual names).
    let files = kvq_models::loader::safetensors_files(path)
        .map_err(|e| CalibrateError::Invalid(format!("{e}: nothing to identify the model by")))?;
    let mut h = Sha256::new();
    for f in &files {
        let name = f.file_name().map(|n| n.to_string_lossy().into_owned());
        h.update(name.unwrap_or_default().as_bytes());
        h.update(hash_file(f)?);
    }
    Ok(hex(&h.finalize()))
}

/// Runs `f`, telling tokio first when called on one of its worker threads (a request handler
/// resolving a method), so a calibration of several seconds does not stall other requests.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// The VecInfer calibration of one model (by path), loaded or made on first use and kept.
pub struct ModelCalibration {
    model_path: PathBuf,
    root: PathBuf,
    first_use: CalibrateOptions,
    hash: OnceLock<String>,
    /// Per rotation seed. The lock is held while loading or calibrating, so concurrent first
    /// requests wait for that one run instead of starting their own.
    loaded: Mutex<HashMap<u64, Arc<VecInferCalibration>>>,
}

impl ModelCalibration {
    /// The calibration of the model at `model_path`, under [`cache_dir`].
    pub fn new(model_path: &Path) -> Self {
        Self::with_root(model_path, cache_dir(), CalibrateOptions::first_use())
    }

    /// Same, with calibrations under `root` and first-use calibration done with `first_use`.
    pub fn with_root(model_path: &Path, root: PathBuf, first_use: CalibrateOptions) -> Self {
        Self {
            model_path: model_path.to_path_buf(),
            root,
            first_use,
            hash: OnceLock::new(),
            loaded: Mutex::new(HashMap::new()),
        }
    }

    /// The model's content hash (computed once).
    pub fn model_hash(&self) -> Result<String, CalibrateError> {
        if let Some(h) = self.hash.get() {
            return Ok(h.clone());
        }
        let h = model_hash(&self.model_path)?;
        Ok(self.hash.get_or_init(|| h).clone())
    }

    /// The calibration for rotation seed `seed`: already loaded, read from disk, or made now.
    pub fn get(&self, seed: u64) -> Result<Arc<VecInferCalibration>, CalibrateError> {
        let mut loaded = self.loaded.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = loaded.get(&seed) {
            return Ok(c.clone());
        }
        let hash = self.model_hash()?;
        let dir = calibration_dir(&self.root, &hash);
        let stem = file_stem(seed);
        let cal = match VecInferCalibration::read(&dir, &stem, Some(&hash)) {
            Ok(c) if c.meta.seed == seed => {
                tracing::info!(path = %file_paths(&dir, &stem).0.display(), text = %c.meta.text_name, tokens = c.meta.tokens, "loaded the VecInfer calibration");
                c
            }
            found => {
                let why = match found {
                    Ok(_) => "it was trained under another seed".to_string(),
                    Err(e) if file_paths(&dir, &stem).1.exists() => e.to_string(),
                    Err(_) => "none exists".to_string(),
                };
                self.calibrate_now(&hash, seed, &dir, &stem, &why)?
            }
        };
        let cal = Arc::new(cal);
        loaded.insert(seed, cal.clone());
        Ok(cal)
    }

    fn calibrate_now(
        &self,
        hash: &str,
        seed: u64,
        dir: &Path,
        stem: &str,
        why: &str,
    ) -> Result<VecInferCalibration, CalibrateError> {
        tracing::warn!(
            model = %self.model_path.display(),
            text = SHIPPED_TEXT_NAME,
            "no usable VecInfer calibration for this model ({why}): calibrating now on the \
             shipped public-domain text (up to {} tokens); run `kvq calibrate` for a fuller one",
            self.first_use.tokens
        );
        let started = Instant::now();
        let model = kvq_models::load(&self.model_path, &mut |_, _| {})?;
        let opts = CalibrateOptions {
            seed,
            ..self.first_use.clone()
        };
        let src = Source {
            model_hash: hash,
            text: SHIPPED_TEXT,
            text_name: SHIPPED_TEXT_NAME,
        };
        let cal = calibrate(&model, &src, &opts, &mut |_, _, _| {})?;
        drop(model);
        match cal.write(dir, stem) {
            Ok((st, _)) => tracing::info!(
                secs = format_args!("{:.1}", started.elapsed().as_secs_f64()),
                tokens = cal.meta.tokens,
                path = %st.display(),
                "VecInfer calibration done and saved"
            ),
            Err(e) => tracing::warn!(
                secs = format_args!("{:.1}", started.elapsed().as_secs_f64()),
                "VecInfer calibration done, but could not be saved: {e}"
            ),
        }
        Ok(cal)
    }
}

impl CalibrationSource for ModelCalibration {
    fn calibration(
        &self,
        method: &str,
        params: &toml::Table,
    ) -> kvq_cache::Result<Arc<dyn Any + Send + Sync>> {
        if method != METHOD {
            return Err(CacheError::Calibration(format!(
                "no calibration is made for method '{method}'"
            )));
        }
        let p: VecInferParams = kvq_cache::params::parse(METHOD, params)?;
        let seed = p.window.seed.unwrap_or(DEFAULT_SEED);
        // Every failure here is the calibration's (a 503 for the request), never a bare cache
        // or candle error (a 500).
        let cal = blocking(|| self.get(seed)).map_err(|e| match e {
            CalibrateError::Cache(CacheError::Calibration(m)) => CacheError::Calibration(m),
            other => CacheError::Calibration(other.to_string()),
        })?;
        Ok(cal)
    }
}

/// The built-in methods, with VecInfer calibrated for the model at `model_path` (found or made
/// on first use). What `serve`, `generate`, `bench` and `eval` use instead of
/// `CacheRegistry::builtin()`.
pub fn registry_for(model_path: &Path) -> CacheRegistry {
    let mut r = CacheRegistry::builtin();
    r.set_calibration(Arc::new(ModelCalibration::new(model_path)));
    r
}

#[cfg(test)]
mod tests;
