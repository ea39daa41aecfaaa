//! The frame TurboQuant-MSE and TurboQuant-RVQ (and so Prod's MSE stage) share: per head a
//! seeded randomized Hadamard rotation; per token an fp16 norm and a row of packed b-bit indices
//! into one scalar codebook for the rotated coordinates scaled to unit variance. Keys are scored from the query rotated
//! once (a dot product of it with the gathered levels, through the kernels); values are summed
//! in the rotated domain and rotated back once per query row.

use crate::codec::hadamard::Rotation;
use crate::{CacheError, Result};
use half::f16;
use kvq_kernels::bitpack;
use kvq_kernels::spec::ScalarSpec;
use kvq_kernels::turboquant::{self, Isa, Rows, Table};

/// Head dims up to this size encode without a heap allocation.
const STACK_DIM: usize = 256;

/// Rotations, codebook and kernel path of one layer (keys or values).
pub(crate) struct Rotated {
    rotations: Vec<Rotation>,
    table: Table,
    /// The levels times sigma: value sums come out in the rotated domain at the values' scale.
    value_table: Table,
    d: usize,
    /// 1/sqrt(d): the codebook is for unit variance, the coordinates have variance 1/d.
    sigma: f32,
    isa: Isa,
}

impl Rotated {
    /// Rotations seeded by (`seed`, layer, head); `table` holds the levels (at most
    /// `turboquant::MAX_BITS` bits).
    pub fn new(
        method: &str,
        d: usize,
        heads: usize,
        table: Table,
        layer: usize,
        seed: u64,
    ) -> Result<Self> {
        if !d.is_power_of_two() {
            return Err(CacheError::Shape(format!(
                "{method} needs a power-of-two head_dim, got {d}"
            )));
        }
        let rotations = (0..heads)
            .map(|h| Rotation::new(d, seed ^ ((layer as u64) << 32) ^ (h as u64 + 1)))
            .collect();
        let sigma = 1.0 / (d as f32).sqrt();
        let scaled: Vec<f32> = table.levels().iter().map(|l| l * sigma).collect();
        Ok(Self {
            rotations,
            value_table: Table::new(&scaled),
            table,
            d,
            sigma,
            isa: Isa::best(),
        })
    }

    /// Runs the kernels on `isa` (tests compare the paths).
    pub fn set_isa(&mut self, isa: Isa) {
        self.isa = isa;
    }

    pub fn d(&self) -> usize {
        self.d
    }

    pub fn table(&self) -> &Table {
        &self.table
    }

    /// The device description of this frame: levels in code order, the encoder's sorted
    /// `thresholds` and the code of each sorted level, every head's rotation signs.
    pub fn spec(&self, thresholds: &[f32], code_of: &[u8]) -> ScalarSpec {
        ScalarSpec {
            bits: self.table.bits(),
            levels: self.table.levels().to_vec(),
            thresholds: thresholds.to_vec(),
            code_of: code_of.to_vec(),
            sigma: self.sigma,
            signs: self
                .rotations
                .iter()
                .flat_map(|r| r.signs().iter().copied())
                .collect(),
        }
    }

    pub fn code_bytes(&self) -> usize {
        2 + bitpack::packed_len(self.d, self.table.bits())
    }

    /// The fp16 norm stored at the front of a code row.
    #[inline]
    pub fn norm_of(code: &[u8]) -> f32 {
        f16::from_le_bytes([code[0], code[1]]).to_f32()
    }

    /// Writes `||x||` in fp16, then the indices `quantize(y, idx)` picks for the rotated
    /// coordinates scaled to unit variance, `y_i = (R x)_i / (||x|| sigma)`.
    pub fn encode(
        &self,
        head: usize,
        x: &[f32],
        out: &mut [u8],
        quantize: impl FnOnce(&[f32], &mut [u8]),
    ) {
        let d = self.d;
        let (mut su, mut si) = ([0f32; STACK_DIM], [0u8; STACK_DIM]);
        let (mut hu, mut hi) = (Vec::new(), Vec::new());
        let (u, idx): (&mut [f32], &mut [u8]) = if d <= STACK_DIM {
            (&mut su[..d], &mut si[..d])
        } else {
            hu.resize(d, 0.0);
            hi.resize(d, 0);
            (&mut hu, &mut hi)
        };
        let norm = self.rotate_scaled(head, x, u);
        out[..2].copy_from_slice(&f16::from_f32(norm).to_le_bytes());
        quantize(u, idx);
        bitpack::pack(idx, self.table.bits(), &mut out[2..]);
    }

    /// `u <- R x / (||x|| sigma)`, returning `||x||`. The references use it too, so fast and
    /// reference encodes see the same floats.
    pub fn rotate_scaled(&self, head: usize, x: &[f32], u: &mut [f32]) -> f32 {
        let norm = x.iter().map(|v| v * v).sum::<f32>().sqrt();
        u.copy_from_slice(x);
        self.rotations[head].apply(u);
        let inv = if norm > 0.0 {
            1.0 / (norm * self.sigma)
        } else {
            0.0
        };
        u.iter_mut().for_each(|v| *v *= inv);
        norm
    }

    /// Reconstructs a row: levels times norm and sigma, rotated back.
    pub fn decode(&self, head: usize, code: &[u8], out: &mut [f32]) {
        let w = Self::norm_of(code) * self.sigma;
        let bits = self.table.bits();
        for (i, o) in out.iter_mut().enumerate() {
            *o = w * self.table.level(bitpack::get(&code[2..], bits, i));
        }
        self.rotations[head].invert(out);
    }

    /// The query rotated and scaled by sigma: `state . levels(code) * norm` estimates `q . k`.
    pub fn prepare(&self, head: usize, q: &[f32], state: &mut [f32]) {
        state.copy_from_slice(q);
        self.rotations[head].apply(state);
        state.iter_mut().for_each(|x| *x *= self.sigma);
    }

    fn rows<'a>(&self, codes: &'a [u8], stride: usize) -> Rows<'a> {
        Rows {
            data: codes,
            stride,
            offset: 2,
            d: self.d,
            scale_at: Some(0),
        }
    }

    /// Scores of the `out.len()` rows of `stride` bytes in `codes`, each starting with this
    /// codec's code.
    pub fn scores(&self, state: &[f32], codes: &[u8], stride: usize, out: &mut [f32]) {
        let n = out.len().min(codes.len() / stride.max(1));
        let rows = self.rows(codes, stride);
        turboquant::dot_rows_with(self.isa, state, &self.table, rows, &mut out[..n]);
    }

    /// `acc += sum_r probs[r] * norm_r * sigma * levels(code r)`: values in the rotated domain.
    pub fn accumulate(&self, probs: &[f32], codes: &[u8], stride: usize, acc: &mut [f32]) {
        let n = probs.len().min(codes.len() / stride.max(1));
        let rows = self.rows(codes, stride);
        turboquant::axpy_rows_with(self.isa, &probs[..n], &self.value_table, rows, acc);
    }

    /// The sum rotated back to the value domain.
    pub fn finish(&self, head: usize, acc: &[f32], out: &mut [f32]) {
        out.copy_from_slice(acc);
        self.rotations[head].invert(out);
    }
}
