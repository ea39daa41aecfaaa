//! VecInfer's calibration: per layer the key smoothing factors `lambda_c = sqrt(max |K_c|)`
//! (per kv head and channel) and 256-centroid k-means codebooks for keys and values, for one or
//! more sub-vector lengths; trained from captured keys and values ([`train_layer`]) and stored
//! as a safetensors file plus a JSON metadata file naming the model (content hash), the text and
//! how it was made ([`VecInferCalibration::write`] / [`VecInferCalibration::read`]).

use super::capture::LayerCapture;
use super::codec::{CENTROIDS, VqKeyCodec, VqValueCodec};
use crate::codec::kmeans::{KMeansConfig, kmeans};
use crate::{CacheError, Result};
use candle_core::{Device, Tensor};
use rayon::prelude::*;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Version of the file layout.
pub const FORMAT: u32 = 1;

/// What a calibration was made from and for.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CalibrationMeta {
    pub format: u32,
    pub method: String,
    /// sha256 of the model's weight file(s): the calibration is only valid for these weights.
    pub model_hash: String,
    pub model_name: String,
    pub text_name: String,
    pub text_sha256: String,
    /// Tokens of the text the model ran over.
    pub tokens: usize,
    pub sub_dims: Vec<usize>,
    pub centroids: usize,
    /// Seed of the Hadamard rotations the codebooks were trained under.
    pub seed: u64,
    /// How the key smoothing factors were chosen (see [`Smoothing`]).
    pub smoothing: String,
    /// One codebook per sub-position (true) or one per layer.
    pub per_position: bool,
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub kmeans_samples: usize,
    pub kmeans_iters: usize,
    /// UTC, RFC 3339.
    pub date: String,
    pub kvq_version: String,
    /// Wall time of the calibration, seconds.
    pub seconds: f64,
}

/// One sub-vector length's codebooks: `[256, sub_dim]` shared by every sub-position, or
/// `[head_dim / sub_dim, 256, sub_dim]`, one per sub-position.
#[derive(Debug, Clone, PartialEq)]
pub struct SubBooks {
    pub sub_dim: usize,
    pub keys: Vec<f32>,
    pub values: Vec<f32>,
}

/// One layer's calibration.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerCalibration {
    /// `[n_kv_heads * head_dim]` key smoothing factors.
    pub key_lambda: Vec<f32>,
    pub books: Vec<SubBooks>,
}

impl LayerCalibration {
    /// The codebooks for `sub_dim`, if calibrated.
    pub fn books(&self, sub_dim: usize) -> Option<&SubBooks> {
        self.books.iter().find(|b| b.sub_dim == sub_dim)
    }
}

/// A model's VecInfer calibration.
#[derive(Debug, Clone, PartialEq)]
pub struct VecInferCalibration {
    pub meta: CalibrationMeta,
    pub layers: Vec<LayerCalibration>,
}

fn bad(msg: impl Into<String>) -> CacheError {
    CacheError::Calibration(msg.into())
}

fn io_err(path: &Path, e: impl std::fmt::Display) -> CacheError {
    bad(format!("{}: {e}", path.display()))
}

/// `<dir>/<stem>.safetensors` and `<dir>/<stem>.json`.
pub fn file_paths(dir: &Path, stem: &str) -> (PathBuf, PathBuf) {
    (
        dir.join(format!("{stem}.safetensors")),
        dir.join(format!("{stem}.json")),
    )
}

/// Writes `bytes` to `path` through a temporary file and a rename, so readers never see half.
fn write_atomic(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    write(&tmp)?;
    std::fs::rename(&tmp, path).map_err(|e| io_err(path, e))
}

/// A calibration source that always answers with one calibration (one loaded from a file, or
/// random codebooks in benches and tests).
pub struct FixedCalibration(pub Arc<VecInferCalibration>);

impl crate::registry::CalibrationSource for FixedCalibration {
    fn calibration(
        &self,
        method: &str,
        _params: &toml::Table,
    ) -> Result<Arc<dyn std::any::Any + Send + Sync>> {
        if method != super::METHOD {
            return Err(bad(format!("no calibration is held for method '{method}'")));
        }
        Ok(self.0.clone())
    }
}

