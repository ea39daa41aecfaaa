//! The CPU hot loops of the TurboQuant family's rotated scalar codebooks (TurboQuant-MSE, the
//! MSE stage of TurboQuant-Prod, and TurboQuant-RVQ through its combined two-stage codebook): dot
//! products of a query against rows of packed b-bit indices into a codebook, and
//! probability-weighted sums of such rows, plus the fast encode helper (threshold counting). Their
//! CUDA twins are kernels/cuda/turboquant_mse/*.cu. Each loop has a plain `*_reference` definition;
//! the fast paths (`cpu/`: AVX-512 with VBMI on x86-64, otherwise portable per-query tables) are
//! tested against it. Measured on the 2-core AMD EPYC (Zen 4) dev box: the AVX-512 path gathers
//! codebook values with an in-register permute (the whole codebook fits in one to four
//! registers), about 5x faster than the per-query byte lookup table
//! (kvq-cache/benches/decode_attention.rs).

use crate::bitpack;

mod cpu;

#[cfg(target_arch = "x86_64")]
use cpu::avx512;
use cpu::portable::{axpy_rows_portable, dot_rows_portable};
pub use cpu::portable::{byte_lut, dot_rows_byte_lut};

/// Largest index width the kernels take (a 64-entry codebook: RVQ at 3 + 3 bits).
pub const MAX_BITS: u32 = 6;

/// A scalar codebook of `2^bits` levels, repeated periodically to 64 entries so that a SIMD
/// lookup may ignore index bits above `bits`.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    bits: u32,
    periodic: [f32; 64],
}

impl Table {
    /// A table over `levels` (2 to 64 of them, a power of two).
    ///
    /// # Panics
    /// When the count is not a power of two in 2..=64 (a programming error).
    pub fn new(levels: &[f32]) -> Self {
        let n = levels.len();
        assert!(
            n.is_power_of_two() && (2..=64).contains(&n),
            "a table needs 2 to 64 levels, a power of two"
        );
        let mut periodic = [0f32; 64];
        for (i, p) in periodic.iter_mut().enumerate() {
            *p = levels[i % n];
        }
        Self {
            bits: n.trailing_zeros(),
            periodic,
        }
    }

    /// Bits per index.
    pub fn bits(&self) -> u32 {
        self.bits
    }

    /// The level of index `i`.
    #[inline]
    pub fn level(&self, i: u8) -> f32 {
        self.periodic[usize::from(i) % (1 << self.bits)]
    }

    /// The levels, in index order.
    pub fn levels(&self) -> &[f32] {
        &self.periodic[..1 << self.bits]
    }

    // Read by the x86-64 kernels only.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn periodic(&self) -> &[f32; 64] {
        &self.periodic
    }
}

/// Rows of packed indices: row `r`'s `d` indices start at byte `r * stride + offset` of `data`;
/// when `scale_at` is set, the row's levels are multiplied by the fp16 number at byte
/// `r * stride + scale_at` (a TurboQuant code's norm).
#[derive(Debug, Clone, Copy)]
pub struct Rows<'a> {
    pub data: &'a [u8],
    pub stride: usize,
    pub offset: usize,
    pub d: usize,
    pub scale_at: Option<usize>,
}

impl<'a> Rows<'a> {
    /// Row `r`'s scale (1 without `scale_at`).
    #[inline]
    pub fn scale(&self, r: usize) -> f32 {
        match self.scale_at {
            Some(at) => {
                let i = r * self.stride + at;
                half::f16::from_le_bytes([self.data[i], self.data[i + 1]]).to_f32()
            }
            None => 1.0,
        }
    }

    /// The packed indices of row `r`.
    #[inline]
    pub fn row(&self, r: usize, bits: u32) -> &'a [u8] {
        let at = r * self.stride + self.offset;
        &self.data[at..at + bitpack::packed_len(self.d, bits)]
    }

    /// Panics unless `n` rows of `bits`-bit indices lie inside `data` (the SIMD paths rely on it).
    fn check(&self, n: usize, bits: u32) {
        let row_end = (self.offset + bitpack::packed_len(self.d, bits))
            .max(self.scale_at.map_or(0, |at| at + 2));
        let need = match n {
            0 => 0,
            n => (n - 1) * self.stride + row_end,
        };
        assert!(need <= self.data.len(), "rows out of bounds");
        assert!(row_end <= self.stride || n <= 1, "rows overlap");
    }
}

