//! The frame every compressed method shares: each token's key and value are encoded on append
//! into packed per-head code rows; the most recent `window` tokens and the first `sinks` tokens
//! are also kept in fp16. Attention for a query at position `p` uses fp16 for the sinks and for
//! keys in `(p - window, p]`, and the codes for everything else, which is exactly what the query
//! would see had the text been generated one token at a time. The methods plug in a
//! `KeyCodec` (scores straight from codes) and a `ValueCodec` (accumulates from codes).

use crate::attention::{axpy, dot, softmax_in_place, window_start};
use crate::traits::{CacheGeometry, KvCache};
use crate::{CacheError, Result};
use candle_core::Tensor;
use half::f16;
use half::slice::HalfFloatSliceExt;

/// Positions by which code rows grow (so `resident_bytes` stays close to the promised size).
const GROW_TOKENS: usize = 256;

/// Encodes keys and scores queries against key codes, never reconstructing fp16 keys.
pub trait KeyCodec: Send + Sync {
    /// Bytes of one token's code for one head.
    fn code_bytes(&self) -> usize;
    /// Encodes key `k` (head_dim values) of kv head `head` into `out` (`code_bytes` bytes).
    fn encode(&self, head: usize, k: &[f32], out: &mut [u8]);
    /// Length of the per-query state `prepare` fills.
    fn state_len(&self) -> usize;
    /// Prepares query `q` of kv head `head` once (rotation, sketch, lookup table).
    fn prepare(&self, head: usize, q: &[f32], state: &mut [f32]);
    /// Estimates `q . k` for each of the `out.len()` consecutive token codes in `codes`.
    fn scores(&self, head: usize, state: &[f32], codes: &[u8], out: &mut [f32]);
}

/// Encodes values and accumulates probability-weighted values from codes.
pub trait ValueCodec: Send + Sync {
    /// Bytes of one token's code for one head.
    fn code_bytes(&self) -> usize;
    /// Encodes value `v` of kv head `head` into `out`.
    fn encode(&self, head: usize, v: &[f32], out: &mut [u8]);
    /// `acc += sum_i probs[i] * value_i` for the `probs.len()` consecutive codes, in the codec's
    /// own domain (for example rotated); `acc` has head_dim entries.
    fn accumulate(&self, head: usize, probs: &[f32], codes: &[u8], acc: &mut [f32]);
    /// Maps `acc` from the codec's domain back to values, in place.
    fn finish(&self, head: usize, acc: &mut [f32]);
}

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

/// A compressed cache of one layer: codes for every token, fp16 for sinks and the recent window.
pub struct CompressedCache<K, V> {
    geom: CacheGeometry,
    method: String,
    keys: K,
    values: V,
    window: usize,
    sinks: usize,
    /// Per kv head, `len * code_bytes` bytes.
    key_codes: Vec<Vec<u8>>,
    val_codes: Vec<Vec<u8>>,
    recent_k: Fp16Rows,
    recent_v: Fp16Rows,
    sink_k: Fp16Rows,
    sink_v: Fp16Rows,
    len: usize,
}

impl<K: KeyCodec, V: ValueCodec> CompressedCache<K, V> {
    /// An empty cache keeping `window` recent and `sinks` first tokens in fp16.
    pub fn new(
        geom: CacheGeometry,
        method: &str,
        keys: K,
        values: V,
        window: usize,
        sinks: usize,
    ) -> Self {
        let h = geom.n_kv_heads;
        Self {
            geom,
            method: method.to_string(),
            keys,
            values,
            window: window.max(1),
            sinks,
            key_codes: vec![Vec::new(); h],
            val_codes: vec![Vec::new(); h],
            recent_k: Fp16Rows::new(h),
            recent_v: Fp16Rows::new(h),
            sink_k: Fp16Rows::new(h),
            sink_v: Fp16Rows::new(h),
            len: 0,
        }
    }