impl VecInferCalibration {
    /// Random codebooks (Gaussian centroids, the scale of rotated coordinates of unit-variance
    /// inputs) and unit smoothing for sub_dims 4 and 8: a real calibration's shapes and costs with
    /// none of its quality, to time the kernels without a model (benches).
    pub fn random(n_layers: usize, n_kv_heads: usize, head_dim: usize, seed: u64) -> Self {
        let mut rng = crate::codec::rng::SplitMix::new(seed);
        let sub_dims = vec![4, 8];
        let layers = (0..n_layers)
            .map(|_| LayerCalibration {
                key_lambda: vec![1.0; n_kv_heads * head_dim],
                books: sub_dims
                    .iter()
                    .map(|&sub| {
                        let n = head_dim / sub * super::codec::CENTROIDS * sub;
                        SubBooks {
                            sub_dim: sub,
                            keys: rng.gauss_vec(n),
                            values: rng.gauss_vec(n),
                        }
                    })
                    .collect(),
            })
            .collect();
        Self {
            meta: CalibrationMeta {
                format: FORMAT,
                method: super::METHOD.into(),
                model_hash: "random".into(),
                model_name: "random".into(),
                text_name: "-".into(),
                text_sha256: "-".into(),
                tokens: 0,
                sub_dims,
                centroids: super::codec::CENTROIDS,
                seed: super::DEFAULT_SEED,
                smoothing: "none".into(),
                per_position: true,
                n_layers,
                n_kv_heads,
                head_dim,
                kmeans_samples: 0,
                kmeans_iters: 0,
                date: utc_now(),
                kvq_version: env!("CARGO_PKG_VERSION").into(),
                seconds: 0.0,
            },
            layers,
        }
    }

    /// Checks that every layer has lambdas and codebooks of the sizes the metadata promises.
    pub fn validate(&self) -> Result<()> {
        let m = &self.meta;
        if m.method != super::METHOD || m.format != FORMAT {
            return Err(bad(format!(
                "not a {} calibration of format {FORMAT} (method '{}', format {})",
                super::METHOD,
                m.method,
                m.format
            )));
        }
        if self.layers.len() != m.n_layers || m.centroids != CENTROIDS {
            return Err(bad(format!(
                "{} layers of {} centroids, metadata says {} of {CENTROIDS}",
                self.layers.len(),
                m.centroids,
                m.n_layers
            )));
        }
        for (i, l) in self.layers.iter().enumerate() {
            if l.key_lambda.len() != m.n_kv_heads * m.head_dim {
                return Err(bad(format!(
                    "layer {i}: key lambdas are not [{}, {}]",
                    m.n_kv_heads, m.head_dim
                )));
            }
            for &s in &m.sub_dims {
                let b = l
                    .books(s)
                    .ok_or_else(|| bad(format!("layer {i}: no codebooks for sub_dim {s}")))?;
                let ok = |n: usize| n == CENTROIDS * s || n == m.head_dim * CENTROIDS;
                if !ok(b.keys.len()) || !ok(b.values.len()) {
                    return Err(bad(format!("layer {i}: codebooks of the wrong size")));
                }
            }
        }
        Ok(())
    }

    /// Writes `<dir>/<stem>.safetensors` (tensors) and `<dir>/<stem>.json` (metadata),
    /// creating `dir`. Returns the two paths.
    pub fn write(&self, dir: &Path, stem: &str) -> Result<(PathBuf, PathBuf)> {
        self.validate()?;
        std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
        let dev = Device::Cpu;
        let m = &self.meta;
        let mut tensors: HashMap<String, Tensor> = HashMap::new();
        // The model hash inside the tensor file too, so the pair cannot be mixed up.
        let hash = m.model_hash.as_bytes().to_vec();
        tensors.insert(
            "model_hash".into(),
            Tensor::from_vec(hash.clone(), hash.len(), &dev)?,
        );
        for (i, l) in self.layers.iter().enumerate() {
            tensors.insert(
                format!("layer.{i}.key_lambda"),
                Tensor::from_vec(l.key_lambda.clone(), (m.n_kv_heads, m.head_dim), &dev)?,
            );
            for b in &l.books {
                let s = b.sub_dim;
                for (kind, v) in [("key", &b.keys), ("value", &b.values)] {
                    let books = v.len() / (CENTROIDS * s);
                    tensors.insert(
                        format!("layer.{i}.{kind}_codebook.sub{s}"),
                        Tensor::from_vec(v.clone(), (books, CENTROIDS, s), &dev)?,
                    );
                }
            }
        }
        let (st, json) = file_paths(dir, stem);
        write_atomic(&st, |p| {
            candle_core::safetensors::save(&tensors, p).map_err(|e| io_err(p, e))
        })?;
        let text = serde_json::to_string_pretty(m).map_err(|e| bad(e.to_string()))?;
        write_atomic(&json, |p| {
            std::fs::write(p, text + "\n").map_err(|e| io_err(p, e))
        })?;
        Ok((st, json))
    }

