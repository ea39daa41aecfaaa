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
use crate::Result;
use crate::codec::sketch::SignSketch;
use crate::codec::turboquant::{BitsFactory, BitsMethod, invalid_bits};
use crate::compressed::{KernelKind, KeyCodec};
use crate::registry::MethodEntry;
use half::f16;
use kvq_kernels::KernelData;
use kvq_kernels::spec::KeySpec;
use std::sync::OnceLock;

/// Registry name.
pub const METHOD: &str = "turboquant-prod";

/// Keys: an MSE stage plus a sign sketch of its residual.
pub struct ProdKeyCodec {
    mse: MseCodec,
    sketch: SignSketch,
    d: usize,
    data: OnceLock<KernelData<KeySpec>>,
}

impl ProdKeyCodec {
    /// `key_bits` in 2..=5 (the MSE stage gets `key_bits - 1`), seeded by (`seed`, layer, head).
    pub fn new(d: usize, heads: usize, key_bits: u32, layer: usize, seed: u64) -> Result<Self> {
        if !(2..=5).contains(&key_bits) {
            return Err(invalid_bits::<Prod>(key_bits));
        }
        let mse = MseCodec::new(d, heads, key_bits - 1, layer, seed)?;
        let m = d.div_ceil(8) * 8;
        let sketch = SignSketch::new(m, d, heads, layer, seed ^ 0x9D0D_0000)?;
        Ok(Self {
            mse,
            sketch,
            d,
            data: OnceLock::new(),
        })
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

impl KeyCodec for ProdKeyCodec {
    fn head_dim(&self) -> usize {
        self.d
    }

    fn code_bytes(&self) -> usize {
        self.mse_bytes() + 2 + self.sketch.sign_bytes()
    }

    fn encode(&self, head: usize, k: &[f32], out: &mut [u8]) {
        let mb = self.mse_bytes();
        KeyCodec::encode(&self.mse, head, k, &mut out[..mb]);
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

    fn kernel_data(&self) -> Option<&KernelData<KeySpec>> {
        Some(self.data.get_or_init(|| {
            KernelData::new(KeySpec::ScalarSketch {
                scalar: self.mse.scalar_spec(),
                sketch: self.sketch.spec(),
            })
        }))
    }
}

/// TurboQuant-Prod as [`BitsFactory`] builds it: Prod keys, MSE values.
#[derive(Debug)]
pub struct Prod;

impl BitsMethod for Prod {
    const METHOD: &'static str = METHOD;
    const VALID_BITS: &'static [u8] = &[2, 3, 4];
    const DEFAULT_BITS: u8 = 3;
    const SEED: u64 = 0x7u64 << 40 | 0x9D0D;
    /// Centering: every head (see `crate::compressed`).
    const CENTER_MIN_SHARE: u32 = 0;
    type Keys = ProdKeyCodec;
    type Values = MseCodec;

    fn keys(d: usize, heads: usize, bits: u32, layer: usize, seed: u64) -> Result<ProdKeyCodec> {
        ProdKeyCodec::new(d, heads, bits, layer, seed)
    }

    fn values(d: usize, heads: usize, bits: u32, layer: usize, seed: u64) -> Result<MseCodec> {
        MseCodec::new(d, heads, bits, layer, seed)
    }

    /// Keys 2..=5 bits (the MSE stage gets one less), values 1..=4.
    fn check_bits(key_bits: u32, value_bits: u32) -> Result<()> {
        if !(2..=5).contains(&key_bits) {
            return Err(invalid_bits::<Self>(key_bits));
        }
        if !(1..=4).contains(&value_bits) {
            return Err(invalid_bits::<Self>(value_bits));
        }
        Ok(())
    }
}

/// Builds TurboQuant-Prod caches (see [`BitsFactory`]); `key_bits` counts the MSE stage's
/// `key_bits - 1` bits plus the 1-bit residual sketch.
pub type TurboQuantProdFactory = BitsFactory<Prod>;

/// The registry entry: bits 2, 3 or 4 (default 3), params as in the module doc.
pub fn entry() -> MethodEntry {
    TurboQuantProdFactory::entry()
}

#[cfg(test)]
mod tests;
