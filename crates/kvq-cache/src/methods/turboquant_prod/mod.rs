//! TurboQuant-Prod: keys get a (b-1)-bit TurboQuant-MSE stage, then a 1-bit QJL sketch of the
//! residual `r = k - k_mse` (`sign(S r)` with m = d signs, plus `||r||` in fp16), so that
//! `q . k ~ <q, k_mse> + sqrt(pi/2)/m * ||r|| * <S q, sign(S r)>` is unbiased over S. Values use
//! the b-bit MSE quantizer (values need low reconstruction error, not unbiased products).
//!
//! Key code row: the MSE stage's code (fp16 norm + d(b-1)/8 bytes), `||r||` (f16 LE), d/8 sign
//! bytes. Per token and kv head at d = 64: keys `4 + 8b` bytes, values `2 + 8b` bytes, so b = 3
//! holds 28 + 26 = 54 bytes, 3.375 bits per element with norms (b = 2: 2.375, b = 4: 4.375).
//!
//! Params (a preset's `[params]`): `key_bits` (2..=5: the MSE stage gets key_bits - 1),
//! `value_bits` (1..=4), `window` (64), `sinks` (0), `seed`; request bits set both key and value
//! bits.

use super::turboquant_mse::MseCodec;
use crate::codec::sketch::SignSketch;
use crate::compressed::{CompressedCache, KernelKind, KeyCodec};
use crate::registry::{MethodEntry, param};
use crate::traits::{CacheFactory, CacheGeometry, KvCache};
use crate::{CacheError, Result};
use half::f16;
use std::sync::Arc;

/// Registry name.
pub const METHOD: &str = "turboquant-prod";

/// Keys: an MSE stage plus a sign sketch of its residual.
pub struct ProdKeyCodec {
    mse: MseCodec,
    sketch: SignSketch,
    d: usize,
}

impl ProdKeyCodec {
    /// `key_bits` in 2..=5 (the MSE stage gets `key_bits - 1`), seeded by (`seed`, layer, head).
    pub fn new(d: usize, heads: usize, key_bits: u32, layer: usize, seed: u64) -> Result<Self> {
        if !(2..=5).contains(&key_bits) {
            return Err(invalid_bits(key_bits));
        }
        let mse = MseCodec::new(d, heads, key_bits - 1, layer, seed)?;
        let m = d.div_ceil(8) * 8;
        let sketch = SignSketch::new(m, d, heads, layer, seed ^ 0x9D0D_0000)?;
        Ok(Self { mse, sketch, d })
    }

    fn mse_bytes(&self) -> usize {
        KeyCodec::code_bytes(&self.mse)
    }

    fn mse_state(&self) -> usize {
        KeyCodec::state_len(&self.mse)
    }

    fn residual_norm(&self, code: &[u8]) -> f32 {
        let at = self.mse_bytes();
        f16::from_le_bytes([code[at], code[at + 1]]).to_f32()
    }
}

fn invalid_bits(bits: u32) -> CacheError {
    CacheError::InvalidBits {
        method: METHOD.into(),
        bits: bits.min(255) as u8,
        valid: vec![2, 3, 4],
    }
}

impl KeyCodec for ProdKeyCodec {
    fn head_dim(&self) -> usize {
        self.d
    }

    fn code_bytes(&self) -> usize {
        self.mse_bytes() + 2 + self.sketch.sign_bytes()
    }

    fn encode(&self, head: usize, k: &[f32], out: &mut [u8]) {
        let mb = self.mse_bytes();
        self.mse.encode(head, k, &mut out[..mb]);
        let mut r = vec![0f32; self.d];
        KeyCodec::decode(&self.mse, head, &out[..mb], &mut r);
        r.iter_mut().zip(k).for_each(|(r, k)| *r = k - *r);
        let norm = r.iter().map(|v| v * v).sum::<f32>().sqrt();
        out[mb..mb + 2].copy_from_slice(&f16::from_f32(norm).to_le_bytes());
        self.sketch.encode(head, &r, &mut out[mb + 2..]);
    }

