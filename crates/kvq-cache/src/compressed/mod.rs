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

mod center;
mod device;

pub use center::{CENTER_ROWS, SHARP_LOGITS};

use crate::attention::{dot, window_start};
use crate::rowbuf::RowBuf;
use crate::traits::{CacheFactory, CacheGeometry, KvCache};
use crate::{CacheError, Result};
use candle_core::Tensor;
use center::Center;
use half::f16;
use half::slice::HalfFloatSliceExt;
use kvq_kernels::{
    AttendParams, Partial, compressed_attend, encode_keys, encode_values, merge_partial,
};
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

/// fp16 rows of one kind (keys or values) for a contiguous range of positions, per head: on
/// the host for a CPU cache (its merge reads them row by row), in a device buffer on a GPU (the
/// kernels read them there).
#[derive(Default)]
struct Fp16Rows {
    /// `[head][pos - first][d]`, one Vec per head (CPU).
    rows: Vec<Vec<f16>>,
    /// The first position held (any before it are gone).
    first: usize,
    /// `[heads, capacity, d]` f16 on the device, when the cache lives there.
    dev: Option<RowBuf>,
}

impl Fp16Rows {
    fn new(heads: usize) -> Self {
        Self {
            rows: vec![Vec::new(); heads],
            first: 0,
            dev: None,
        }
    }

    fn row(&self, h: usize, pos: usize, d: usize, out: &mut [f32]) {
        let i = (pos - self.first) * d;
        self.rows[h][i..i + d].convert_to_f32_slice(out);
    }

    fn fork(&self) -> Result<Self> {
        Ok(Self {
            rows: self.rows.clone(),
            first: self.first,
            dev: self.dev.as_ref().map(RowBuf::fork).transpose()?,
        })
    }

    fn bytes(&self) -> usize {
        match &self.dev {
            Some(d) => d.bytes(),
            None => self.rows.iter().map(|r| r.capacity() * 2).sum(),
        }
    }
}

/// A compressed cache of one layer: codes for every token, fp16 for sinks and the recent window.
pub struct CompressedCache {
    geom: CacheGeometry,
    method: String,
    keys: Arc<dyn KeyCodec>,
    values: Arc<dyn ValueCodec>,
    window: usize,
    sinks: usize,
    key_codes: RowBuf,
    val_codes: RowBuf,
    recent_k: Fp16Rows,
    recent_v: Fp16Rows,
    sink_k: Fp16Rows,
    sink_v: Fp16Rows,
    len: usize,
    /// Drop code rows that left the sliding window (see [`Self::keep_all`]).
    roll: bool,
    center: Center,
    /// Heads whose center carries less of their first keys' energy code raw keys.
    center_share: f32,
    /// Squared norms of the query rows at the positions that fix the center, and their count.
    q_sq: f64,
    q_rows: usize,
    /// The center as a device tensor `[kv heads, d, 1]`, when the cache lives on a GPU.
    mu_dev: Option<Tensor>,
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
        let h = geom.n_kv_heads;
        Self {
            geom,
            method: method.to_string(),
            key_codes: RowBuf::codes(h, keys.code_bytes()),
            val_codes: RowBuf::codes(h, values.code_bytes()),
            keys,
            values,
            window: window.max(1),
            sinks,
            recent_k: Fp16Rows::new(h),
            recent_v: Fp16Rows::new(h),
            sink_k: Fp16Rows::new(h),
            sink_v: Fp16Rows::new(h),
            len: 0,
            roll: true,
            center: Center::Pending,
            center_share: 0.0,
            q_sq: 0.0,
            q_rows: 0,
            mu_dev: None,
        }
    }

    /// Key centering (see the module docs and [`CodecFactory::key_centering`]); the default is
    /// `Some(0.0)`, every head. With `None` no head is centered, and sharp layers are still
    /// recognized.
    pub fn with_key_centering(mut self, centering: Option<f32>) -> Self {
        self.center = Center::Pending;
        self.center_share = centering.unwrap_or(f32::INFINITY);
        self
    }

    /// Keeps the fp16 rows in tensors and attends in tensor ops even on the CPU, as a GPU cache
    /// does: the tests compare that path with the CPU's.
    pub fn tensor_path(mut self) -> Result<Self> {
        self.use_device()?;
        Ok(self)
    }

    /// Keeps every code row even under a sliding window: what the rolling cache must equal
    /// (tests), at the memory it saves.
    pub fn keep_all(mut self) -> Self {
        self.roll = false;
        self
    }

    /// Drops fp16 rows no future query can need (all but the last `window - 1` positions).
    fn trim_recent(&mut self) -> Result<()> {
        if self.holds_rows() {
            // Re-encoded from when the center is fixed, or read by every query of a sharp layer.
            return Ok(());
        }
        let d = self.geom.head_dim;
        let keep_from = self.len.saturating_sub(self.window - 1);
        if keep_from <= self.recent_k.first {
            return Ok(());
        }
        if self.recent_k.dev.is_some() {
            let (len, keep) = (self.len, self.window + 1);
            for rows in [&mut self.recent_k, &mut self.recent_v] {
                rows.first = keep_from;
                if let Some(buf) = &mut rows.dev {
                    buf.shrink(len, keep_from, keep)?;
                }
            }
            return Ok(());
        }
        let drop = (keep_from - self.recent_k.first) * d;
        for rows in [&mut self.recent_k, &mut self.recent_v] {
            for r in rows.rows.iter_mut() {
                r.drain(..drop.min(r.len()));
                // After a long prompt chunk, give the memory back: keep room for the window.
                if r.capacity() > (self.window + 1) * d * 5 / 4 {
                    r.shrink_to((self.window + 1) * d);
                }
            }
            rows.first = keep_from;
        }
        Ok(())
    }

    fn params(&self, t: usize, scale: f32) -> AttendParams {
        AttendParams {
            scale,
            first_pos: self.len - t,
            window: self.window,
            sinks: self.sinks,
            sliding_window: self.geom.sliding_window,
            code_first: self.key_codes.first,
            exact_before: match self.center {
                Center::Off => 0,
                _ if self.is_exact() => usize::MAX,
                Center::Pending | Center::On { .. } => self.sinks + CENTER_ROWS,
            },
        }
    }

    /// Merges the op's compressed partial states with exact attention over the fp16 rows.
    fn merge(&self, q: &[f32], parts: Option<&[f32]>, t: usize, p: AttendParams) -> Vec<f32> {
        let CacheGeometry {
            n_heads,
            n_kv_heads,
            head_dim: d,
            ..
        } = self.geom;
        let group = n_heads / n_kv_heads;
        let mut out = vec![0f32; n_heads * t * d];
        let empty = {
            let mut e = vec![0f32; d + 2];
            e[d] = f32::NEG_INFINITY;
            e
        };
        let mut row = vec![0f32; d];
        let mut scores = Vec::new();
        let mut at = Vec::new();
        for h in 0..n_heads {
            let kh = h / group;
            for r in 0..t {
                let pos = p.first_pos + r;
                let (start, c0, c1) = p.ranges(pos);
                let qrow = &q[(h * t + r) * d..(h * t + r + 1) * d];
                scores.clear();
                at.clear();
                for j in (start..c0).chain(c1..=pos) {
                    let rows = if j < c0 { &self.sink_k } else { &self.recent_k };
                    rows.row(kh, j, d, &mut row);
                    scores.push(dot(qrow, &row) * p.scale);
                    at.push(j);
                }
                let part = match parts {
                    Some(all) if c1 > c0 => &all[(h * t + r) * (d + 2)..(h * t + r + 1) * (d + 2)],
                    _ => &empty[..],
                };
                let mut part = Partial::from_row(part);
                // The codes scored `q . (k - mu)`; softmax needs `q . k`.
                part.max += p.scale * self.center_score(kh, qrow);
                let value = |i: usize, buf: &mut [f32]| {
                    let j = at[i];
                    let rows = if j < c0 { &self.sink_v } else { &self.recent_v };
                    rows.row(kh, j, d, buf);
                };
                let orow = &mut out[(h * t + r) * d..(h * t + r + 1) * d];
                merge_partial(part, &scores, value, orow);
            }
        }
        out
    }
}