    /// Drops fp16 rows no future query can need (all but the last `window - 1` positions).
    fn trim_recent(&mut self) {
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

    fn attend_rows(&self, q: &[f32], t: usize, scale: f32) -> Vec<f32> {
        let CacheGeometry {
            n_heads,
            n_kv_heads,
            head_dim: d,
            sliding_window,
            ..
        } = self.geom;
        let group = n_heads / n_kv_heads;
        let (kb, vb) = (self.keys.code_bytes(), self.values.code_bytes());
        let mut out = vec![0f32; n_heads * t * d];
        let mut scores = vec![0f32; self.len];
        let mut state = vec![0f32; self.keys.state_len()];
        let mut row = vec![0f32; d];
        let mut acc = vec![0f32; d];
        for h in 0..n_heads {
            let kh = h / group;
            for r in 0..t {
                let pos = self.len - t + r;
                let start = window_start(pos, sliding_window);
                // Compressed range: [c0, c1); fp16 elsewhere (sinks below c0, window from c1).
                let c1 = (pos + 1).saturating_sub(self.window).max(start);
                let c0 = self.sinks.max(start).min(c1);
                let qrow = &q[(h * t + r) * d..(h * t + r + 1) * d];
                for (j, s) in scores.iter_mut().enumerate().take(c0).skip(start) {
                    self.sink_k.row(kh, j, d, &mut row);
                    *s = dot(qrow, &row) * scale;
                }
                if c1 > c0 {
                    self.keys.prepare(kh, qrow, &mut state);
                    let codes = &self.key_codes[kh][c0 * kb..c1 * kb];
                    self.keys.scores(kh, &state, codes, &mut scores[c0..c1]);
                    scores[c0..c1].iter_mut().for_each(|s| *s *= scale);
                }
                for (j, s) in scores.iter_mut().enumerate().take(pos + 1).skip(c1) {
                    self.recent_k.row(kh, j, d, &mut row);
                    *s = dot(qrow, &row) * scale;
                }
                softmax_in_place(&mut scores[start..=pos]);
                let orow = &mut out[(h * t + r) * d..(h * t + r + 1) * d];
                for (j, &p) in scores.iter().enumerate().take(c0).skip(start) {
                    self.sink_v.row(kh, j, d, &mut row);
                    axpy(orow, p, &row);
                }
                for (j, &p) in scores.iter().enumerate().take(pos + 1).skip(c1) {
                    self.recent_v.row(kh, j, d, &mut row);
                    axpy(orow, p, &row);
                }
                if c1 > c0 {
                    acc.fill(0.0);
                    let codes = &self.val_codes[kh][c0 * vb..c1 * vb];
                    self.values.accumulate(kh, &scores[c0..c1], codes, &mut acc);
                    self.values.finish(kh, &mut acc);
                    orow.iter_mut().zip(&acc).for_each(|(o, a)| *o += a);
                }
            }
        }
        out
    }
}

fn grow(v: &mut Vec<u8>, extra: usize, unit: usize) {
    if v.len() + extra > v.capacity() {
        let want = (v.len() + extra).div_ceil(GROW_TOKENS * unit) * GROW_TOKENS * unit;
        v.reserve_exact(want - v.len());
    }
}

impl<K: KeyCodec, V: ValueCodec> KvCache for CompressedCache<K, V> {
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let (kvh, d) = (self.geom.n_kv_heads, self.geom.head_dim);
        let t = self.geom.check_append(self.len, k, v)?;
        self.trim_recent();
        let kd = k.flatten_all()?.to_vec1::<f32>()?;
        let vd = v.flatten_all()?.to_vec1::<f32>()?;
        let (kb, vb) = (self.keys.code_bytes(), self.values.code_bytes());
        for h in 0..kvh {
            grow(&mut self.key_codes[h], t * kb, kb);
            grow(&mut self.val_codes[h], t * vb, vb);
            for i in 0..t {
                let pos = self.len + i;
                let (kr, vr) = (
                    &kd[(h * t + i) * d..(h * t + i + 1) * d],
                    &vd[(h * t + i) * d..(h * t + i + 1) * d],
                );
                let ko = self.key_codes[h].len();
                self.key_codes[h].resize(ko + kb, 0);
                self.keys.encode(h, kr, &mut self.key_codes[h][ko..]);
                let vo = self.val_codes[h].len();
                self.val_codes[h].resize(vo + vb, 0);
                self.values.encode(h, vr, &mut self.val_codes[h][vo..]);
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
        let qv = q.flatten_all()?.to_vec1::<f32>()?;
        let out = self.attend_rows(&qv, t, scale);
        // Later queries sit at positions >= len: the fp16 rows of a long chunk can go now.
        self.trim_recent();
        Ok(Tensor::from_vec(out, q.dims(), q.device())?)
    }

    fn len(&self) -> usize {
        self.len
    }

    fn resident_bytes(&self) -> usize {
        let codes: usize = self
            .key_codes
            .iter()
            .chain(&self.val_codes)
            .map(|c| c.capacity())
            .sum();
        codes
            + self.recent_k.bytes()
            + self.recent_v.bytes()
            + self.sink_k.bytes()
            + self.sink_v.bytes()
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
        let d = self.geom.head_dim;
        let (kb, vb) = (self.keys.code_bytes(), self.values.code_bytes());
        for h in 0..self.geom.n_kv_heads {
            self.key_codes[h].truncate(n * kb);
            self.val_codes[h].truncate(n * vb);
            for rows in [&mut self.recent_k, &mut self.recent_v] {
                let keep = n.saturating_sub(rows.first) * d;
                rows.rows[h].truncate(keep);
            }
            for rows in [&mut self.sink_k, &mut self.sink_v] {
                rows.rows[h].truncate(n.min(self.sinks) * d);
            }
        }
        self.len = n;
        Ok(())
    }

    fn method(&self) -> &str {
        &self.method
    }
}
