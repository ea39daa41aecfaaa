//! TurboQuant-MSE: rotate by a seeded randomized Hadamard transform, store `||x||` in fp16 and
//! each rotated coordinate of `x / ||x||` as a b-bit index into the Lloyd-Max codebook for
//! N(0, 1/d). Keys are scored by rotating the query once and gathering codebook values; values
//! are accumulated in the rotated domain and rotated back once per query row. The loops live in
//! `kvq_kernels::turboquant` (AVX-512 and portable paths, each tested against a plain reference);
//! the frame around them, shared with TurboQuant-RVQ, is `crate::codec::turboquant::Rotated`.

use crate::codec::lloyd_max::{Codebook, Dist, codebook};
use crate::codec::turboquant::{BitsFactory, BitsMethod, Rotated};
use crate::compressed::{KernelKind, KeyCodec, ValueCodec};
use crate::registry::MethodEntry;
use crate::{CacheError, Result};
use half::f16;
use kvq_kernels::KernelData;
use kvq_kernels::bitpack;
use kvq_kernels::spec::{KeySpec, ScalarSpec, ValueSpec};
use kvq_kernels::turboquant::{self, Isa, Table};
use std::sync::OnceLock;

/// Registry name.
pub const METHOD: &str = "turboquant-mse";

/// One layer's rotations and codebook; encodes keys or values.
pub struct MseCodec {
    core: Rotated,
    book: &'static Codebook,
    key_data: OnceLock<KernelData<KeySpec>>,
    value_data: OnceLock<KernelData<ValueSpec>>,
}

impl MseCodec {
    /// Rotations seeded by (`seed`, layer, head); `bits` in 1..=6.
    pub fn new(d: usize, heads: usize, bits: u32, layer: usize, seed: u64) -> Result<Self> {
        if !(1..=turboquant::MAX_BITS).contains(&bits) {
            return Err(CacheError::InvalidBits {
                method: METHOD.into(),
                bits: bits.min(255) as u8,
                valid: (1..=turboquant::MAX_BITS as u8).collect(),
            });
        }
        let book = codebook(Dist::Gaussian, bits);
        let core = Rotated::new(METHOD, d, heads, Table::new(&book.levels), layer, seed)?;
        Ok(Self {
            core,
            book,
            key_data: OnceLock::new(),
            value_data: OnceLock::new(),
        })
    }

    /// The device description: the Gaussian levels, their thresholds, identity codes.
    pub fn scalar_spec(&self) -> ScalarSpec {
        let code_of: Vec<u8> = (0..self.book.levels.len()).map(|i| i as u8).collect();
        self.core.spec(&self.book.thresholds, &code_of)
    }

    /// Runs the kernels on `isa` instead of the fastest one (tests and benches).
    pub fn with_isa(mut self, isa: Isa) -> Self {
        self.core.set_isa(isa);
        self
    }

    fn encode_row(&self, head: usize, x: &[f32], out: &mut [u8]) {
        let th = &self.book.thresholds;
        self.core
            .encode(head, x, out, |y, idx| turboquant::quantize_into(th, y, idx));
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

    fn kernel_data(&self) -> Option<&KernelData<KeySpec>> {
        Some(
            self.key_data
                .get_or_init(|| KernelData::new(KeySpec::Scalar(self.scalar_spec()))),
        )
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

    fn kernel_data(&self) -> Option<&KernelData<ValueSpec>> {
        Some(
            self.value_data
                .get_or_init(|| KernelData::new(ValueSpec::Scalar(self.scalar_spec()))),
        )
    }
}

/// TurboQuant-MSE as [`BitsFactory`] builds it: the MSE codec for keys and values.
#[derive(Debug)]
pub struct Mse;

impl BitsMethod for Mse {
    const METHOD: &'static str = METHOD;
    const VALID_BITS: &'static [u8] = &[2, 3, 4];
    const DEFAULT_BITS: u8 = 4;
    const SEED: u64 = 0x7u64 << 40 | 0x7451;
    /// Centering: every head (see `crate::compressed`).
    const CENTER_MIN_SHARE: u32 = 0;
    type Keys = MseCodec;
    type Values = MseCodec;

    fn keys(d: usize, heads: usize, bits: u32, layer: usize, seed: u64) -> Result<MseCodec> {
        MseCodec::new(d, heads, bits, layer, seed)
    }

    fn values(d: usize, heads: usize, bits: u32, layer: usize, seed: u64) -> Result<MseCodec> {
        MseCodec::new(d, heads, bits, layer, seed)
    }
}

/// Builds TurboQuant-MSE caches (see [`BitsFactory`]).
pub type TurboQuantMseFactory = BitsFactory<Mse>;

/// The registry entry: bits 2, 3 or 4 (default 4); a preset may set `key_bits`, `value_bits`,
/// `window`, `sinks` and `seed` in its `[params]`; request bits override both key and value bits.
pub fn entry() -> MethodEntry {
    TurboQuantMseFactory::entry()
}

#[cfg(test)]
mod tests;
