//! Keys, values and queries captured from the real default model, and the attention error of a
//! cache method on them against exact attention: the fixture of the "on real keys" tests.

use crate::default_gguf;
use candle_core::{Device, Tensor};
use kvq_cache::attention::attention_reference;
use kvq_cache::methods::vecinfer::capture::{CaptureFactory, LayerCapture};
use kvq_cache::{CacheFactory, CacheGeometry};
use kvq_models::LoadedModel;
use kvq_models::model::SeqStep;
use std::sync::OnceLock;

/// The default model, loaded once per test binary.
pub fn model() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| kvq_models::load(&default_gguf(), &mut |_, _| {}).expect("model loads"))
}

/// Runs `ids` (BOS first) through the model with capturing caches, in 256-token pieces, and
/// returns what every layer saw: post-RoPE keys, values and queries.
pub fn capture(ids: &[u32]) -> Vec<LayerCapture> {
    let f = CaptureFactory::new(true);
    let mut caches = model().model.new_caches(&f).expect("caches");
    for chunk in ids.chunks(256) {
        model()
            .model
            .forward(&mut [SeqStep {
                tokens: chunk,
                cache: &mut caches,
                all_logits: false,
            }])
            .expect("forward");
    }
    f.take()
}

/// Relative L2 error (over all heads and rows) of the last `rows` query rows of one layer
/// attended through `factory`, against exact f32 attention on the same keys and values. The cache
/// gets every key and value in one append, as a prefill would hand them over.
pub fn layer_error(
    factory: &dyn CacheFactory,
    layer: usize,
    cap: &LayerCapture,
    rows: usize,
) -> f64 {
    let (kvh, nh, d, n) = (cap.n_kv_heads, cap.n_heads, cap.head_dim, cap.tokens());
    let g = CacheGeometry {
        n_heads: nh,
        n_kv_heads: kvh,
        head_dim: d,
        sliding_window: None,
        max_tokens: n,
    };
    let (k, v) = (cap.keys.concat(), cap.values.concat());
    let q: Vec<f32> = cap
        .queries
        .iter()
        .flat_map(|h| h[(n - rows) * d..].iter().copied())
        .collect();
    let t = |x: &[f32], s: (usize, usize, usize)| {
        Tensor::from_slice(x, s, &Device::Cpu).expect("tensor")
    };
    let mut cache = factory.create(layer, &g).expect("cache");
    cache
        .append(&t(&k, (kvh, n, d)), &t(&v, (kvh, n, d)))
        .expect("append");
    let scale = 1.0 / (d as f32).sqrt();
    let got = cache
        .attend(&t(&q, (nh, rows, d)), scale)
        .expect("attend")
        .flatten_all()
        .and_then(|x| x.to_vec1::<f32>())
        .expect("attention output");
    let want = attention_reference(&q, &k, &v, nh, kvh, rows, n, d, scale, None);
    let num: f64 = got
        .iter()
        .zip(&want)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// [`layer_error`] of the last `rows` rows of every layer: (mean over layers, worst layer).
pub fn errors(factory: &dyn CacheFactory, caps: &[LayerCapture], rows: usize) -> (f64, f64) {
    let e: Vec<f64> = caps
        .iter()
        .enumerate()
        .map(|(l, cap)| layer_error(factory, l, cap, rows))
        .collect();
    (
        e.iter().sum::<f64>() / e.len().max(1) as f64,
        e.iter().copied().fold(0.0, f64::max),
    )
}
