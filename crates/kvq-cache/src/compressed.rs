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
//! fp16, so no query depends on how the text was split into appends. A factory turns centering
//! off where its codecs expect raw keys (VecInfer) or where it measured worse (a preset's
//! `center_keys = false`).

use crate::attention::{dot, window_start};
use crate::traits::{CacheFactory, CacheGeometry, KvCache};
use crate::{CacheError, Result};
use candle_core::{DType, Tensor};
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
    /// Whether keys are coded centered (see the module docs); methods whose codecs were trained
    /// on raw keys (VecInfer's codebooks) say no.
    fn center_keys(&self) -> bool {
        true
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
            .with_key_centering(self.center_keys()),
        ))
    }
}

/// Keys past the sinks the key center is the mean of; it is fixed once a layer has seen them.
/// Few and early on purpose: Qwen2.5 makes secondary attention sinks of its system prompt's
/// punctuation (positions 2-23 hold 35% of the attention in its middle layers), and a center
/// close to them codes them best. Measured (KL divergence vs fp16 on SmolLM2, ctx 512, 8 chunks;
/// raw / 16 rows / 64 rows): MSE 4-bit 0.0075 / 0.0066 / 0.0074, Prod 3-bit 0.343 / 0.160 /
/// 0.177, QJL 3-bit 0.648 / 0.643 / 0.484, RVQ 2-bit 0.141 / 0.174 / 0.180. Qwen2.5's chat
/// answer at MSE 4-bit and 4 sinks stays clean with 16 and 28 rows and breaks with 64 (raw, it
/// breaks after ~70 tokens); Prod and QJL 4-bit still slip a word here and there.
pub const CENTER_ROWS: usize = 16;

/// The key center of a cache (see the module docs).
enum Center {
    /// Not fixed yet: codes so far are of raw keys and get re-encoded when it is.
    Pending,
    /// Keys are coded raw: centering is off, or the early keys' fp16 rows were gone when the
    /// center could have been fixed.
    Off,
    /// `[kv head][d]`, subtracted from every key before encoding.
    On(Vec<f32>),
}

/// Positions by which code rows grow (so `resident_bytes` stays close to the promised size).
const GROW_TOKENS: usize = 256;

/// fp16 rows of one kind (keys or values) for a contiguous range of positions, per head.
#[derive(Default)]
struct Fp16Rows {
    /// `[head][pos - first][d]`, one Vec per head.
    rows: Vec<Vec<f16>>,
    first: usize,
}

impl Fp16Rows {
    fn new(heads: usize) -> Self {
        Self {
            rows: vec![Vec::new(); heads],
            first: 0,
        }
    }

    fn row(&self, h: usize, pos: usize, d: usize, out: &mut [f32]) {
        let i = (pos - self.first) * d;
        self.rows[h][i..i + d].convert_to_f32_slice(out);
    }

    fn bytes(&self) -> usize {
        self.rows.iter().map(|r| r.capacity() * 2).sum()
    }
}

/// A growable `[heads, capacity, width]` u8 tensor of code rows, grown in `GROW_TOKENS` steps.
/// Row `i` holds position `first + i`: under a sliding window, rows no query can reach are
/// dropped when the buffer is next reallocated, so it stops growing at the window.
struct CodeBuf {
    buf: Option<Tensor>,
    cap: usize,
    width: usize,
    heads: usize,
    first: usize,
}

impl CodeBuf {
    fn new(heads: usize, width: usize) -> Self {
        Self {
            buf: None,
            cap: 0,
            width,
            heads,
            first: 0,
        }
    }

    /// Writes `codes` (`[heads, t, width]`) for positions `len..len + t`; positions before
    /// `keep_from` may be dropped (they are when the buffer has to grow).
    fn write(&mut self, codes: &Tensor, len: usize, keep_from: usize) -> Result<()> {
        let t = codes.dim(1)?;
        if self.buf.is_none() || len < self.first || len - self.first + t > self.cap {
            let first = keep_from.max(self.first.min(len)).min(len);
            let live = len - first;
            // A rolling buffer keeps a step of slack so it is reallocated once per GROW_TOKENS.
            let slack = if first > 0 { GROW_TOKENS } else { 0 };
            let cap = (live + t).div_ceil(GROW_TOKENS) * GROW_TOKENS + slack;
            let fresh = Tensor::zeros((self.heads, cap, self.width), DType::U8, codes.device())?;
            if let (Some(old), true) = (&self.buf, live > 0) {
                let rows = old.narrow(1, first - self.first, live)?.contiguous()?;
                fresh.slice_set(&rows, 1, 0)?;
            }
            self.buf = Some(fresh);
            self.cap = cap;
            self.first = first;
        }
        if let Some(buf) = &self.buf {
            buf.slice_set(&codes.contiguous()?, 1, len - self.first)?;
        }
        Ok(())
    }

    /// The rows of positions `first..len`, as a view.
    fn view(&self, len: usize) -> Result<Option<Tensor>> {
        Ok(match &self.buf {
            Some(b) => Some(b.narrow(1, 0, len.saturating_sub(self.first))?),
            None => None,
        })
    }

