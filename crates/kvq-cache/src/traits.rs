//! The cache boundary: `KvCache` (one layer of one sequence) and `CacheFactory` (builds them).

use crate::{CacheError, Result};
use candle_core::{Device, Tensor};
use std::collections::HashMap;

/// A cache's saved state: named tensors on the host (`KvCache::save_state`).
pub type CacheState = HashMap<String, Tensor>;

/// The attention geometry of one layer, as the model sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheGeometry {
    /// Number of query heads.
    pub n_heads: usize,
    /// Number of key/value heads (GQA/MQA when smaller than `n_heads`).
    pub n_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Sliding attention window in tokens, if this layer has one.
    pub sliding_window: Option<usize>,
    /// Most tokens this sequence may ever hold (the model's context length).
    pub max_tokens: usize,
}

impl CacheGeometry {
    /// Checks `append`'s keys and values against this geometry and the `len` positions held;
    /// returns the number of new positions `t`.
    pub fn check_append(&self, len: usize, k: &Tensor, v: &Tensor) -> Result<usize> {
        let t = check_heads(k, self.n_kv_heads, self.head_dim, "keys")?;
        if check_heads(v, self.n_kv_heads, self.head_dim, "values")? != t {
            return Err(CacheError::Shape("keys and values differ in length".into()));
        }
        if len + t > self.max_tokens {
            return Err(CacheError::Shape(format!(
                "cache holds at most {} positions",
                self.max_tokens
            )));
        }
        Ok(t)
    }

    /// Checks `attend`'s queries against this geometry and the `len` positions held; returns
    /// the number of query rows `t`.
    pub fn check_attend(&self, len: usize, q: &Tensor) -> Result<usize> {
        let t = check_heads(q, self.n_heads, self.head_dim, "queries")?;
        if t > len {
            return Err(CacheError::Shape(format!(
                "{t} queries but only {len} cached positions"
            )));
        }
        Ok(t)
    }
}

/// Checks a `[heads, t, d]` tensor and returns t.
fn check_heads(x: &Tensor, heads: usize, d: usize, what: &str) -> Result<usize> {
    match x.dims() {
        &[h, t, dd] if h == heads && dd == d => Ok(t),
        dims => Err(CacheError::Shape(format!(
            "{what}: expected [{heads}, t, {d}], got {dims:?}"
        ))),
    }
}

/// The KV cache of one layer of one sequence. Models see only this trait.
///
/// Tensors are f32 on the cache's device:
/// - `append(k, v)`: `k`, `v` are `[n_kv_heads, t, head_dim]`, keys already rotated (RoPE).
/// - `attend(q, scale)`: `q` is `[n_heads, t, head_dim]`, the queries of the last `t` appended
///   positions; the result `[n_heads, t, head_dim]` is causal attention over everything held.
pub trait KvCache: Send {
    /// Appends the keys and values of `t` new positions.
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()>;
    /// Causal attention of the last `t` positions' queries over the cached keys and values.
    fn attend(&mut self, q: &Tensor, scale: f32) -> Result<Tensor>;
    /// Number of positions appended so far (including ones a sliding window no longer attends).
    fn len(&self) -> usize;
    /// True when nothing has been appended.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Bytes this cache really holds (its allocated buffers), not an estimate from `len`.
    fn resident_bytes(&self) -> usize;
    /// `resident_bytes` split into (key bytes, value bytes).
    fn resident_split(&self) -> (usize, usize) {
        let b = self.resident_bytes();
        (b / 2, b - b / 2)
    }
    /// An upper bound on `resident_bytes` after each attend from now until this cache holds
    /// `tokens` positions, appended at most `chunk` at a time with an attend after each append:
    /// what admission reserves for a sequence (`kvq serve --kv-budget`). Within a step a
    /// compressed layer holds a prompt chunk's fp16 rows until its attend (one layer at a time);
    /// that transient is not counted. Counted from the cache's own allocation policy, given what
    /// it knows now: a compressed layer not yet found sharp counts as coded, and once found
    /// sharp (every key kept in fp16) counts that.
    fn reserve_bytes(&self, tokens: usize, chunk: usize) -> usize;
    /// Drops every position at or after `n`.
    fn truncate(&mut self, n: usize) -> Result<()>;
    /// Whether [`KvCache::truncate`] to `n` would succeed (it errs where the rows a query at
    /// position `n` reads are gone). The default knows only that not truncating succeeds.
    fn can_truncate(&self, n: usize) -> bool {
        n >= self.len()
    }
    /// From now on keep what a [`KvCache::truncate`] to any of the last `tokens` positions
    /// needs (a compressed cache keeps that many more fp16 rows past its window, counted in
    /// `resident_bytes` and `reserve_bytes`); caches that can always truncate ignore it.
    fn allow_rewind(&mut self, _tokens: usize) {}
    /// The method name, as the registry knows it.
    fn method(&self) -> &str;
    /// An independent copy holding the same positions (its buffers copied on their device):
    /// a sequence that continues from this one's prefix.
    fn fork(&self) -> Result<Box<dyn KvCache>>;
    /// Everything [`KvCache::restore_state`] needs to rebuild this cache's positions in a
    /// fresh cache from the same factory (layer and geometry): named tensors copied to the
    /// host, compressed methods as their codes. What the factory builds (codecs, codebooks,
    /// rotations) is not in it. The default: this cache cannot be saved.
    fn save_state(&self) -> Result<CacheState> {
        Err(CacheError::State(format!(
            "a {} cache cannot be saved",
            self.method()
        )))
    }
    /// Restores a [`KvCache::save_state`] into this fresh (empty) cache, its buffers on
    /// `device`; afterwards it answers every call as the saved cache did. A state that does
    /// not fit (another method, geometry or window, a missing or misshapen tensor, counts that
    /// disagree) is an error, never a panic, and leaves nothing half restored that is used.
    fn restore_state(&mut self, state: &CacheState, device: &Device) -> Result<()> {
        let _ = (state, device);
        Err(CacheError::State(format!(
            "a {} cache cannot be restored",
            self.method()
        )))
    }
}

