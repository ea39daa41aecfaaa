//! The frame every compressed method shares: each token's key and value are encoded on append
//! into packed per-head code rows; the most recent `window` tokens and the first `sinks` tokens
//! are also kept in fp16. Attention for a query at position `p` uses fp16 for the sinks and for
//! keys in `(p - window, p]`, and the codes for everything else, which is exactly what the query
//! would see had the text been generated one token at a time. The methods plug in a
//! `KeyCodec` (scores straight from codes) and a `ValueCodec` (accumulates from codes); encoding
//! and the compressed part of attention run as kvq-kernels custom ops on the code tensors.
//!
//! Keys are coded centered: each kv head subtracts one fixed vector `mu` (the mean of its first
//! keys past the sinks) before encoding, and the compressed part's scores get `q . mu` back (a
//! shift of its softmax maximum), so attention is unchanged while the codes spend their bits on
//! what varies between keys. Qwen2.5's keys carry a common part (its k bias) of up to 99.8% of
//! their energy in some layers; coded raw, its chat answers fall apart after ~70 tokens at 4 bits.
//! Queries before the center is fixed (positions below `sinks + CENTER_ROWS`) read every key from
//! fp16, so no query depends on how the text was split into appends.
//!
//! Which heads: a factory says ([`CodecFactory::key_centering`]). A head whose center carries
//! less than the factory's share of its first keys' energy codes raw keys (zero center).
//! TurboQuant and QJL center every head by default (a preset may set `center_min_share`);
//! VecInfer, whose codebooks were trained on raw keys, none. Perplexity at ctx 2048, raw -> every
//! head centered: Gemma-3-270M MSE 3-bit +18.1% -> +5.0%, Prod 4-bit +58% -> +15.5%; SmolLM2
//! Prod 3-bit +33.3% -> +24.4%, QJL 4-bit +48.5% -> +44.1%, but MSE 4-bit +0.28% -> +0.53% (a
//! scalar code's error on a shared part is shared by every key and cancels in softmax, so
//! centering gains little there); Qwen2.5 MSE 4-bit +2122% -> +165%, and +0.37% once its sharp
//! layer stays fp16 (docs/benchmarks/quality.md).
//!
//! Sharp layers: a layer whose logits spread too far for any code (Qwen2.5's layer 0) keeps
//! every key in fp16 and holds no codes, whatever the method (VecInfer too); it is recognized
//! from the queries and keys at the positions that fix the center ([`SHARP_LOGITS`],
//! `center.rs`), so this decision too is the same however the text was split. A cache that never
//! sees a query at those positions (one that attends only its last rows) does not call its layer
//! sharp. Such a layer does not roll under a sliding window.
//!
//! The parts, each with its own invariant (stated in its file), which [`CompressedCache`]
//! orchestrates through append, attend, truncate and fork:
//! - `codes.rs`, `Codes`: the codecs and the code rows of positions `[first, len)`.
//! - `exact_rows.rs`, `ExactRows`: the fp16 rows, the window's `[first, len)` and the sinks'
//!   `[0, min(len, sinks))`, on the host or the device, and the policy that trims the window.
//! - `center.rs`, `KeyCenter`: the key center, the query statistics and the sharpness decision,
//!   all made from positions below `sinks + CENTER_ROWS` only.
//! - `merge.rs`: a CPU cache's merge of the codes' partial states with the fp16 rows;
//!   `device.rs`: the same on a device (and the fused CUDA decode step).
//! - `state.rs`: saving and restoring the whole (`KvCache::save_state`), each part writing and
//!   checking its own tensors.

mod center;
mod codes;
mod device;
mod exact_rows;
mod merge;
mod state;

pub use center::{CENTER_ROWS, SHARP_LOGITS};