    fn decode(&self, head: usize, code: &[u8], out: &mut [f32]) {
        let mb = self.mse_bytes();
        KeyCodec::decode(&self.mse, head, &code[..mb], out);
        let norm = self.residual_norm(code);
        self.sketch.decode_add(head, &code[mb + 2..], norm, out);
    }

    fn state_len(&self) -> usize {
        self.mse_state() + self.sketch.table_len()
    }

    fn prepare(&self, head: usize, q: &[f32], state: &mut [f32]) {
        let (ms, table) = state.split_at_mut(self.mse_state());
        self.mse.prepare(head, q, ms);
        self.sketch.prepare(head, q, table);
    }

    fn scores(&self, _head: usize, state: &[f32], codes: &[u8], out: &mut [f32]) {
        let (cb, mb) = (self.code_bytes(), self.mse_bytes());
        let (ms, table) = state.split_at(self.mse_state());
        // The MSE stage scores every row's leading code in one batched call; then the residual
        // sketch is added per row.
        self.mse.score_rows(ms, codes, cb, out);
        for (s, row) in out.iter_mut().zip(codes.chunks_exact(cb)) {
            *s += self.residual_norm(row) * SignSketch::dot(table, &row[mb + 2..]);
        }
    }

    fn kernel(&self) -> KernelKind {
        KernelKind::CodebookPlusSketch
    }
}

/// Builds TurboQuant-Prod caches.
#[derive(Debug, Clone)]
pub struct TurboQuantProdFactory {
    /// Key bits per coordinate: `key_bits - 1` MSE bits plus the 1-bit residual sketch.
    pub key_bits: u32,
    /// Value bits per coordinate (MSE).
    pub value_bits: u32,
    /// Recent tokens kept in fp16.
    pub window: usize,
    /// First tokens kept in fp16.
    pub sinks: usize,
    /// Seed of the rotations and sketches.
    pub seed: u64,
}

impl TurboQuantProdFactory {
    /// `bits` for keys and values, the default window (64) and no sinks.
    pub fn new(bits: u32) -> Self {
        Self {
            key_bits: bits,
            value_bits: bits,
            window: 64,
            sinks: 0,
            seed: 0x7u64 << 40 | 0x9D0D,
        }
    }

    /// The key and value codecs of one layer.
    pub fn codecs(&self, layer: usize, geom: &CacheGeometry) -> Result<(ProdKeyCodec, MseCodec)> {
        let (d, h) = (geom.head_dim, geom.n_kv_heads);
        let keys = ProdKeyCodec::new(d, h, self.key_bits, layer, self.seed)?;
        let values = MseCodec::new(d, h, self.value_bits, layer, self.seed ^ 0xA5A5)?;
        Ok((keys, values))
    }
}

impl CacheFactory for TurboQuantProdFactory {
    fn method(&self) -> &str {
        METHOD
    }

    fn create(&self, layer: usize, geom: &CacheGeometry) -> Result<Box<dyn KvCache>> {
        let (keys, values) = self.codecs(layer, geom)?;
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

/// The registry entry: bits 2, 3 or 4 (default 3), params as in the module doc.
pub fn entry() -> MethodEntry {
    MethodEntry {
        name: METHOD,
        bits: vec![2, 3, 4],
        default_bits: 3,
        build: |a| {
            let base = TurboQuantProdFactory::new(a.bits.map_or(3, u32::from));
            let pick = |key: &str, dflt: u32| -> Result<u32> {
                Ok(match a.bits {
                    Some(b) => u32::from(b),
                    None => param(a.params, key)?.unwrap_or(dflt),
                })
            };
            let f = TurboQuantProdFactory {
                key_bits: pick("key_bits", base.key_bits)?,
                value_bits: pick("value_bits", base.value_bits)?,
                window: param(a.params, "window")?.unwrap_or(base.window),
                sinks: param(a.params, "sinks")?.unwrap_or(base.sinks),
                seed: param(a.params, "seed")?.unwrap_or(base.seed),
            };
            if !(2..=5).contains(&f.key_bits) {
                return Err(invalid_bits(f.key_bits));
            }
            if !(1..=4).contains(&f.value_bits) {
                return Err(invalid_bits(f.value_bits));
            }
            Ok(Arc::new(f))
        },
    }
}

#[cfg(test)]
mod tests;
