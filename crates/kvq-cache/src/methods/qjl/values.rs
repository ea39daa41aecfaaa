//! QJL's value codec: per-token groupwise uniform scalar quantization. Each group of `group`
//! consecutive coordinates stores an fp16 scale and an fp16 minimum and each coordinate as a
//! `bits`-bit integer (2, 4 or 8 bits, so no code straddles a byte):
//! `v ~ min + scale * code`, `scale = (max - min) / (2^bits - 1)`.
//!
//! Code row layout: `groups x (scale f16 LE, min f16 LE)`, then the packed codes (LSB first).
//! At 2 bits, `encode` searches a trimmed range per group (see [`fit`]) instead of plain min-max.
//! `accumulate` decodes group by group through a per-byte table into a block of floats, turns it
//! into values (`min + scale * code`) and adds it with weight `p` (one axpy). Summing `p * scale *
//! code` and `p * min` apart instead (one add fewer per coordinate) cancels: both sums are about
//! as large as a value while their total, over many random values, is ~1/sqrt(n) of one, and at
//! 32768 positions the two f32 sums' rounding reached 1.2e-3 of the output (the CPU op against
//! the CUDA kernel, which summed the same way). (Shifting codes out of 32-bit words
//! lane by lane instead let the compiler vectorize across tokens with gathers: 2.4x slower at
//! 8192 tokens, `cargo bench -p kvq-cache --bench decode_attention`.)

use crate::attention::axpy;
use crate::compressed::{KernelKind, ValueCodec};
use crate::{CacheError, Result};
use half::f16;
use kvq_kernels::KernelData;
use kvq_kernels::bitpack;
use kvq_kernels::spec::ValueSpec;
use std::sync::{Arc, OnceLock};

/// Value bits the group codec supports.
pub const VALUE_BITS: [u32; 3] = [2, 4, 8];

/// Groupwise min/scale quantizer of value rows (`head_dim` d).
#[derive(Debug, Clone)]
pub struct GroupCodec {
    d: usize,
    bits: u32,
    group: usize,
    data: Arc<OnceLock<KernelData<ValueSpec>>>,
}

impl GroupCodec {
    /// `bits` in [`VALUE_BITS`]; `group` must divide `d`.
    pub fn new(d: usize, bits: u32, group: usize) -> Result<Self> {
        if !VALUE_BITS.contains(&bits) {
            return Err(CacheError::Shape(format!(
                "value bits must be 2, 4 or 8, got {bits}"
            )));
        }
        if group == 0 || !d.is_multiple_of(group) || !(group * bits as usize).is_multiple_of(8) {
            return Err(CacheError::Shape(format!(
                "value group size {group} must divide head_dim {d} and fill whole bytes"
            )));
        }
        Ok(Self {
            d,
            bits,
            group,
            data: Arc::default(),
        })
    }

    /// Number of groups per row.
    pub fn groups(&self) -> usize {
        self.d / self.group
    }

    /// Bytes of scales and minima per row (4 per group).
    fn header(&self) -> usize {
        4 * self.groups()
    }

    /// Packed code bytes of one group.
    fn group_bytes(&self) -> usize {
        self.group * self.bits as usize / 8
    }

    /// (scale, min) of group `g` of a code row.
    #[inline]
    fn params(code: &[u8], g: usize) -> (f32, f32) {
        let at = 4 * g;
        (
            f16::from_le_bytes([code[at], code[at + 1]]).to_f32(),
            f16::from_le_bytes([code[at + 2], code[at + 3]]).to_f32(),
        )
    }

    /// One group at a time, unpacked into `block` through the per-byte tables, then one axpy.
    fn accumulate_bytes(&self, probs: &[f32], codes: &[u8], acc: &mut [f32]) {
        let cb = ValueCodec::code_bytes(self);
        let (gb, hdr) = (self.group_bytes(), self.header());
        let mut block = vec![0f32; self.group];
        for (&p, code) in probs.iter().zip(codes.chunks_exact(cb)) {
            let packed = &code[hdr..];
            for (g, (a, bytes)) in acc
                .chunks_exact_mut(self.group)
                .zip(packed.chunks_exact(gb))
                .enumerate()
            {
                let (s, m) = Self::params(code, g);
                self.unpack_group(bytes, &mut block);
                block.iter_mut().for_each(|x| *x = x.mul_add(s, m));
                axpy(a, p, &block);
            }
        }
    }

    /// Decodes one group's packed bytes into the code values `out` (`group` floats) through the
    /// per-byte tables.
    #[inline]
    fn unpack_group(&self, packed: &[u8], out: &mut [f32]) {
        match self.bits {
            2 => out
                .chunks_exact_mut(4)
                .zip(packed)
                .for_each(|(o, &b)| o.copy_from_slice(&BYTE_CODES_2[usize::from(b)])),
            4 => out
                .chunks_exact_mut(2)
                .zip(packed)
                .for_each(|(o, &b)| o.copy_from_slice(&BYTE_CODES_4[usize::from(b)])),
            _ => out
                .iter_mut()
                .zip(packed)
                .for_each(|(o, &b)| *o = f32::from(b)),
        }
    }
}

/// The codes a byte holds, as floats, for `B`-bit codes (LSB first).
const fn byte_codes<const N: usize, const B: u32>() -> [[f32; N]; 256] {
    let mut t = [[0f32; N]; 256];
    let mut b = 0;
    while b < 256 {
        let mut i = 0;
        while i < N {
            t[b][i] = ((b >> (i as u32 * B)) & ((1 << B) - 1)) as f32;
            i += 1;
        }
        b += 1;
    }
    t
}