    /// Reads the metadata of `<dir>/<stem>.json` only.
    pub fn read_meta(dir: &Path, stem: &str) -> Result<CalibrationMeta> {
        let (_, json) = file_paths(dir, stem);
        let text = std::fs::read_to_string(&json).map_err(|e| io_err(&json, e))?;
        serde_json::from_str(&text).map_err(|e| io_err(&json, e))
    }

    /// Reads a calibration written by [`write`](Self::write). With `model_hash`, a calibration
    /// made for other weights is an error.
    pub fn read(dir: &Path, stem: &str, model_hash: Option<&str>) -> Result<Self> {
        let meta = Self::read_meta(dir, stem)?;
        if let Some(want) = model_hash.filter(|h| *h != meta.model_hash) {
            return Err(bad(format!(
                "{} was made for model {} ({}), not for the loaded model ({want})",
                file_paths(dir, stem).1.display(),
                meta.model_name,
                meta.model_hash
            )));
        }
        let (st, _) = file_paths(dir, stem);
        let mut t =
            candle_core::safetensors::load(&st, &Device::Cpu).map_err(|e| io_err(&st, e))?;
        let mut take = |name: &str| -> Result<Tensor> {
            t.remove(name)
                .ok_or_else(|| bad(format!("{}: no tensor {name}", st.display())))
        };
        let hash = take("model_hash")?.to_vec1::<u8>()?;
        if hash != meta.model_hash.as_bytes() {
            return Err(bad(format!(
                "{} and its metadata name different models",
                st.display()
            )));
        }
        let flat = |t: Tensor| -> Result<Vec<f32>> { Ok(t.flatten_all()?.to_vec1::<f32>()?) };
        let mut layers = Vec::with_capacity(meta.n_layers);
        for i in 0..meta.n_layers {
            let key_lambda = flat(take(&format!("layer.{i}.key_lambda"))?)?;
            let mut books = Vec::new();
            for &s in &meta.sub_dims {
                books.push(SubBooks {
                    sub_dim: s,
                    keys: flat(take(&format!("layer.{i}.key_codebook.sub{s}"))?)?,
                    values: flat(take(&format!("layer.{i}.value_codebook.sub{s}"))?)?,
                });
            }
            layers.push(LayerCalibration { key_lambda, books });
        }
        let cal = Self { meta, layers };
        cal.validate()?;
        Ok(cal)
    }
}

/// How a layer is trained.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    pub sub_dims: Vec<usize>,
    /// k-means settings (k is always 256); the seed is mixed with the layer and kind.
    pub kmeans: KMeansConfig,
    /// Rotation seed (must match the caches' `seed`).
    pub seed: u64,
    /// How the key smoothing factors are chosen.
    pub smoothing: Smoothing,
    /// One codebook per sub-position instead of one per layer.
    pub per_position: bool,
}

/// How the per-channel key smoothing factors lambda are chosen (keys are divided by lambda,
/// queries multiplied, so scores are unchanged; only what the codebooks see changes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Smoothing {
    /// VecInfer's `sqrt(max_t |K_c|)`.
    KeyMax,
    /// No smoothing (lambda = 1).
    Off,
    /// `1 / rms(Q_c)` over the kv head's query heads: the codebooks then minimize the expected
    /// squared score error (needs captured queries).
    QueryRms,
    /// SmoothQuant's balance, `sqrt(max |K_c| / max |Q_c|)` (needs captured queries).
    Balanced,
}

impl Smoothing {
    /// The name recorded in the metadata (and taken by `kvq calibrate --smoothing`).
    pub fn name(self) -> &'static str {
        match self {
            Smoothing::KeyMax => "key-max",
            Smoothing::Off => "off",
            Smoothing::QueryRms => "query-rms",
            Smoothing::Balanced => "balanced",
        }
    }

    /// Whether computing it needs the model's queries.
    pub fn needs_queries(self) -> bool {
        matches!(self, Smoothing::QueryRms | Smoothing::Balanced)
    }
}

/// Per (kv head, channel) max |x| over rows of `rows[h]` (query heads pooled by group).
fn channel_stat(rows: &[Vec<f32>], d: usize, kvh: usize, rms: bool) -> Vec<f32> {
    let group = (rows.len() / kvh.max(1)).max(1);
    let mut out = vec![0f64; kvh * d];
    let mut count = vec![0usize; kvh];
    for (h, r) in rows.iter().enumerate() {
        let kh = (h / group).min(kvh - 1);
        let o = &mut out[kh * d..(kh + 1) * d];
        for row in r.chunks_exact(d) {
            count[kh] += 1;
            for (m, &x) in o.iter_mut().zip(row) {
                *m = if rms {
                    *m + (x as f64).powi(2)
                } else {
                    m.max(x.abs() as f64)
                };
            }
        }
    }
    out.iter()
        .enumerate()
        .map(|(i, &m)| {
            if rms {
                (m / count[i / d].max(1) as f64).sqrt() as f32
            } else {
                m as f32
            }
        })
        .collect()
}