use crate::attention::window_start;
use crate::traits::{CacheFactory, CacheGeometry, CacheState, KvCache};
use crate::{CacheError, Result};
use candle_core::{Device, Tensor};
use center::KeyCenter;
use codes::Codes;
use exact_rows::ExactRows;
use kvq_kernels::AttendParams;
use std::sync::Arc;

pub use kvq_kernels::{KernelKind, KeyCodec, ValueCodec};

/// A compressed method's factory: it names the key and value codecs of a layer and where the
/// fp16 rows go; the cache around them is always [`CompressedCache`] (every such factory is a
/// [`CacheFactory`]).
pub trait CodecFactory: Send + Sync {
    type Keys: KeyCodec + 'static;
    type Values: ValueCodec + 'static;
    /// The method name, e.g. `turboquant-mse`.
    fn method(&self) -> &'static str;
    /// The codecs of layer `layer` at geometry `geom`.
    fn codecs(&self, layer: usize, geom: &CacheGeometry) -> Result<(Self::Keys, Self::Values)>;
    /// Recent tokens kept in fp16.
    fn window(&self) -> usize;
    /// First tokens kept in fp16.
    fn sinks(&self) -> usize;
    /// Which keys are coded centered (see the module docs): `None` none (VecInfer: its codebooks
    /// were trained on raw keys); `Some(share)` the kv heads whose center carries at least
    /// `share` of their first keys' energy (`0.0`: every head). Sharp layers stay fp16 either way.
    fn key_centering(&self) -> Option<f32> {
        Some(0.0)
    }
}

impl<F: CodecFactory> CacheFactory for F {
    fn method(&self) -> &str {
        CodecFactory::method(self)
    }

    fn create(&self, layer: usize, geom: &CacheGeometry) -> Result<Box<dyn KvCache>> {
        let (keys, values) = self.codecs(layer, geom)?;
        Ok(Box::new(
            CompressedCache::new(
                *geom,
                CodecFactory::method(self),
                Arc::new(keys),
                Arc::new(values),
                self.window(),
                self.sinks(),
            )
            .with_key_centering(self.key_centering()),
        ))
    }
}

/// A compressed cache of one layer: codes for every token, fp16 for sinks and the recent window.
pub struct CompressedCache {
    geom: CacheGeometry,
    method: String,
    /// The codecs and the code rows of positions `[codes.first(), len)`.
    codes: Codes,
    /// The fp16 rows: the window `[exact.first(), len)` and the sinks.
    exact: ExactRows,
    /// The key center and the sharpness decision.
    center: KeyCenter,
    len: usize,
    /// Drop code rows that left the sliding window (see [`Self::keep_all`]).
    roll: bool,
}

impl CompressedCache {
    /// An empty cache keeping `window` recent and `sinks` first tokens in fp16.
    pub fn new(
        geom: CacheGeometry,
        method: &str,
        keys: Arc<dyn KeyCodec>,
        values: Arc<dyn ValueCodec>,
        window: usize,
        sinks: usize,
    ) -> Self {
        let (h, d) = (geom.n_kv_heads, geom.head_dim);
        Self {
            geom,
            method: method.to_string(),
            codes: Codes::new(h, keys, values),
            exact: ExactRows::new(h, d, window, sinks),
            center: KeyCenter::new(geom, sinks),
            len: 0,
            roll: true,
        }
    }

    /// Key centering (see the module docs and [`CodecFactory::key_centering`]); the default is
    /// `Some(0.0)`, every head. With `None` no head is centered, and sharp layers are still
    /// recognized.
    pub fn with_key_centering(mut self, centering: Option<f32>) -> Self {
        self.center.set_centering(centering);
        self
    }

    /// Keeps the fp16 rows in tensors and attends in tensor ops even on the CPU, as a GPU cache
    /// does: the tests compare that path with the CPU's.
    pub fn tensor_path(mut self) -> Result<Self> {
        self.exact.use_device();
        Ok(self)
    }

