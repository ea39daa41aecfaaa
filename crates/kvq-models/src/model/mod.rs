//! The decoder-only transformer: one forward pass for every architecture family (their layers
//! are assembled from the pieces in `layers`, by the files in `arch`), for quantized and dense
//! weights alike, batched over sequences, with attention delegated to each sequence's `KvCache`.

pub mod arch;
pub mod config;
pub mod layers;
pub mod q4_1;
pub mod rope;
pub mod weights;

pub use arch::Family;
pub use config::ModelConfig;
pub use weights::{
    DEQUANT_MIN_ROWS, Embedding, GgufWeights, Linear, SafetensorsWeights, WeightSource,
};

use crate::{ModelError, Result};
use candle_core::{D, DType, Device, Tensor};
use kvq_cache::{CacheFactory, CacheGeometry, LayerCaches};
use layers::{Layer, Norm};

/// A sequence's share of a batched forward pass.
pub struct SeqStep<'a> {
    /// New tokens to run (a prompt chunk or one generated token).
    pub tokens: &'a [u32],
    /// The sequence's caches; the tokens go at positions `cache.len()..`.
    pub cache: &'a mut LayerCaches,
    /// Logits for every new position (perplexity) instead of only the last one.
    pub all_logits: bool,
}

/// A loaded decoder-only model.
pub struct Model {
    cfg: ModelConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Norm,
    output: Linear,
    /// Rotary cos/sin tables, one per distinct base, and each layer's table.
    ropes: Vec<(Tensor, Tensor)>,
    layer_rope: Vec<usize>,
    device: Device,
}

impl Model {
    /// Builds the model from `weights`; `progress(done, total)` after each layer.
    pub fn load(
        cfg: ModelConfig,
        weights: &mut dyn WeightSource,
        device: &Device,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self> {
        let family = Family::of(&cfg)?;
        let total = cfg.n_layers as u64 + 2;
        let embed = weights.embedding("token_embd.weight")?;
        progress(1, total);
        // Grown, not preallocated: the count comes from the file, and an absurd one must fail
        // on its first missing tensor, not on a terabyte allocation.
        let mut layers = Vec::new();
        for i in 0..cfg.n_layers {
            layers.push(family.layer(&cfg, weights, i)?);
            progress(i as u64 + 2, total);
        }
        let norm = family.final_norm(&cfg, weights)?;
        let output = if weights.contains("output.weight") {
            weights.linear("output")?
        } else {
            embed.as_linear()?
        };
        let mut thetas: Vec<f32> = Vec::new();
        let mut layer_rope = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let theta = cfg.layer_rope_theta(i);
            let at = match thetas.iter().position(|&t| t == theta) {
                Some(at) => at,
                None => {
                    thetas.push(theta);
                    thetas.len() - 1
                }
            };
            layer_rope.push(at);
        }
        let ropes = thetas
            .iter()
            .map(|&theta| rope::rope_tables(&cfg, theta, device))
            .collect::<Result<Vec<_>>>()?;
        progress(total, total);
        Ok(Self {
            cfg,
            embed,
            layers,
            norm,
            output,
            ropes,
            layer_rope,
            device: device.clone(),
        })
    }

    /// The device the weights live on (and the caches, which follow the keys they are given).
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The hyperparameters.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The attention geometry of each layer, for building caches.
    pub fn cache_geometries(&self) -> Vec<CacheGeometry> {
        (0..self.cfg.n_layers)
            .map(|i| CacheGeometry {
                n_heads: self.cfg.n_heads,
                n_kv_heads: self.cfg.n_kv_heads,
                head_dim: self.cfg.head_dim,
                sliding_window: self.cfg.layer_window(i),
                max_tokens: self.cfg.context_length,
            })
            .collect()
    }

    /// Fresh caches for one sequence, built by `factory`.
    pub fn new_caches(&self, factory: &dyn CacheFactory) -> Result<LayerCaches> {
        Ok(LayerCaches::new(factory, &self.cache_geometries())?)
    }