impl KvCache for CompressedCache {
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let (kvh, d) = (self.geom.n_kv_heads, self.geom.head_dim);
        let t = self.geom.check_append(self.len, k, v)?;
        if !k.device().is_cpu() && self.recent_k.dev.is_none() {
            self.use_device()?;
        }
        let on_device = self.recent_k.dev.is_some();
        self.trim_recent()?;
        let (k, v) = (k.contiguous()?, v.contiguous()?);
        // Queries of the new rows start at `len`: codes before its sliding window can go.
        let keep_from = match self.roll {
            true => window_start(self.len, self.geom.sliding_window),
            false => 0,
        };
        // A GPU cache never reads its keys back (but for fixing the center, once).
        let kd = match on_device {
            true => None,
            false => Some(k.flatten_all()?.to_vec1::<f32>()?),
        };
        if self.is_exact() {
            // Every query reads fp16 here: codes would only take memory.
            self.key_codes = RowBuf::codes(kvh, self.keys.code_bytes());
            self.val_codes = RowBuf::codes(kvh, self.values.code_bytes());
        } else {
            let (centered, at) = self.keys_to_encode(&k, kd.as_deref())?;
            self.key_codes
                .write(&encode_keys(&self.keys, &centered)?, at, keep_from)?;
            self.val_codes
                .write(&encode_values(&self.values, &v)?, self.len, keep_from)?;
        }
        let Some(kd) = kd else {
            self.push_device(&k, &v)?;
            self.len += t;
            return Ok(());
        };
        let vd = v.flatten_all()?.to_vec1::<f32>()?;
        for h in 0..kvh {
            for i in 0..t {
                let pos = self.len + i;
                let (kr, vr) = (
                    &kd[(h * t + i) * d..(h * t + i + 1) * d],
                    &vd[(h * t + i) * d..(h * t + i + 1) * d],
                );
                let push = |rows: &mut Fp16Rows, x: &[f32]| {
                    rows.rows[h].extend(x.iter().map(|&f| f16::from_f32(f)))
                };
                if pos < self.sinks {
                    push(&mut self.sink_k, kr);
                    push(&mut self.sink_v, vr);
                }
                push(&mut self.recent_k, kr);
                push(&mut self.recent_v, vr);
            }
        }
        self.len += t;
        Ok(())
    }

    fn attend(&mut self, q: &Tensor, scale: f32) -> Result<Tensor> {
        let t = self.geom.check_attend(self.len, q)?;
        let q = q.contiguous()?;
        let first = self.len - t;
        // Only the queries at the positions that fix the center are looked at (a GPU cache
        // reads its queries back for those few positions only).
        let qv = match self.recent_k.dev.is_some() {
            true if first >= self.sinks + CENTER_ROWS || first + t <= self.sinks => None,
            _ => Some(q.flatten_all()?.to_vec1::<f32>()?),
        };
        if let Some(qv) = &qv {
            self.observe_queries(qv, t, first);
        }
        self.decide_exact(self.len - 1, scale);
        let p = self.params(t, scale);
        // The fp16 rows of the first query's window must still be here (they are unless the
        // caller attends twice for the same positions: the first attend released them).
        let (_, _, c1_first) = p.ranges(p.first_pos);
        if c1_first < self.recent_k.first {
            return Err(CacheError::Shape(format!(
                "attend for positions from {} needs fp16 rows from {c1_first}, kept from {}: \
                 append before attending again",
                p.first_pos, self.recent_k.first
            )));
        }
        let Some(qv) = qv.filter(|_| self.recent_k.dev.is_none()) else {
            let out = self.attend_device(&q, t, p)?;
            self.trim_recent()?;
            return Ok(out);
        };
        let (_, c0, c1) = p.ranges(self.len.saturating_sub(1));
        let parts = match (
            c1 > c0,
            self.key_codes.view(self.len)?,
            self.val_codes.view(self.len)?,
        ) {
            (true, Some(kc), Some(vc)) => Some(
                compressed_attend(&self.keys, &self.values, p, &q, &kc, &vc)?
                    .flatten_all()?
                    .to_vec1::<f32>()?,
            ),
            _ => None,
        };
        let out = self.merge(&qv, parts.as_deref(), t, p);
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
        (
            self.key_codes.bytes() + self.recent_k.bytes() + self.sink_k.bytes(),
            self.val_codes.bytes() + self.recent_v.bytes() + self.sink_v.bytes(),
        )
    }

    fn truncate(&mut self, n: usize) -> Result<()> {
        if n >= self.len {
            return Ok(());
        }
        // A query at position n needs fp16 rows from n + 1 - window on (or the sinks).
        let needed = (n + 1).saturating_sub(self.window).max(self.sinks);
        if self.recent_k.first > needed {
            return Err(CacheError::Shape(format!(
                "cannot truncate to {n}: the fp16 rows from position {needed} are gone"
            )));
        }
        let (_, c0, c1) = self.params(0, 1.0).ranges(n);
        if c1 > c0 && c0 < self.key_codes.first {
            return Err(CacheError::Shape(format!(
                "cannot truncate to {n}: the codes from position {c0} left the sliding window"
            )));
        }
        let d = self.geom.head_dim;
        for h in 0..self.geom.n_kv_heads {
            for rows in [&mut self.recent_k, &mut self.recent_v] {
                let keep = n.saturating_sub(rows.first) * d;
                rows.rows[h].truncate(keep);
            }
            for rows in [&mut self.sink_k, &mut self.sink_v] {
                rows.rows[h].truncate(n.min(self.sinks) * d);
            }
        }
        // Code rows past n are simply overwritten by later appends.
        self.len = n;
        if n < self.sinks + CENTER_ROWS
            && self.recent_k.first == 0
            && matches!(self.center, Center::On { .. })
        {
            // The center came from keys that are gone: fix it again from the next ones, as a
            // fresh cache would (every fp16 row is still here to re-encode the kept codes from),
            // and decide sharpness from the queries that come from now on. Without those rows
            // the old center stays: every code was made with it.
            self.center = Center::Pending;
            self.mu_dev = None;
            (self.q_sq, self.q_rows) = (0.0, 0);
        }
        Ok(())
    }

    fn method(&self) -> &str {
        &self.method
    }

    fn fork(&self) -> Result<Box<dyn KvCache>> {
        Ok(Box::new(Self {
            geom: self.geom,
            method: self.method.clone(),
            keys: self.keys.clone(),
            values: self.values.clone(),
            window: self.window,
            sinks: self.sinks,
            key_codes: self.key_codes.fork()?,
            val_codes: self.val_codes.fork()?,
            recent_k: self.recent_k.fork()?,
            recent_v: self.recent_v.fork()?,
            sink_k: self.sink_k.fork()?,
            sink_v: self.sink_v.fork()?,
            len: self.len,
            roll: self.roll,
            center: self.center.clone(),
            center_share: self.center_share,
            q_sq: self.q_sq,
            q_rows: self.q_rows,
            // Never written in place: sharing it is a copy.
            mu_dev: self.mu_dev.clone(),
        }))
    }
}
