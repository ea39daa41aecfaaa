//! Small random checkpoints in the Hugging Face layout for the architectures without reachable
//! weights, and what their tests share: loading them into kvq, stepping them through the caches,
//! and running every cache method on them.

use candle_core::{Device, Tensor};
use kvq_cache::codec::rng::SplitMix;
use kvq_cache::methods::vecinfer::calibration::{FixedCalibration, VecInferCalibration};
use kvq_cache::{CacheFactory, CacheRegistry, CacheSpec, LayerCaches};
use kvq_models::model::{Family, Model, ModelConfig, SafetensorsWeights, SeqStep};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// Seeded Gaussian tensors for a checkpoint.
pub struct Init {
    rng: SplitMix,
    pub tensors: HashMap<String, Tensor>,
}

impl Init {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: SplitMix::new(seed),
            tensors: HashMap::new(),
        }
    }

    /// Adds `name` with entries `mean + std * N(0, 1)`.
    pub fn put(&mut self, name: impl Into<String>, shape: &[usize], std: f32, mean: f32) {
        let n = shape.iter().product();
        let v: Vec<f32> = self
            .rng
            .gauss_vec(n)
            .into_iter()
            .map(|x| mean + std * x)
            .collect();
        let t = Tensor::from_vec(v, shape, &Device::Cpu).expect("tensor");
        self.tensors.insert(name.into(), t);
    }

    /// Writes `model.safetensors` and `config.json` into `dir`.
    pub fn save(&self, dir: &Path, config: &serde_json::Value) {
        candle_core::safetensors::save(&self.tensors, dir.join("model.safetensors"))
            .expect("save safetensors");
        let text = serde_json::to_string_pretty(config).expect("json");
        std::fs::write(dir.join("config.json"), text).expect("write config.json");
    }
}

/// kvq's model from a checkpoint directory (config.json and model.safetensors, read as the
/// loader reads them).
pub fn kvq_model(dir: &Path) -> Model {
    let text = std::fs::read_to_string(dir.join("config.json")).expect("config");
    let cfg = ModelConfig::from_hf_json(&text).expect("config parses");
    let family = Family::of(&cfg).expect("family");
    let files = [dir.join("model.safetensors")];
    let mut w = SafetensorsWeights::open(&files, &Device::Cpu, family).expect("weights");
    Model::load(cfg, &mut w, &Device::Cpu, &mut |_, _| {}).expect("model loads")
}

/// `n` seeded token ids below `vocab`.
pub fn tokens(n: usize, vocab: usize) -> Vec<u32> {
    let mut rng = SplitMix::new(7);
    (0..n)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

/// Feeds `ids` through `model` in `pieces` (then one token at a time, as the server decodes) and
/// returns the logits after each step's last token.
pub fn step_logits(
    model: &Model,
    caches: &mut LayerCaches,
    ids: &[u32],
    pieces: &[usize],
) -> Vec<Tensor> {
    let mut out = Vec::new();
    let mut at = 0;
    for &p in pieces.iter().chain(std::iter::repeat(&1)) {
        if at >= ids.len() {
            break;
        }
        let end = (at + p).min(ids.len());
        let logits = model
            .forward(&mut [SeqStep {
                tokens: &ids[at..end],
                cache: caches,
                all_logits: false,
            }])
            .expect("forward");
        out.push(logits[0].flatten_all().expect("flat"));
        at = end;
    }
    out
}

/// `max |a - b| / max |b|`.
pub fn max_rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    let diff = (a - b).and_then(|d| d.abs()?.max_all()?.to_scalar::<f32>());
    let scale = b.abs().and_then(|x| x.max_all()?.to_scalar::<f32>());
    diff.expect("diff") / scale.expect("scale").max(1e-6)
}

/// Relative L2 distance `|a - b| / |b|`.
pub fn rel_l2(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a - b).and_then(|d| d.sqr()?.sum_all()?.to_scalar::<f32>());
    let n = b.sqr().and_then(|x| x.sum_all()?.to_scalar::<f32>());
    f64::from(d.expect("diff") / n.expect("norm").max(1e-30)).sqrt()
}

/// The built-in methods for `model`, VecInfer on random codebooks, and each compressed method
/// again as `<method>-w<window>` with that fp16 window and one sink (so that a short sliding
/// window is read from codes). Returns the registry and the names to run, fp16 first.
pub fn every_method(model: &Model, window: usize) -> (CacheRegistry, Vec<String>) {
    let cfg = model.config();
    let mut registry = CacheRegistry::builtin();
    let cal = VecInferCalibration::random(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 5);
    // Random VecInfer codebooks: a random model's keys are not worth calibrating on.
    registry.set_calibration(Arc::new(FixedCalibration(Arc::new(cal))));
    let mut names = vec!["fp16".to_string(), "f32".to_string()];
    for m in [
        "turboquant-mse",
        "turboquant-rvq",
        "turboquant-prod",
        "qjl",
        "vecinfer",
    ] {
        let name = format!("{m}-w{window}");
        let text = format!("method = \"{m}\"\n[params]\nwindow = {window}\nsinks = 1\n");
        registry.add_preset(&name, &text, &name).expect("preset");
        names.push(name);
    }
    (registry, names)
}

/// The factory `registry` resolves `method` to.
pub fn factory(registry: &CacheRegistry, method: &str) -> Arc<dyn CacheFactory> {
    registry
        .resolve(&CacheSpec {
            method: Some(method.to_string()),
            bits: None,
        })
        .expect("method")
        .factory
}

/// What one method did on a model: the logits after each step and resident bytes per step.
pub struct MethodRun {
    pub logits: Vec<Tensor>,
    pub resident: Vec<usize>,
}

/// Runs `ids` through `model` with `method`: a `prompt`-token chunk, then one token at a time.
pub fn run_method(
    model: &Model,
    registry: &CacheRegistry,
    method: &str,
    ids: &[u32],
    prompt: usize,
) -> MethodRun {
    let f = factory(registry, method);
    let mut caches = model.new_caches(f.as_ref()).expect("caches");
    let mut logits = step_logits(model, &mut caches, &ids[..prompt], &[prompt]);
    let mut resident = Vec::new();
    for i in prompt..ids.len() {
        logits.extend(step_logits(model, &mut caches, &ids[i..i + 1], &[1]));
        resident.push(caches.resident_bytes());
    }
    for l in &logits {
        let v = l.to_vec1::<f32>().expect("logits");
        assert!(
            v.iter().all(|x| x.is_finite()),
            "{method}: non-finite logits"
        );
    }
    MethodRun { logits, resident }
}

/// Mean relative L2 distance of `run`'s logits from `exact`'s, step by step.
pub fn mean_rel_l2(run: &MethodRun, exact: &MethodRun) -> f64 {
    let n = exact.logits.len().max(1) as f64;
    run.logits
        .iter()
        .zip(&exact.logits)
        .map(|(a, b)| rel_l2(a, b))
        .sum::<f64>()
        / n
}
