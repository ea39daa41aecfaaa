//! TurboQuant-MSE: rotate by a seeded randomized Hadamard transform, store `||x||` in fp16 and
//! each rotated coordinate of `x / ||x||` as a b-bit index into the Lloyd-Max codebook for
//! N(0, 1/d). Keys are scored by rotating the query once and gathering codebook values; values
//! are accumulated in the rotated domain and rotated back once per query row.

use crate::codec::bitpack;
use crate::codec::hadamard::Rotation;
use crate::codec::lloyd_max::{Codebook, Dist, codebook};
use crate::compressed::{CompressedCache, KernelKind, KeyCodec, ValueCodec};
use crate::registry::{MethodEntry, param};
use crate::traits::{CacheFactory, CacheGeometry, KvCache};
use crate::{CacheError, Result};
use half::f16;
use std::sync::Arc;

/// Registry name.
pub const METHOD: &str = "turboquant-mse";

/// One layer's rotations and codebook; encodes keys or values.
pub struct MseCodec {
    rotations: Vec<Rotation>,
    book: &'static Codebook,
    bits: u32,
    d: usize,
    /// 1/sqrt(d): the codebook is for unit variance, the coordinates have variance 1/d.
    sigma: f32,
}

impl MseCodec {
    /// Rotations seeded by (`seed`, layer, head).
    pub fn new(d: usize, heads: usize, bits: u32, layer: usize, seed: u64) -> Result<Self> {
        if !d.is_power_of_two() {
            return Err(CacheError::Shape(format!(
                "{METHOD} needs a power-of-two head_dim, got {d}"
            )));
        }
        let rotations = (0..heads)
            .map(|h| Rotation::new(d, seed ^ ((layer as u64) << 32) ^ (h as u64 + 1)))
            .collect();
        Ok(Self {
            rotations,
            book: codebook(Dist::Gaussian, bits),
            bits,
            d,
            sigma: 1.0 / (d as f32).sqrt(),
        })
    }

    fn encode_row(&self, head: usize, x: &[f32], out: &mut [u8]) {
        let norm = x.iter().map(|v| v * v).sum::<f32>().sqrt();
        out[..2].copy_from_slice(&f16::from_f32(norm).to_le_bytes());
        let mut u = x.to_vec();
        self.rotations[head].apply(&mut u);
        let inv = if norm > 0.0 {
            1.0 / (norm * self.sigma)
        } else {
            0.0
        };
        let idx: Vec<u8> = u.iter().map(|&v| self.book.quantize(v * inv)).collect();
        bitpack::pack(&idx, self.bits, &mut out[2..]);
    }

    /// Reconstructs a row: codebook values times norm and sigma, rotated back.
    fn decode_row(&self, head: usize, code: &[u8], out: &mut [f32]) {
        let w = Self::norm_of(code) * self.sigma;
        for (i, o) in out.iter_mut().enumerate() {
            *o = w * self.book.levels[bitpack::get(&code[2..], self.bits, i) as usize];
        }
        self.rotations[head].invert(out);
    }

    /// Estimates `q . k` for one key code, from the state `KeyCodec::prepare` filled (other
    /// methods built on this stage, such as TurboQuant-Prod, call it per code).
    pub fn score_one(&self, state: &[f32], code: &[u8]) -> f32 {
        let levels = &self.book.levels;
        let packed = &code[2..];
        let mut acc = 0f32;
        for (i, q) in state.iter().enumerate().take(self.d) {
            acc += q * levels[bitpack::get(packed, self.bits, i) as usize];
        }
        acc * Self::norm_of(code)
    }

    /// The fp16 norm stored at the front of a code row.
    fn norm_of(code: &[u8]) -> f32 {
        f16::from_le_bytes([code[0], code[1]]).to_f32()
    }
}

impl KeyCodec for MseCodec {
    fn head_dim(&self) -> usize {
        self.d
    }

    fn kernel(&self) -> KernelKind {
        KernelKind::ScalarCodebook
    }

    fn decode(&self, head: usize, code: &[u8], out: &mut [f32]) {
        self.decode_row(head, code, out);
    }

    fn code_bytes(&self) -> usize {
        2 + bitpack::packed_len(self.d, self.bits)
    }

    fn encode(&self, head: usize, k: &[f32], out: &mut [u8]) {
        self.encode_row(head, k, out);
    }

    fn state_len(&self) -> usize {
        self.d
    }

    fn prepare(&self, head: usize, q: &[f32], state: &mut [f32]) {
        state.copy_from_slice(q);
        self.rotations[head].apply(state);
        state.iter_mut().for_each(|x| *x *= self.sigma);
    }

    fn scores(&self, _head: usize, state: &[f32], codes: &[u8], out: &mut [f32]) {
        let cb = <Self as KeyCodec>::code_bytes(self);
        for (s, code) in out.iter_mut().zip(codes.chunks_exact(cb)) {
            *s = self.score_one(state, code);
        }
    }
}

impl ValueCodec for MseCodec {
    fn head_dim(&self) -> usize {
        self.d
    }

    fn kernel(&self) -> KernelKind {
        KernelKind::ScalarCodebook
    }

    fn decode(&self, head: usize, code: &[u8], out: &mut [f32]) {
        self.decode_row(head, code, out);
    }

    fn code_bytes(&self) -> usize {
        2 + bitpack::packed_len(self.d, self.bits)
    }

    fn encode(&self, head: usize, v: &[f32], out: &mut [u8]) {
        self.encode_row(head, v, out);
    }

    fn accumulate(&self, _head: usize, probs: &[f32], codes: &[u8], acc: &mut [f32]) {
        let cb = <Self as ValueCodec>::code_bytes(self);
        let levels = &self.book.levels;
        for (&p, code) in probs.iter().zip(codes.chunks_exact(cb)) {
            let w = p * Self::norm_of(code) * self.sigma;
            let packed = &code[2..];
            for (i, a) in acc.iter_mut().enumerate() {
                *a += w * levels[bitpack::get(packed, self.bits, i) as usize];
            }
        }
    }

    fn finish(&self, head: usize, acc: &[f32], out: &mut [f32]) {
        out.copy_from_slice(acc);
        self.rotations[head].invert(out);
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