/// The key smoothing factors of one layer, `[n_kv_heads * head_dim]`, each at least 1e-3.
pub fn key_lambdas(capture: &LayerCapture, smoothing: Smoothing) -> Result<Vec<f32>> {
    let (d, kvh) = (capture.head_dim, capture.n_kv_heads);
    let needs_q = matches!(smoothing, Smoothing::QueryRms | Smoothing::Balanced);
    if needs_q && capture.queries.iter().all(Vec::is_empty) {
        return Err(bad(format!(
            "{smoothing:?} smoothing needs captured queries"
        )));
    }
    let kmax = || channel_stat(&capture.keys, d, kvh, false);
    let lambda: Vec<f32> = match smoothing {
        Smoothing::KeyMax => kmax().iter().map(|m| m.sqrt()).collect(),
        Smoothing::Off => vec![1.0; kvh * d],
        Smoothing::QueryRms => {
            let q = channel_stat(&capture.queries, d, kvh, true);
            let mean = q.iter().sum::<f32>() / q.len() as f32;
            q.iter().map(|r| mean / r.max(1e-6 * mean)).collect()
        }
        Smoothing::Balanced => {
            let q = channel_stat(&capture.queries, d, kvh, false);
            kmax()
                .iter()
                .zip(&q)
                .map(|(k, q)| (k / q.max(1e-6)).sqrt())
                .collect()
        }
    };
    Ok(lambda
        .into_iter()
        .map(|l| if l.is_finite() { l.max(1e-3) } else { 1.0 })
        .collect())
}

/// Trains layer `layer`'s lambdas and codebooks from its captured keys and values.
pub fn train_layer(
    layer: usize,
    capture: &LayerCapture,
    opts: &TrainOptions,
) -> Result<LayerCalibration> {
    let d = capture.head_dim;
    if capture.tokens() == 0 {
        return Err(bad(format!("layer {layer}: nothing was captured")));
    }
    let key_lambda = key_lambdas(capture, opts.smoothing)?;
    let mut books = Vec::new();
    for &sub in &opts.sub_dims {
        // The codecs' own transforms, so training sees exactly what encoding will.
        let dummy = vec![0f32; CENTROIDS * sub];

        let kc = VqKeyCodec::new(d, sub, layer, opts.seed, &key_lambda, &dummy)?;
        let vc = VqValueCodec::new(
            d,
            sub,
            layer,
            opts.seed,
            capture.n_kv_heads,
            &dummy,
            super::codec::ValueAccum::Gather,
        )?;
        let mut kx = Vec::with_capacity(capture.keys.iter().map(Vec::len).sum());
        let mut vx = Vec::with_capacity(kx.capacity());
        let mut u = vec![0f32; d];
        for h in 0..capture.n_kv_heads {
            for row in capture.keys[h].chunks_exact(d) {
                kc.transform(h, row, &mut u);
                kx.extend_from_slice(&u);
            }
            for row in capture.values[h].chunks_exact(d) {
                vc.transform(h, row, &mut u);
                vx.extend_from_slice(&u);
            }
        }
        let cfg = |kind: u64| KMeansConfig {
            k: CENTROIDS,
            seed: opts.kmeans.seed ^ ((layer as u64) << 20) ^ (kind << 16) ^ sub as u64,
            ..opts.kmeans.clone()
        };
        // One k-means per sub-position (in parallel: they are independent and deterministic).
        let train = |x: &[f32], kind: u64| -> Result<Vec<f32>> {
            if !opts.per_position {
                return Ok(kmeans(x, sub, &cfg(kind))?.centroids);
            }
            let books = (0..d / sub)
                .into_par_iter()
                .map(|pos| {
                    let at: Vec<f32> = x
                        .chunks_exact(d)
                        .flat_map(|row| row[pos * sub..(pos + 1) * sub].iter().copied())
                        .collect();
                    let c = KMeansConfig {
                        seed: cfg(kind).seed ^ ((pos as u64) << 8),
                        ..cfg(kind)
                    };
                    Ok(kmeans(&at, sub, &c)?.centroids)
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(books.concat())
        };
        books.push(SubBooks {
            sub_dim: sub,
            keys: train(&kx, 1)?,
            values: train(&vx, 2)?,
        });
    }
    Ok(LayerCalibration { key_lambda, books })
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}
