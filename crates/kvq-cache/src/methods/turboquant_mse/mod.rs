//! TurboQuant-MSE: rotate by a seeded randomized Hadamard transform, store `||x||` in fp16 and
//! each rotated coordinate of `x / ||x||` as a b-bit index into the Lloyd-Max codebook for
//! N(0, 1/d). Keys are scored by rotating the query once and gathering codebook values; values
//! are accumulated in the rotated domain and rotated back once per query row. The loops live in
//! `kernel` (AVX-512 and portable paths, each tested against a plain reference); `rotated` is the
//! frame this method shares with TurboQuant-RVQ.

use crate::codec::bitpack;
use crate::codec::lloyd_max::{Codebook, Dist, codebook};
use crate::compressed::{CompressedCache, KernelKind, KeyCodec, ValueCodec};
use crate::registry::{MethodEntry, param};
use crate::traits::{CacheFactory, CacheGeometry, KvCache};
use crate::{CacheError, Result};
use half::f16;
use kernel::{Isa, Table};
use rotated::Rotated;
use std::sync::Arc;

pub mod kernel;
pub(crate) mod rotated;
#[cfg(test)]
pub(crate) mod test_support;

/// Registry name.
pub const METHOD: &str = "turboquant-mse";

/// One layer's rotations and codebook; encodes keys or values.
pub struct MseCodec {
    core: Rotated,
    book: &'static Codebook,
}

impl MseCodec {
    /// Rotations seeded by (`seed`, layer, head); `bits` in 1..=6.
    pub fn new(d: usize, heads: usize, bits: u32, layer: usize, seed: u64) -> Result<Self> {
        if !(1..=kernel::MAX_BITS).contains(&bits) {
            return Err(CacheError::InvalidBits {
                method: METHOD.into(),
                bits: bits.min(255) as u8,
                valid: (1..=kernel::MAX_BITS as u8).collect(),
            });
        }
        let book = codebook(Dist::Gaussian, bits);
        let core = Rotated::new(METHOD, d, heads, Table::new(&book.levels), layer, seed)?;
        Ok(Self { core, book })
    }

    /// Runs the kernels on `isa` instead of the fastest one (tests and benches).
    pub fn with_isa(mut self, isa: Isa) -> Self {
        self.core.set_isa(isa);
        self
    }

    fn encode_row(&self, head: usize, x: &[f32], out: &mut [u8]) {
        let th = &self.book.thresholds;
        self.core
            .encode(head, x, out, |y, idx| kernel::quantize_into(th, y, idx));
    }

    /// The definition `encode` is tested against: each coordinate's level found by a search of
    /// the thresholds, packed one code at a time.
    pub fn encode_reference(&self, head: usize, x: &[f32], out: &mut [u8]) {
        let mut u = vec![0f32; self.core.d()];
        let norm = self.core.rotate_scaled(head, x, &mut u);
        out[..2].copy_from_slice(&f16::from_f32(norm).to_le_bytes());
        let idx: Vec<u8> = u.iter().map(|&v| self.book.quantize(v)).collect();
        bitpack::pack(&idx, self.core.table().bits(), &mut out[2..]);
    }

    /// Estimates `q . k` for one key code, from the state `KeyCodec::prepare` filled (other
    /// methods built on this stage, such as TurboQuant-Prod, call it per code).
    pub fn score_one(&self, state: &[f32], code: &[u8]) -> f32 {
        let mut s = [0f32];
        let cb = <Self as KeyCodec>::code_bytes(self);
        self.core.scores(state, &code[..cb], cb, &mut s);
        s[0]
    }

    /// `score_one` for `out.len()` rows of `stride` bytes that each begin with a code of this
    /// codec (a method storing more per row scores its first stage in one call).
    pub fn score_rows(&self, state: &[f32], codes: &[u8], stride: usize, out: &mut [f32]) {
        self.core.scores(state, codes, stride, out);
    }

    /// The definition `scores` is tested against: one index at a time.
    pub fn score_one_reference(&self, state: &[f32], code: &[u8]) -> f32 {
        let bits = self.core.table().bits();
        let acc: f32 = (0..self.core.d())
            .map(|i| state[i] * self.core.table().level(bitpack::get(&code[2..], bits, i)))
            .sum();
        acc * Rotated::norm_of(code)
    }
}

impl KeyCodec for MseCodec {
    fn head_dim(&self) -> usize {
        self.core.d()
    }

    fn kernel(&self) -> KernelKind {
        KernelKind::ScalarCodebook
    }