static BYTE_CODES_2: [[f32; 4]; 256] = byte_codes::<4, 2>();
static BYTE_CODES_4: [[f32; 2]; 256] = byte_codes::<2, 4>();

/// Symmetric trims (fractions of the min-max range cut from each end) [`fit`] tries at 2 bits.
/// Four levels over the min-max range of 32 Gaussians waste range on the tails; trimming cuts the
/// 2-bit value error by about a fifth (tests.rs). At 4 and 8 bits min-max is already right.
const TRIMS: [f32; 5] = [0.0, 0.05, 0.1, 0.15, 0.2];

/// The step by which [`fit`] then moves each end of the best symmetric trim on its own.
const STEP: f32 = 0.05;

/// The fp16 (scale, min) of one group: at 2 bits, of the ranges `[lo + a r, hi - b r]`
/// (r = hi - lo) tried (symmetric trims from [`TRIMS`], then each end moved by [`STEP`]), the one
/// with the least squared error once rounded to fp16, clipping included; at more bits, min-max.
fn fit(x: &[f32], levels: f32) -> (f16, f16) {
    let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let r = hi - lo;
    let params = |a: f32, b: f32| {
        let (l, h) = (lo + a * r, hi - b * r);
        (
            f16::from_f32(((h - l) / levels).min(f16::MAX.to_f32())),
            f16::from_f32(l),
        )
    };
    let sse = |(s, m): (f16, f16)| {
        let (s, m) = (s.to_f32(), m.to_f32());
        let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
        let err = |xi: f32| {
            let c = ((xi - m) * inv + 0.5).floor().clamp(0.0, levels);
            (m + s * c - xi).powi(2)
        };
        // Eight independent sums so the loop vectorizes.
        let (chunks, rest) = x.as_chunks::<8>();
        let mut acc = [0f32; 8];
        for c in chunks {
            for (a, &xi) in acc.iter_mut().zip(c) {
                *a += err(xi);
            }
        }
        acc.iter().sum::<f32>() + rest.iter().map(|&xi| err(xi)).sum::<f32>()
    };
    let mut best = (params(0.0, 0.0), f32::INFINITY);
    if levels > 3.0 {
        return best.0;
    }
    let mut consider = |a: f32, b: f32| {
        let p = params(a, b);
        let e = sse(p);
        if e < best.1 {
            best = (p, e);
        }
        e
    };
    // The best symmetric trim, then one step of each end on its own.
    let (mut t, mut least) = (0.0, f32::INFINITY);
    for &a in &TRIMS {
        let e = consider(a, a);
        if e < least {
            (t, least) = (a, e);
        }
    }
    for (a, b) in [(t - STEP, t), (t + STEP, t), (t, t - STEP), (t, t + STEP)] {
        if a >= 0.0 && b >= 0.0 {
            consider(a, b);
        }
    }
    best.0
}

impl ValueCodec for GroupCodec {
    fn head_dim(&self) -> usize {
        self.d
    }

    fn code_bytes(&self) -> usize {
        self.header() + bitpack::packed_len(self.d, self.bits)
    }

    fn encode(&self, _head: usize, v: &[f32], out: &mut [u8]) {
        let levels = ((1u32 << self.bits) - 1) as f32;
        let (head, packed) = out.split_at_mut(self.header());
        let per = 8 / self.bits as usize;
        for (g, (x, bytes)) in v
            .chunks_exact(self.group)
            .zip(packed.chunks_exact_mut(self.group_bytes()))
            .enumerate()
        {
            let (scale, min) = fit(x, levels);
            head[4 * g..4 * g + 2].copy_from_slice(&scale.to_le_bytes());
            head[4 * g + 2..4 * g + 4].copy_from_slice(&min.to_le_bytes());
            let (s, m) = (scale.to_f32(), min.to_f32());
            let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
            // Groups fill whole bytes and codes never straddle one (bits divides 8).
            for (byte, xs) in bytes.iter_mut().zip(x.chunks_exact(per)) {
                *byte = xs.iter().enumerate().fold(0u8, |b, (i, &xi)| {
                    // Round half up (floor vectorizes; `round` is a libm call).
                    let c = ((xi - m) * inv + 0.5).floor().clamp(0.0, levels) as u8;
                    b | c << (i as u32 * self.bits)
                });
            }
        }
    }

    fn decode(&self, _head: usize, code: &[u8], out: &mut [f32]) {
        let packed = &code[self.header()..];
        for (i, o) in out.iter_mut().enumerate() {
            let (s, m) = Self::params(code, i / self.group);
            *o = m + s * f32::from(bitpack::get(packed, self.bits, i));
        }
    }

    fn acc_len(&self) -> usize {
        self.d
    }

    fn accumulate(&self, _head: usize, probs: &[f32], codes: &[u8], acc: &mut [f32]) {
        self.accumulate_bytes(probs, codes, acc);
    }

    fn finish(&self, _head: usize, acc: &[f32], out: &mut [f32]) {
        out.copy_from_slice(&acc[..self.d]);
    }

    fn kernel(&self) -> KernelKind {
        KernelKind::GroupScalar
    }

    fn kernel_data(&self) -> Option<&KernelData<ValueSpec>> {
        Some(self.data.get_or_init(|| {
            KernelData::new(ValueSpec::Group {
                bits: self.bits,
                group: self.group,
            })
        }))
    }
}