    /// Keeps every code row even under a sliding window: what the rolling cache must equal
    /// (tests), at the memory it saves.
    pub fn keep_all(mut self) -> Self {
        self.roll = false;
        self
    }

    /// Drops fp16 rows no future query can need (all but the last `window - 1` positions),
    /// unless the key center still needs them all.
    fn trim_recent(&mut self) -> Result<()> {
        if self.center.holds_rows() {
            // Re-encoded from when the center is fixed, or read by every query of a sharp layer.
            return Ok(());
        }
        self.exact.trim(self.len)
    }

    fn params(&self, t: usize, scale: f32) -> AttendParams {
        AttendParams {
            scale,
            first_pos: self.len - t,
            window: self.exact.window(),
            sinks: self.exact.sinks(),
            sliding_window: self.geom.sliding_window,
            code_first: self.codes.first(),
            exact_before: self.center.exact_before(),
        }
    }
}

impl KvCache for CompressedCache {
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let t = self.geom.check_append(self.len, k, v)?;
        if !k.device().is_cpu() && !self.exact.on_device() {
            self.exact.use_device();
        }
        let on_device = self.exact.on_device();
        self.trim_recent()?;
        let (k, v) = (k.contiguous()?, v.contiguous()?);
        // Queries of the new rows start at `len`: codes before its sliding window can go.
        let keep_from = match self.roll {
            true => window_start(self.len, self.geom.sliding_window),
            false => 0,
        };
        #[cfg(feature = "cuda")]
        if on_device && k.device().is_cuda() && !self.center.is_exact() {
            // A decode step on CUDA: three launches, nothing read back or copied.
            if let Some(mu) = self.center.device_encoding(self.len, t) {
                self.codes.write_cuda(&k, mu, &v, self.len, keep_from)?;
                self.exact.push_cuda(&k, &v, self.len)?;
                self.len += t;
                return Ok(());
            }
        }
        // A GPU cache never reads its keys back (but for fixing the center, once).
        let kd = match on_device {
            true => None,
            false => Some(k.flatten_all()?.to_vec1::<f32>()?),
        };
        if self.center.is_exact() {
            // Every query reads fp16 here: codes would only take memory.
            self.codes.clear();
        } else {
            let (centered, at) =
                self.center
                    .keys_to_encode(&k, kd.as_deref(), self.len, &self.exact)?;
            self.codes.write(&centered, at, &v, self.len, keep_from)?;
        }
        let Some(kd) = kd else {
            self.exact.push_device(&k, &v, self.len)?;
            self.len += t;
            return Ok(());
        };
        let vd = v.flatten_all()?.to_vec1::<f32>()?;
        self.exact.push_host(&kd, &vd, self.len, t);
        self.len += t;
        Ok(())
    }

    fn attend(&mut self, q: &Tensor, scale: f32) -> Result<Tensor> {
        let t = self.geom.check_attend(self.len, q)?;
        let q = q.contiguous()?;
        let first = self.len - t;
        // Only the queries at the positions that fix the center are looked at (a GPU cache
        // reads its queries back for those few positions only).
        let qv = match self.exact.on_device() {
            true if !self.center.observes(first, t) => None,
            _ => Some(q.flatten_all()?.to_vec1::<f32>()?),
        };
        if let Some(qv) = &qv {
            self.center.observe_queries(qv, t, first);
        }
        self.center.decide_exact(self.len - 1, scale);
        let p = self.params(t, scale);
        // The fp16 rows of the first query's window must still be here (they are unless the
        // caller attends twice for the same positions: the first attend released them).
        let (_, _, c1_first) = p.ranges(p.first_pos);
        if c1_first < self.exact.first() {
            return Err(CacheError::Shape(format!(
                "attend for positions from {} needs fp16 rows from {c1_first}, kept from {}: \
                 append before attending again",
                p.first_pos,
                self.exact.first()
            )));
        }
        let Some(qv) = qv.filter(|_| !self.exact.on_device()) else {
            let out = self.attend_device(&q, t, p)?;
            self.trim_recent()?;
            return Ok(out);
        };
        let (_, c0, c1) = p.ranges(self.len.saturating_sub(1));
        let parts = match self.codes.views(self.len)?.filter(|_| c1 > c0) {
            Some(codes) => Some(
                self.codes
                    .attend(p, &q, &codes)?
                    .flatten_all()?
                    .to_vec1::<f32>()?,
            ),
            None => None,
        };
        let out = merge::merge(
            &self.geom,
            &self.exact,
            &self.center,
            &qv,
            parts.as_deref(),
            t,
            p,
        )?;
        // Later queries sit at positions >= len: the fp16 rows of a long chunk can go now.
        self.trim_recent()?;
        Ok(Tensor::from_vec(out, q.dims(), q.device())?)
    }

    fn len(&self) -> usize {
        self.len
    }

    fn resident_bytes(&self) -> usize {
        let (k, v) = self.resident_split();
        k + v
    }

    fn resident_split(&self) -> (usize, usize) {
        let ((ck, cv), (xk, xv)) = (self.codes.bytes(), self.exact.bytes());
        (ck + xk, cv + xv)
    }

    fn reserve_bytes(&self, tokens: usize, chunk: usize) -> usize {
        let (tokens, chunk) = (tokens.max(self.len), chunk.max(1));
        if self.center.is_exact() {
            // A sharp layer holds no codes and every key and value in fp16.
            return self.exact.max_bytes(tokens, tokens);
        }
        // After an attend the window rows are all there while the center and the sharpness
        // are pending (up to position `sinks + CENTER_ROWS`), else the window's.
        let pending = self.exact.sinks() + CENTER_ROWS + 1;
        let recent = tokens.min(self.exact.window().max(pending) + 2 + self.exact.rewind());
        // Code rows: every position, or under a rolling sliding window its span and a chunk.
        let (codes, rolling) = match (self.geom.sliding_window, self.roll) {
            (Some(w), true) if w + chunk < tokens => (w + chunk, true),
            _ => (tokens, false),
        };
        self.codes.max_bytes(codes, rolling) + self.exact.max_bytes(tokens, recent)
    }

    fn truncate(&mut self, n: usize) -> Result<()> {
        if n >= self.len {
            return Ok(());
        }
        // A query at position n needs fp16 rows from n + 1 - window on (or the sinks).
        self.exact.check_truncate(n)?;
        let (_, c0, c1) = self.params(0, 1.0).ranges(n);
        if c1 > c0 && c0 < self.codes.first() {
            return Err(CacheError::Shape(format!(
                "cannot truncate to {n}: the codes from position {c0} left the sliding window"
            )));
        }
        self.exact.truncate(n);
        // Code rows past n are simply overwritten by later appends.
        self.len = n;
        self.center.truncate(n, self.exact.first());
        Ok(())
    }

    fn can_truncate(&self, n: usize) -> bool {
        if n >= self.len {
            return true;
        }
        let (_, c0, c1) = self.params(0, 1.0).ranges(n);
        self.exact.check_truncate(n).is_ok() && !(c1 > c0 && c0 < self.codes.first())
    }

    fn allow_rewind(&mut self, tokens: usize) {
        self.exact.set_rewind(tokens);
    }

    fn method(&self) -> &str {
        &self.method
    }

    fn fork(&self) -> Result<Box<dyn KvCache>> {
        Ok(Box::new(Self {
            geom: self.geom,
            method: self.method.clone(),
            codes: self.codes.fork()?,
            exact: self.exact.fork()?,
            center: self.center.clone(),
            len: self.len,
            roll: self.roll,
        }))
    }

    fn save_state(&self) -> Result<CacheState> {
        self.save()
    }

    fn restore_state(&mut self, state: &CacheState, device: &Device) -> Result<()> {
        self.restore(state, device)
    }
}