    fn decode(&self, head: usize, code: &[u8], out: &mut [f32]) {
        self.core.decode(head, code, out);
    }

    fn code_bytes(&self) -> usize {
        self.core.code_bytes()
    }

    fn encode(&self, head: usize, k: &[f32], out: &mut [u8]) {
        self.encode_row(head, k, out);
    }

    fn state_len(&self) -> usize {
        self.core.d()
    }

    fn prepare(&self, head: usize, q: &[f32], state: &mut [f32]) {
        self.core.prepare(head, q, state);
    }

    fn scores(&self, _head: usize, state: &[f32], codes: &[u8], out: &mut [f32]) {
        self.core.scores(state, codes, self.core.code_bytes(), out);
    }
}

impl ValueCodec for MseCodec {
    fn head_dim(&self) -> usize {
        self.core.d()
    }

    fn kernel(&self) -> KernelKind {
        KernelKind::ScalarCodebook
    }

    fn decode(&self, head: usize, code: &[u8], out: &mut [f32]) {
        self.core.decode(head, code, out);
    }

    fn code_bytes(&self) -> usize {
        self.core.code_bytes()
    }

    fn encode(&self, head: usize, v: &[f32], out: &mut [u8]) {
        self.encode_row(head, v, out);
    }

    fn accumulate(&self, _head: usize, probs: &[f32], codes: &[u8], acc: &mut [f32]) {
        self.core
            .accumulate(probs, codes, self.core.code_bytes(), acc);
    }

    fn finish(&self, head: usize, acc: &[f32], out: &mut [f32]) {
        self.core.finish(head, acc, out);
    }
}

/// The registry entry: bits 2, 3 or 4 (default 4); a preset may set `key_bits`, `value_bits`,
/// `window`, `sinks` and `seed` in its `[params]`; request bits override both key and value bits.
pub fn entry() -> MethodEntry {
    MethodEntry {
        name: METHOD,
        bits: vec![2, 3, 4],
        default_bits: 4,
        build: |a| {
            let base = TurboQuantMseFactory::new(a.bits.map_or(4, u32::from));
            let pick = |key: &str, dflt: u32| -> Result<u32> {
                Ok(match a.bits {
                    Some(b) => u32::from(b),
                    None => param(a.params, key)?.unwrap_or(dflt),
                })
            };
            let f = TurboQuantMseFactory {
                key_bits: pick("key_bits", base.key_bits)?,
                value_bits: pick("value_bits", base.value_bits)?,
                window: param(a.params, "window")?.unwrap_or(base.window),
                sinks: param(a.params, "sinks")?.unwrap_or(base.sinks),
                seed: param(a.params, "seed")?.unwrap_or(base.seed),
            };
            for b in [f.key_bits, f.value_bits] {
                if !(1..=4).contains(&b) {
                    return Err(CacheError::InvalidBits {
                        method: METHOD.into(),
                        bits: b as u8,
                        valid: vec![2, 3, 4],
                    });
                }
            }
            Ok(Arc::new(f))
        },
    }
}

/// Builds TurboQuant-MSE caches.
#[derive(Debug, Clone)]
pub struct TurboQuantMseFactory {
    /// Bits per coordinate for keys and for values.
    pub key_bits: u32,
    pub value_bits: u32,
    /// Recent tokens kept in fp16.
    pub window: usize,
    /// First tokens kept in fp16.
    pub sinks: usize,
    /// Seed of the rotations.
    pub seed: u64,
}

impl TurboQuantMseFactory {
    /// `bits` for keys and values, the default window (64) and no sinks.
    pub fn new(bits: u32) -> Self {
        Self {
            key_bits: bits,
            value_bits: bits,
            window: 64,
            sinks: 0,
            seed: 0x7u64 << 40 | 0x7451,
        }
    }
}

impl CacheFactory for TurboQuantMseFactory {
    fn method(&self) -> &str {
        METHOD
    }

    fn create(&self, layer: usize, geom: &CacheGeometry) -> Result<Box<dyn KvCache>> {
        let (d, h) = (geom.head_dim, geom.n_kv_heads);
        let keys = MseCodec::new(d, h, self.key_bits, layer, self.seed)?;
        let values = MseCodec::new(d, h, self.value_bits, layer, self.seed ^ 0xA5A5)?;
        Ok(Box::new(CompressedCache::new(
            *geom,
            METHOD,
            Arc::new(keys),
            Arc::new(values),
            self.window,
            self.sinks,
        )))
    }
}

#[cfg(test)]
mod tests;