    /// Shrinks to `len` rows (the capacity keeps its size; rows past `len` are overwritten later).
    fn bytes(&self) -> usize {
        self.heads * self.cap * self.width
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
    key_codes: CodeBuf,
    val_codes: CodeBuf,
    recent_k: Fp16Rows,
    recent_v: Fp16Rows,
    sink_k: Fp16Rows,
    sink_v: Fp16Rows,
    len: usize,
    /// Drop code rows that left the sliding window (see [`Self::keep_all`]).
    roll: bool,
    center: Center,
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
            key_codes: CodeBuf::new(h, keys.code_bytes()),
            val_codes: CodeBuf::new(h, values.code_bytes()),
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
        }
    }

    /// Turns key centering (see the module docs) on (the default) or off.
    pub fn with_key_centering(mut self, on: bool) -> Self {
        self.center = if on { Center::Pending } else { Center::Off };
        self
    }

    /// The key rows to encode for an append of `k` (`[kv heads, t, d]`; `kd` its values) and the
    /// position they start at. Centered keys are rounded to fp16 first, so a center fixed in a
    /// prefill chunk and one fixed by single decode steps (from the fp16 rows) code alike: what
    /// a query sees does not depend on how the text was split into appends.
    fn keys_to_encode(&mut self, k: &Tensor, kd: &[f32]) -> Result<(Tensor, usize)> {
        let (kvh, t, d) = k.dims3()?;
        let (len, end, want) = (self.len, self.len + t, self.sinks + CENTER_ROWS);
        let round = |x: &f32| f16::from_f32(*x).to_f32();
        let fix_now = match self.center {
            Center::Off => return Ok((k.clone(), len)),
            Center::Pending if end < want => return Ok((k.clone(), len)),
            // Not reached (fp16 rows are kept while pending); the codes so far are raw.
            Center::Pending if self.recent_k.first > 0 => {
                self.center = Center::Off;
                return Ok((k.clone(), len));
            }
            Center::Pending => true,
            Center::On(_) => false,
        };
        let (from, rows) = if fix_now { (0, end) } else { (len, t) };
        // `[kv head][rows][d]`: every key so far when the center is fixed now (the earlier ones
        // from their fp16 rows, all kept while it was pending), else the new ones.
        let mut x = vec![0f32; kvh * rows * d];
        for (h, dst) in x.chunks_mut(rows * d).enumerate() {
            let (early, new) = dst.split_at_mut((len - from) * d);
            if fix_now {
                self.recent_k.rows[h][..len * d].convert_to_f32_slice(early);
            }
            for (o, v) in new.iter_mut().zip(&kd[h * t * d..(h + 1) * t * d]) {
                *o = round(v);
            }
        }
        if fix_now {
            let mut mu = vec![0f32; kvh * d];
            for (h, m) in mu.chunks_mut(d).enumerate() {
                for r in self.sinks..want {
                    let row = &x[(h * rows + r) * d..(h * rows + r + 1) * d];
                    m.iter_mut().zip(row).for_each(|(m, v)| *m += v);
                }
                m.iter_mut().for_each(|m| *m /= CENTER_ROWS as f32);
            }
            self.center = Center::On(mu);
        }
        if let Center::On(mu) = &self.center {
            for (h, dst) in x.chunks_mut(rows * d).enumerate() {
                let m = &mu[h * d..(h + 1) * d];
                for row in dst.chunks_mut(d) {
                    row.iter_mut().zip(m).for_each(|(v, m)| *v -= m);
                }
            }
        }
        Ok((Tensor::from_vec(x, (kvh, rows, d), k.device())?, from))
    }

    /// Keeps every code row even under a sliding window: what the rolling cache must equal
    /// (tests), at the memory it saves.
    pub fn keep_all(mut self) -> Self {
        self.roll = false;
        self
    }

    /// Drops fp16 rows no future query can need (all but the last `window - 1` positions).
    fn trim_recent(&mut self) {
        if let Center::Pending = self.center {
            // The keys the center is fixed from are re-encoded from these rows.
            return;
        }
        let d = self.geom.head_dim;
        let keep_from = self.len.saturating_sub(self.window - 1);
        if keep_from <= self.recent_k.first {
            return;
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
                Center::Pending | Center::On(_) => self.sinks + CENTER_ROWS,
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
                if let Center::On(mu) = &self.center {
                    // The codes scored `q . (k - mu)`; softmax needs `q . k`.
                    part.max += p.scale * dot(qrow, &mu[kh * d..(kh + 1) * d]);
                }
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
        self.trim_recent();
        let (k, v) = (k.contiguous()?, v.contiguous()?);
        // Queries of the new rows start at `len`: codes before its sliding window can go.
        let keep_from = match self.roll {
            true => window_start(self.len, self.geom.sliding_window),
            false => 0,
        };
        let kd = k.flatten_all()?.to_vec1::<f32>()?;
        let (centered, at) = self.keys_to_encode(&k, &kd)?;
        self.key_codes
            .write(&encode_keys(&self.keys, &centered)?, at, keep_from)?;
        self.val_codes
            .write(&encode_values(&self.values, &v)?, self.len, keep_from)?;
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
        let q = q.contiguous()?;
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
        let qv = q.flatten_all()?.to_vec1::<f32>()?;
        let out = self.merge(&qv, parts.as_deref(), t, p);
        // Later queries sit at positions >= len: the fp16 rows of a long chunk can go now.
        self.trim_recent();
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
            && matches!(self.center, Center::On(_))
        {
            // The center came from keys that are gone: fix it again from the next ones, as a
            // fresh cache would (every fp16 row is still here to re-encode the kept codes from).
            // Without those rows the old center stays: every code was made with it.
            self.center = Center::Pending;
        }
        Ok(())
    }

    fn method(&self) -> &str {
        &self.method
    }
}
