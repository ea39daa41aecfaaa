//! A capturing cache for calibration (not a registered method): the exact f32 dense cache,
//! recording every key and value appended to it (after RoPE, as the model hands them over) and,
//! optionally, every query it attends with. Caches of later sequences built by the same factory
//! append to the same per-layer records, so a text longer than the context can run as several
//! sequences.

use crate::Result;
use crate::methods::dense::F32Cache;
use crate::traits::{CacheFactory, CacheGeometry, KvCache};
use candle_core::Tensor;
use std::sync::{Arc, Mutex, PoisonError};

/// Method name of the capturing caches.
pub const CAPTURE_METHOD: &str = "capture";

/// What one layer saw, per head, rows of `head_dim` values in position order.
#[derive(Debug, Clone, Default)]
pub struct LayerCapture {
    pub n_kv_heads: usize,
    pub n_heads: usize,
    pub head_dim: usize,
    /// `[n_kv_heads][tokens * head_dim]`.
    pub keys: Vec<Vec<f32>>,
    /// `[n_kv_heads][tokens * head_dim]`.
    pub values: Vec<Vec<f32>>,
    /// `[n_heads][rows * head_dim]`, only when queries are captured.
    pub queries: Vec<Vec<f32>>,
}

impl LayerCapture {
    fn new(geom: &CacheGeometry) -> Self {
        Self {
            n_kv_heads: geom.n_kv_heads,
            n_heads: geom.n_heads,
            head_dim: geom.head_dim,
            keys: vec![Vec::new(); geom.n_kv_heads],
            values: vec![Vec::new(); geom.n_kv_heads],
            queries: vec![Vec::new(); geom.n_heads],
        }
    }

    /// Tokens captured.
    pub fn tokens(&self) -> usize {
        self.keys
            .first()
            .map_or(0, |k| k.len() / self.head_dim.max(1))
    }

    /// `[heads, t, d]` rows appended per head.
    fn push(rows: &mut [Vec<f32>], x: &Tensor) -> Result<()> {
        let (heads, t, d) = x.dims3()?;
        let flat = x.flatten_all()?.to_vec1::<f32>()?;
        for (h, r) in rows.iter_mut().enumerate().take(heads) {
            r.extend_from_slice(&flat[h * t * d..(h + 1) * t * d]);
        }
        Ok(())
    }
}

type Store = Arc<Mutex<Vec<LayerCapture>>>;

/// Builds capturing caches; [`take`](Self::take) hands out what they recorded.
#[derive(Clone, Default)]
pub struct CaptureFactory {
    store: Store,
    queries: bool,
}

impl CaptureFactory {
    /// Captures keys and values, and queries too when `queries` is set.
    pub fn new(queries: bool) -> Self {
        Self {
            store: Store::default(),
            queries,
        }
    }

    /// The records so far, one per layer, leaving the factory empty.
    pub fn take(&self) -> Vec<LayerCapture> {
        std::mem::take(&mut *self.store.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

impl CacheFactory for CaptureFactory {
    fn method(&self) -> &str {
        CAPTURE_METHOD
    }

    fn create(&self, layer: usize, geom: &CacheGeometry) -> Result<Box<dyn KvCache>> {
        let mut store = self.store.lock().unwrap_or_else(PoisonError::into_inner);
        while store.len() <= layer {
            store.push(LayerCapture::new(geom));
        }
        Ok(Box::new(CaptureCache {
            inner: F32Cache::new(*geom),
            store: self.store.clone(),
            layer,
            queries: self.queries,
        }))
    }
}

/// The exact f32 cache of one layer, recording what passes through it.
pub struct CaptureCache {
    inner: F32Cache,
    store: Store,
    layer: usize,
    queries: bool,
}

impl CaptureCache {
    fn record(&self, f: impl FnOnce(&mut LayerCapture) -> Result<()>) -> Result<()> {
        let mut store = self.store.lock().unwrap_or_else(PoisonError::into_inner);
        match store.get_mut(self.layer) {
            Some(c) => f(c),
            None => Ok(()),
        }
    }
}

impl KvCache for CaptureCache {
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        self.inner.append(k, v)?;
        self.record(|c| {
            LayerCapture::push(&mut c.keys, k)?;
            LayerCapture::push(&mut c.values, v)
        })
    }

    fn attend(&mut self, q: &Tensor, scale: f32) -> Result<Tensor> {
        let out = self.inner.attend(q, scale)?;
        if self.queries {
            self.record(|c| LayerCapture::push(&mut c.queries, q))?;
        }
        Ok(out)
    }

    fn len(&self) -> usize {
        self.inner.len()
    }

    fn resident_bytes(&self) -> usize {
        self.inner.resident_bytes()
    }

    fn reserve_bytes(&self, tokens: usize, chunk: usize) -> usize {
        self.inner.reserve_bytes(tokens, chunk)
    }

    fn truncate(&mut self, n: usize) -> Result<()> {
        self.inner.truncate(n)
    }

    fn method(&self) -> &str {
        CAPTURE_METHOD
    }

    fn fork(&self) -> Result<Box<dyn KvCache>> {
        // A copy would record the shared prefix twice into the layer's samples.
        Err(crate::CacheError::Calibration(
            "a capture cache records one sequence and cannot be forked".into(),
        ))
    }
}