/// The instruction sets the kernels have a path for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust: unpack a row's indices, then gather and multiply-add.
    Portable,
    /// AVX-512 F/BW/VBMI: byte permute + variable shift to unpack, register permute to gather.
    Avx512,
}

impl Isa {
    /// The fastest path this CPU runs.
    pub fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        if avx512::available() {
            return Isa::Avx512;
        }
        Isa::Portable
    }

    /// Every path this CPU runs (tests compare each with the reference).
    pub fn available() -> Vec<Self> {
        let mut v = vec![Isa::Portable];
        if Self::best() == Isa::Avx512 {
            v.push(Isa::Avx512);
        }
        v
    }

    /// Whether this path handles head dimension `d` (else it falls back to `Portable`).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn handles(self, d: usize) -> bool {
        match self {
            Isa::Portable => true,
            Isa::Avx512 => matches!(d, 64 | 128 | 256),
        }
    }
}

/// `out[r] = scale_r * sum_i q[i] * table[idx_r(i)]`: the reference, one index at a time.
pub fn dot_rows_reference(q: &[f32], table: &Table, rows: Rows<'_>, out: &mut [f32]) {
    let bits = table.bits();
    for (r, o) in out.iter_mut().enumerate() {
        let packed = rows.row(r, bits);
        let dot: f32 = q
            .iter()
            .take(rows.d)
            .enumerate()
            .map(|(i, qi)| qi * table.level(bitpack::get(packed, bits, i)))
            .sum();
        *o = dot * rows.scale(r);
    }
}

/// `acc[i] += sum_r w[r] * scale_r * table[idx_r(i)]`: the reference, one index at a time.
pub fn axpy_rows_reference(w: &[f32], table: &Table, rows: Rows<'_>, acc: &mut [f32]) {
    let bits = table.bits();
    for (r, &wr) in w.iter().enumerate() {
        let packed = rows.row(r, bits);
        let wr = wr * rows.scale(r);
        for (i, a) in acc.iter_mut().enumerate().take(rows.d) {
            *a += wr * table.level(bitpack::get(packed, bits, i));
        }
    }
}

/// `out[r] = scale_r * sum_i q[i] * table[idx_r(i)]` on the given path.
pub fn dot_rows_with(isa: Isa, q: &[f32], table: &Table, rows: Rows<'_>, out: &mut [f32]) {
    assert!(q.len() >= rows.d, "query shorter than the rows");
    rows.check(out.len(), table.bits());
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if isa.handles(rows.d) => avx512::dot_rows(q, table, rows, out),
        _ => dot_rows_portable(q, table, rows, out),
    }
}

/// `acc[i] += sum_r w[r] * scale_r * table[idx_r(i)]` on the given path.
pub fn axpy_rows_with(isa: Isa, w: &[f32], table: &Table, rows: Rows<'_>, acc: &mut [f32]) {
    assert!(acc.len() >= rows.d, "accumulator shorter than the rows");
    rows.check(w.len(), table.bits());
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if isa.handles(rows.d) => avx512::axpy_rows(w, table, rows, acc),
        _ => axpy_rows_portable(w, table, rows, acc),
    }
}

/// [`dot_rows_with`] on the fastest path.
pub fn dot_rows(q: &[f32], table: &Table, rows: Rows<'_>, out: &mut [f32]) {
    dot_rows_with(Isa::best(), q, table, rows, out);
}

/// [`axpy_rows_with`] on the fastest path.
pub fn axpy_rows(w: &[f32], table: &Table, rows: Rows<'_>, acc: &mut [f32]) {
    axpy_rows_with(Isa::best(), w, table, rows, acc);
}

/// Index of the nearest level for each `y[i]`: the number of thresholds below it (the same as
/// `Codebook::quantize`, counted branch-free over all coordinates at once).
pub fn quantize_into(thresholds: &[f32], y: &[f32], idx: &mut [u8]) {
    idx.fill(0);
    for &t in thresholds {
        for (o, &v) in idx.iter_mut().zip(y) {
            *o += u8::from(v > t);
        }
    }
}

#[cfg(test)]
mod tests;