/// Builds the per-layer caches of one method with one configuration.
pub trait CacheFactory: Send + Sync {
    /// The method name, e.g. `fp16`.
    fn method(&self) -> &str;
    /// A fresh cache for layer `layer` with geometry `geom`.
    fn create(&self, layer: usize, geom: &CacheGeometry) -> Result<Box<dyn KvCache>>;
}

/// All layers' caches of one sequence.
pub struct LayerCaches {
    layers: Vec<Box<dyn KvCache>>,
    method: String,
}

impl LayerCaches {
    /// One cache per layer from `factory`; `geoms[i]` is layer i's geometry.
    pub fn new(factory: &dyn CacheFactory, geoms: &[CacheGeometry]) -> Result<Self> {
        let layers = geoms
            .iter()
            .enumerate()
            .map(|(i, g)| factory.create(i, g))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            method: factory.method().to_string(),
        })
    }

    /// The cache of layer `i`.
    pub fn layer(&mut self, i: usize) -> &mut dyn KvCache {
        self.layers[i].as_mut()
    }

    /// Positions held (every layer holds the same number).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |l| l.len())
    }

    /// True when nothing has been appended.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sum of the layers' resident bytes.
    pub fn resident_bytes(&self) -> usize {
        self.layers.iter().map(|l| l.resident_bytes()).sum()
    }

    /// Sum of the layers' [`KvCache::reserve_bytes`].
    pub fn reserve_bytes(&self, tokens: usize, chunk: usize) -> usize {
        self.layers
            .iter()
            .map(|l| l.reserve_bytes(tokens, chunk))
            .sum()
    }

    /// Sum of the layers' resident bytes, split into (key bytes, value bytes).
    pub fn resident_split(&self) -> (usize, usize) {
        self.layers
            .iter()
            .map(|l| l.resident_split())
            .fold((0, 0), |(a, b), (k, v)| (a + k, b + v))
    }

    /// An independent copy of every layer (see [`KvCache::fork`]).
    pub fn fork(&self) -> Result<Self> {
        Ok(Self {
            layers: self
                .layers
                .iter()
                .map(|l| l.fork())
                .collect::<Result<_>>()?,
            method: self.method.clone(),
        })
    }

    /// [`KvCache::allow_rewind`] on every layer.
    pub fn allow_rewind(&mut self, tokens: usize) {
        self.layers.iter_mut().for_each(|l| l.allow_rewind(tokens));
    }

    /// Whether every layer can truncate to `n` ([`KvCache::can_truncate`]).
    pub fn can_truncate(&self, n: usize) -> bool {
        self.layers.iter().all(|l| l.can_truncate(n))
    }

    /// Truncates every layer to `n` positions, or none: a layer that cannot is found first.
    pub fn truncate(&mut self, n: usize) -> Result<()> {
        if !self.can_truncate(n) {
            return Err(crate::CacheError::Shape(format!(
                "cannot truncate to {n} positions: a layer no longer holds the rows a query there reads"
            )));
        }
        self.layers.iter_mut().try_for_each(|l| l.truncate(n))
    }

    /// The method name.
    pub fn method(&self) -> &str {
        &self.method
    }

    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// The smallest `n` such that every layer can truncate to any of `n..=len`
    /// ([`KvCache::can_truncate`]): what a saved prefix can still be continued from.
    pub fn min_truncate(&self) -> usize {
        let mut n = self.len();
        while n > 0 && self.can_truncate(n - 1) {
            n -= 1;
        }
        n
    }

    /// Every layer's [`KvCache::save_state`], its names prefixed `layer.<i>.`.
    pub fn save_state(&self) -> Result<CacheState> {
        let mut out = CacheState::new();
        for (i, l) in self.layers.iter().enumerate() {
            for (name, t) in l.save_state()? {
                out.insert(format!("layer.{i}.{name}"), t);
            }
        }
        Ok(out)
    }

    /// Caches from `factory` for layers of geometries `geoms`, restored from `state` (a
    /// [`LayerCaches::save_state`]) with their buffers on `device`. Every tensor of `state`
    /// must be taken by some layer.
    pub fn restore(
        factory: &dyn CacheFactory,
        geoms: &[CacheGeometry],
        state: CacheState,
        device: &Device,
    ) -> Result<Self> {
        let mut per_layer: Vec<CacheState> = vec![CacheState::new(); geoms.len()];
        for (name, t) in state {
            let layer = name
                .strip_prefix("layer.")
                .and_then(|r| r.split_once('.'))
                .and_then(|(i, rest)| Some((i.parse::<usize>().ok()?, rest)));
            match layer {
                Some((i, rest)) if i < geoms.len() => {
                    per_layer[i].insert(rest.to_string(), t);
                }
                _ => {
                    return Err(CacheError::State(format!(
                        "tensor {name} belongs to no layer of {}",
                        geoms.len()
                    )));
                }
            }
        }
        let mut caches = Self::new(factory, geoms)?;
        for (cache, state) in caches.layers.iter_mut().zip(&per_layer) {
            cache.restore_state(state, device)?;
        }
        let len = caches.len();
        if caches.layers.iter().any(|l| l.len() != len) {
            return Err(CacheError::State(
                "layers restored to different lengths".into(),
            ));
        }
        Ok(caches)
    }
}