    /// Runs every sequence's new tokens through the model in one batch: the dense work
    /// (projections, MLP, output) on all rows together, attention per sequence in its cache.
    /// Returns each sequence's logits, `[1, vocab]` (or `[t, vocab]` with `all_logits`), in f32;
    /// fails when any sequence fails.
    pub fn forward(&self, steps: &mut [SeqStep<'_>]) -> Result<Vec<Tensor>> {
        self.forward_each(steps)?.into_iter().collect()
    }

    /// [`Model::forward`] where one sequence's failure is its own: a step with bad tokens, or
    /// whose cache errs, gets its error in its slot while the others get their logits (the
    /// failed one's later attention rows are zeros, and rows never mix in the dense layers). The
    /// outer error is for what fails the batch as a whole (a projection, the output layer). A
    /// failed sequence's caches are left part-way through the step: drop them.
    pub fn forward_each(&self, steps: &mut [SeqStep<'_>]) -> Result<Vec<Result<Tensor>>> {
        let cfg = &self.cfg;
        let mut results: Vec<Option<Result<Tensor>>> = steps
            .iter()
            .map(|s| self.check_step(s).err().map(Err))
            .collect();
        let mut live: Vec<(usize, &mut SeqStep<'_>)> = steps
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| results[*i].is_none())
            .collect();
        if live.is_empty() {
            return Ok(results.into_iter().flatten().collect());
        }
        // Rows of long prompt chunks first (they take the dequantized GEMM), then the rest;
        // `spans[j]` is live step j's (row offset, rows, first position) in that order.
        let long = |s: &SeqStep<'_>| s.tokens.len() >= DEQUANT_MIN_ROWS;
        let mut order: Vec<usize> = (0..live.len()).collect();
        order.sort_by_key(|&j| !long(live[j].1));
        let mut ids = Vec::new();
        let mut spans = vec![(0, 0, 0); live.len()];
        let mut dense_rows = 0;
        for &j in &order {
            let s = &live[j].1;
            spans[j] = (ids.len(), s.tokens.len(), s.cache.len());
            ids.extend_from_slice(s.tokens);
            if long(s) {
                dense_rows += s.tokens.len();
            }
        }
        let n = ids.len();
        let ids = Tensor::from_vec(ids, n, &self.device)?;
        let mut x = self.embed.forward(&ids)?;
        if let Some(s) = cfg.embed_scale {
            x = (x * f64::from(s))?;
        }
        let (hd, nh, nkv) = (cfg.head_dim, cfg.n_heads, cfg.n_kv_heads);
        let scale = 1.0 / (hd as f32).sqrt();
        let mut failed: Vec<Option<ModelError>> = (0..live.len()).map(|_| None).collect();
        for (li, layer) in self.layers.iter().enumerate() {
            let h = layer.attn_norm.forward(&x)?;
            let (q, k, v) = layer.qkv.project(&h, dense_rows, nh, nkv, hd)?;
            let mut outs = Vec::with_capacity(live.len());
            for (j, (_, s)) in live.iter_mut().enumerate() {
                let (off, t, pos) = spans[j];
                if failed[j].is_none() {
                    match self.attend_one(layer, li, s.cache, (&q, &k, &v), (off, t, pos), scale) {
                        Ok(o) => {
                            outs.push(o);
                            continue;
                        }
                        Err(e) => failed[j] = Some(e),
                    }
                }
                outs.push(Tensor::zeros((t, nh * hd), q.dtype(), &self.device)?);
            }
            // Back in row order: `outs` is in step order, rows are long chunks first.
            let mut by_row: Vec<(usize, Tensor)> = spans.iter().map(|sp| sp.0).zip(outs).collect();
            by_row.sort_by_key(|(off, _)| *off);
            let mut outs: Vec<Tensor> = by_row.into_iter().map(|(_, t)| t).collect();
            let attn = if outs.len() == 1 {
                outs.pop()
                    .ok_or_else(|| ModelError::Invalid("empty batch".into()))?
            } else {
                Tensor::cat(&outs, 0)?
            };
            x = layer.finish(&x, h, &attn, dense_rows)?;
        }
        let mut rows = Vec::new();
        for ((_, s), &(off, t, _)) in live.iter().zip(&spans) {
            if s.all_logits {
                rows.extend((off..off + t).map(|r| r as u32));
            } else {
                rows.push((off + t - 1) as u32);
            }
        }
        let nrows = rows.len();
        let sel = x.index_select(&Tensor::from_vec(rows, nrows, &self.device)?, 0)?;
        let sel = self.norm.forward(&sel)?;
        let logits = self.output.forward(&sel)?.to_dtype(DType::F32)?;
        let mut r = 0;
        for (((i, s), &(_, t, _)), fail) in live.iter().zip(&spans).zip(failed) {
            let k = if s.all_logits { t } else { 1 };
            results[*i] = Some(match fail {
                Some(e) => Err(e),
                None => Ok(logits.narrow(0, r, k)?),
            });
            r += k;
        }
        Ok(results.into_iter().flatten().collect())
    }

    /// Why step `s` cannot run (no tokens, a token outside the vocabulary, past the context).
    fn check_step(&self, s: &SeqStep<'_>) -> Result<()> {
        let cfg = &self.cfg;
        if s.tokens.is_empty() {
            return Err(ModelError::Invalid("a step with no tokens".into()));
        }
        if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(ModelError::Invalid(format!(
                "token id {bad} is out of vocabulary"
            )));
        }
        let pos = s.cache.len();
        if pos + s.tokens.len() > cfg.context_length {
            return Err(ModelError::Invalid(format!(
                "{} positions exceed the context length {}",
                pos + s.tokens.len(),
                cfg.context_length
            )));
        }
        Ok(())
    }

    /// One sequence's attention in layer `li`: its rows `off..off + t` of the projections,
    /// normed and rotated at positions `pos..`, appended to its cache and attended; returns
    /// `[t, n_heads * head_dim]`.
    fn attend_one(
        &self,
        layer: &Layer,
        li: usize,
        cache: &mut LayerCaches,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        (off, t, pos): (usize, usize, usize),
        scale: f32,
    ) -> Result<Tensor> {
        let (hd, nh, nkv) = (self.cfg.head_dim, self.cfg.n_heads, self.cfg.n_kv_heads);
        let heads = |x: &Tensor, n: usize| -> Result<Tensor> {
            Ok(x.narrow(0, off, t)?
                .reshape((t, n, hd))?
                .transpose(0, 1)?
                .contiguous()?)
        };
        let norm = |n: &Option<Norm>, x: Tensor| -> Result<Tensor> {
            match n {
                Some(n) => n.forward(&x),
                None => Ok(x),
            }
        };
        let qi = self.rope(&norm(&layer.q_norm, heads(q, nh)?)?, li, pos, t)?;
        let ki = self.rope(&norm(&layer.k_norm, heads(k, nkv)?)?, li, pos, t)?;
        let vi = heads(v, nkv)?;
        let cache = cache.layer(li);
        cache.append(&ki, &vi)?;
        let o = cache.attend(&qi, scale)?;
        Ok(o.transpose(0, 1)?.reshape((t, nh * hd))?)
    }

    /// Rotary embedding of `[heads, t, d]` at positions `pos..pos + t`, with layer `layer`'s
    /// base.
    fn rope(&self, x: &Tensor, layer: usize, pos: usize, t: usize) -> Result<Tensor> {
        let (cos, sin) = &self.ropes[self.layer_rope[layer]];
        let cos = cos.narrow(0, pos, t)?;
        let sin = sin.narrow(0, pos, t)?;
        let x4 = x.unsqueeze(0)?;
        let y = if self.cfg.rope_interleaved {
            candle_nn::rotary_emb::rope_i(&x4, &cos, &sin)?
        } else {
            candle_nn::rotary_emb::rope(&x4, &cos, &sin)?
        };
        Ok(y.squeeze(0)?)
    }
}

/// cos/sin tables `[context, head_dim / 2]` for rotary base `theta`.
/// Log-softmax over the last dimension.
pub fn log_softmax(logits: &Tensor) -> Result<Tensor> {
    Ok(candle_nn::ops::log_softmax(logits, D::Minus1)?)
}
