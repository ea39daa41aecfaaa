//! Q4_1 weight × Q8_1 activation matmul for the CPU, the decode path of quantized projections.
//!
//! candle 0.11 runs Q4_1 through its scalar `vec_dot_unopt`; this module holds the weight
//! repacked into tiles of 8 output rows × one 32-weight block, so that one 256-bit register holds
//! 4 quants of each of the 8 rows and the 8 dot products of a block come out in one register
//! without horizontal sums. The arithmetic is llama.cpp's (and candle's): every activation row is
//! quantized to Q8_1 (`d = amax / 127`, `q = round(x / d)`, `s = d * Σq`, `d` and `s` as f16) and
//! each block adds `sumi as f32 * d4 * d8 + m4 * s8` in that order, so every kernel here (scalar,
//! AVX2, AVX-512 VNNI) gives the same bits as [`matmul_q4_1_reference`] and as candle. Rows are
//! independent: a row's result never depends on the other rows of the batch. The tiles are the
//! only copy of the weight: the prompt path's f32 GEMM dequantizes from them (`dequant.rs`).

use crate::{ModelError, Result};
use candle_core::Tensor;
use candle_core::quantized::{GgmlDType, QTensor};
use half::f16;

/// Weights per Q4_1 / Q8_1 block.
pub const QK: usize = 32;
/// Bytes of one ggml Q4_1 block: f16 `d`, f16 `m`, 16 bytes of 4-bit quants.
pub const BLOCK_BYTES: usize = 20;
/// Output rows per tile.
const LANES: usize = 8;
/// Activation rows that share one pass over a tile's weights.
const TOKENS: usize = 4;

/// One block of 8 output rows. `qs[p]` holds, for row `r`, the 4 bytes `4p..4p + 4` of the row's
/// ggml quants at bytes `4r..4r + 4`: their low nibbles are quants `4p..4p + 4`, their high
/// nibbles quants `16 + 4p..16 + 4p + 4`.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct Tile {
    d: [u16; LANES],
    m: [u16; LANES],
    qs: [[u8; 32]; 4],
}

const _: () = assert!(std::mem::size_of::<Tile>() == 160);

/// A Q4_1 weight `[rows, cols]` repacked for [`Q41Weight::matmul`].
pub struct Q41Weight {
    rows: usize,
    cols: usize,
    /// `tiles[g * blocks + b]`: rows `8g..8g + 8` (zero-padded past `rows`), block `b`.
    tiles: Vec<Tile>,
}

impl std::fmt::Debug for Q41Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Q41Weight")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish_non_exhaustive()
    }
}

/// One activation block quantized to Q8_1, with `d` and `s` already widened from f16.
#[derive(Clone, Copy)]
struct Q8Block {
    qs: [i8; QK],
    d: f32,
    s: f32,
}

/// Quantizes `x` (a multiple of 32 long) to Q8_1 exactly as ggml's `quantize_row_q8_1` (and
/// candle's `BlockQ8_1::from_float`) do.
fn quantize_row_q8_1(x: &[f32], out: &mut [Q8Block]) {
    for (xs, blk) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = xs.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in blk.qs.iter_mut().zip(xs) {
            *q = (v * id).round() as i8;
            sum += *q as i32;
        }
        let d16 = f16::from_f32(d);
        blk.d = d16.to_f32();
        blk.s = (f16::from_f32(sum as f32) * d16).to_f32();
    }
}

/// Quantizes `t` rows of `cols` values each.
fn quantize_rows(x: &[f32], t: usize, cols: usize) -> Vec<Q8Block> {
    let zero = Q8Block {
        qs: [0; QK],
        d: 0.0,
        s: 0.0,
    };
    let nb = cols / QK;
    let mut acts = vec![zero; t * nb];
    for (row, out) in x.chunks_exact(cols).zip(acts.chunks_exact_mut(nb)) {
        quantize_row_q8_1(row, out);
    }
    acts
}

fn check_shapes(len: usize, rows: usize, cols: usize) -> Result<usize> {
    if cols == 0 || !cols.is_multiple_of(QK) {
        return Err(ModelError::Invalid(format!(
            "Q4_1 weight has {cols} columns, not a positive multiple of {QK}"
        )));
    }
    let blocks = cols / QK;
    if rows.checked_mul(blocks * BLOCK_BYTES) != Some(len) {
        return Err(ModelError::Invalid(format!(
            "Q4_1 weight [{rows}, {cols}] needs {} bytes, got {len}",
            rows * blocks * BLOCK_BYTES
        )));
    }
    Ok(blocks)
}

/// The plain scalar matmul `y[t, rows] = x[t, cols] · W[rows, cols]^T` over ggml Q4_1 blocks
/// (`w`, row-major, as `QTensor::data` gives them), a transcription of ggml's
/// `ggml_vec_dot_q4_1_q8_1` generic code. The yardstick for the fast kernels.
pub fn matmul_q4_1_reference(
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    t: usize,
) -> Result<Vec<f32>> {
    let nb = check_shapes(w.len(), rows, cols)?;
    if x.len() != t * cols {
        return Err(ModelError::Invalid(format!(
            "activations have {} values, expected {t} x {cols}",
            x.len()
        )));
    }
    let acts = quantize_rows(x, t, cols);
    let mut y = vec![0f32; t * rows];
    for (a_row, y_row) in acts.chunks_exact(nb).zip(y.chunks_exact_mut(rows)) {
        for (w_row, out) in w.chunks_exact(nb * BLOCK_BYTES).zip(y_row.iter_mut()) {
            let mut sumf = 0f32;
            for (blk, a) in w_row.chunks_exact(BLOCK_BYTES).zip(a_row) {
                let d4 = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                let m4 = f16::from_le_bytes([blk[2], blk[3]]).to_f32();
                let mut sumi = 0i32;
                for j in 0..QK / 2 {
                    let v0 = (blk[4 + j] & 0x0F) as i32;
                    let v1 = (blk[4 + j] >> 4) as i32;
                    sumi += v0 * a.qs[j] as i32 + v1 * a.qs[j + QK / 2] as i32;
                }
                sumf += sumi as f32 * d4 * a.d + m4 * a.s;
            }
            *out = sumf;
        }
    }
    Ok(y)
}

/// Which kernel runs the tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Vnni,
}

impl Kernel {
    /// The fastest kernel this CPU runs.
    fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            if avx2
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx512vl")
            {
                return Kernel::Vnni;
            }
            if avx2 {
                return Kernel::Avx2;
            }
        }
        Kernel::Scalar
    }

    /// Dots `n <= TOKENS` activation rows (`acts[i * blocks..]`, one row per token) with one
    /// 8-row group of tiles, into `out[i]`.
    fn run(self, tiles: &[Tile], acts: &[Q8Block], n: usize, out: &mut [[f32; LANES]]) {
        match self {
            Kernel::Scalar => group_scalar(tiles, acts, n, out),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: only `best` (or a test, below what `best` found) picks a SIMD kernel, and
            // only after detecting avx2, fma and f16c (and avx512vnni, avx512vl for Vnni).
            Kernel::Avx2 => unsafe { x86::group_avx2(tiles, acts, n, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Kernel::Vnni => unsafe { x86::group_vnni(tiles, acts, n, out) },
        }
    }
}

/// The portable kernel over tiles, for CPUs without AVX2.
fn group_scalar(tiles: &[Tile], acts: &[Q8Block], n: usize, out: &mut [[f32; LANES]]) {
    let nb = tiles.len();
    for (i, o) in out.iter_mut().enumerate().take(n) {
        *o = [0.0; LANES];
        for (tile, a) in tiles.iter().zip(&acts[i * nb..(i + 1) * nb]) {
            for (r, acc) in o.iter_mut().enumerate() {
                let mut sumi = 0i32;
                for (p, qs) in tile.qs.iter().enumerate() {
                    for k in 0..4 {
                        let byte = qs[4 * r + k];
                        sumi += (byte & 0x0F) as i32 * a.qs[4 * p + k] as i32
                            + (byte >> 4) as i32 * a.qs[16 + 4 * p + k] as i32;
                    }
                }
                let d4 = f16::from_bits(tile.d[r]).to_f32();
                let m4 = f16::from_bits(tile.m[r]).to_f32();
                *acc += sumi as f32 * d4 * a.d + m4 * a.s;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{LANES, Q8Block, TOKENS, Tile};
    use std::arch::x86_64::*;

    /// The 32-bit word of activation quants `i..i + 4`, to broadcast.
    #[inline(always)]
    fn word(qs: &[i8; 32], i: usize) -> i32 {
        i32::from_le_bytes([
            qs[i] as u8,
            qs[i + 1] as u8,
            qs[i + 2] as u8,
            qs[i + 3] as u8,
        ])
    }

    /// The tile's quants as 8 vectors of u8: `w[p]` (p < 4) lane r holds quants `4p..4p + 4` of
    /// row r, `w[p + 4]` quants `16 + 4p..16 + 4p + 4`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn unpack(tile: &Tile) -> [__m256i; 8] {
        let mask = _mm256_set1_epi8(0x0F);
        let mut w = [_mm256_setzero_si256(); 8];
        for p in 0..4 {
            // SAFETY: `tile.qs[p]` is 32 readable bytes; the load is unaligned.
            let raw = unsafe { _mm256_loadu_si256(tile.qs[p].as_ptr().cast()) };
            w[p] = _mm256_and_si256(raw, mask);
            w[p + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask);
        }
        w
    }

    /// The tile's `d` and `m` of its 8 rows as f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn scales(tile: &Tile) -> (__m256, __m256) {
        // SAFETY: `tile.d` and `tile.m` are 16 readable bytes each; the loads are unaligned.
        let (d, m) = unsafe {
            (
                _mm_loadu_si128(tile.d.as_ptr().cast()),
                _mm_loadu_si128(tile.m.as_ptr().cast()),
            )
        };
        (_mm256_cvtph_ps(d), _mm256_cvtph_ps(m))
    }

    /// `acc + sumi * d4 * d8 + m4 * s8` rounded step by step as the scalar code does (no FMA),
    /// so that every kernel gives the same bits.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn accumulate(acc: __m256, sumi: __m256i, d4: __m256, m4: __m256, a: &Q8Block) -> __m256 {
        let t = _mm256_mul_ps(
            _mm256_mul_ps(_mm256_cvtepi32_ps(sumi), d4),
            _mm256_set1_ps(a.d),
        );
        let u = _mm256_mul_ps(m4, _mm256_set1_ps(a.s));
        _mm256_add_ps(acc, _mm256_add_ps(t, u))
    }

    /// The 8 rows' `sumi` of one block with AVX2: u8 × i8 pair sums in i16 (at most
    /// 8 × 2 × 15 × 127 = 30480, no saturation), then widened pairwise to i32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn sumi_avx2(w: &[__m256i; 8], a: &Q8Block) -> __m256i {
        let mut s = _mm256_setzero_si256();
        for p in 0..4 {
            let lo = _mm256_set1_epi32(word(&a.qs, 4 * p));
            let hi = _mm256_set1_epi32(word(&a.qs, 16 + 4 * p));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[p], lo));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[p + 4], hi));
        }
        _mm256_madd_epi16(s, _mm256_set1_epi16(1))
    }

    /// The 8 rows' `sumi` of one block with VNNI `vpdpbusd`, two chains for latency.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    fn sumi_vnni(w: &[__m256i; 8], a: &Q8Block) -> __m256i {
        let mut s0 = _mm256_setzero_si256();
        let mut s1 = _mm256_setzero_si256();
        for p in 0..4 {
            let lo = _mm256_set1_epi32(word(&a.qs, 4 * p));
            let hi = _mm256_set1_epi32(word(&a.qs, 16 + 4 * p));
            s0 = _mm256_dpbusd_epi32(s0, w[p], lo);
            s1 = _mm256_dpbusd_epi32(s1, w[p + 4], hi);
        }
        _mm256_add_epi32(s0, s1)
    }

    /// Defines `$group(tiles, acts, n, out)`: `n <= TOKENS` activation rows against one 8-row
    /// group with the accumulators in registers, compiled for `$features` so that `$sumi`
    /// inlines.
    macro_rules! kernel {
        ($group:ident, $tile:ident, $features:literal, $sumi:ident) => {
            #[inline]
            #[target_feature(enable = $features)]
            fn $tile<const N: usize>(tiles: &[Tile], acts: &[Q8Block], out: &mut [[f32; LANES]]) {
                let nb = tiles.len();
                let mut acc = [_mm256_setzero_ps(); N];
                for (b, tile) in tiles.iter().enumerate() {
                    let w = unpack(tile);
                    let (d4, m4) = scales(tile);
                    for (i, acc) in acc.iter_mut().enumerate() {
                        let a = &acts[i * nb + b];
                        *acc = accumulate(*acc, $sumi(&w, a), d4, m4, a);
                    }
                }
                for (o, acc) in out.iter_mut().zip(acc) {
                    // SAFETY: `o` is 8 writable f32; the store is unaligned.
                    unsafe { _mm256_storeu_ps(o.as_mut_ptr(), acc) };
                }
            }

            #[target_feature(enable = $features)]
            pub(super) fn $group(
                tiles: &[Tile],
                acts: &[Q8Block],
                n: usize,
                out: &mut [[f32; LANES]],
            ) {
                const _: () = assert!(TOKENS == 4);
                match n {
                    1 => $tile::<1>(tiles, acts, out),
                    2 => $tile::<2>(tiles, acts, out),
                    3 => $tile::<3>(tiles, acts, out),
                    _ => $tile::<4>(tiles, acts, out),
                }
            }
        };
    }

    kernel!(group_avx2, tile_avx2, "avx2,fma,f16c", sumi_avx2);
    kernel!(
        group_vnni,
        tile_vnni,
        "avx2,fma,f16c,avx512vnni,avx512vl",
        sumi_vnni
    );
}

/// The output buffer shared by the pool's workers.
struct SharedOut(*mut f32);

// SAFETY: the workers write disjoint elements (see `Q41Weight::matmul_with`), and the buffer
// outlives the pool call that uses the pointer.
unsafe impl Sync for SharedOut {}

impl Q41Weight {
    /// Repacks ggml Q4_1 blocks (`rows` rows of `cols / 32` blocks, as `QTensor::data` gives
    /// them).
    pub fn from_blocks(w: &[u8], rows: usize, cols: usize) -> Result<Self> {
        let nb = check_shapes(w.len(), rows, cols)?;
        let groups = rows.div_ceil(LANES);
        let empty = Tile {
            d: [0; LANES],
            m: [0; LANES],
            qs: [[0; 32]; 4],
        };
        let mut tiles = vec![empty; groups * nb];
        for (row, w_row) in w.chunks_exact(nb * BLOCK_BYTES).enumerate() {
            let (g, r) = (row / LANES, row % LANES);
            for (b, blk) in w_row.chunks_exact(BLOCK_BYTES).enumerate() {
                let tile = &mut tiles[g * nb + b];
                tile.d[r] = u16::from_le_bytes([blk[0], blk[1]]);
                tile.m[r] = u16::from_le_bytes([blk[2], blk[3]]);
                for (p, qs) in tile.qs.iter_mut().enumerate() {
                    qs[4 * r..4 * r + 4].copy_from_slice(&blk[4 + 4 * p..8 + 4 * p]);
                }
            }
        }
        Ok(Self { rows, cols, tiles })
    }

    /// The repacked weight of a 2-D Q4_1 tensor on the CPU; `None` for anything else.
    pub fn from_qtensor(q: &QTensor) -> Result<Option<Self>> {
        if q.dtype() != GgmlDType::Q4_1 || !q.device().is_cpu() {
            return Ok(None);
        }
        let Ok((rows, cols)) = q.shape().dims2() else {
            return Ok(None);
        };
        Ok(Some(Self::from_blocks(&q.data()?, rows, cols)?))
    }

    /// `y[t, rows] = x[t, cols] · W^T` with the fastest kernel this CPU has.
    pub fn matmul(&self, x: &[f32], t: usize) -> Result<Vec<f32>> {
        self.matmul_with(Kernel::best(), x, t)
    }

    fn matmul_with(&self, kernel: Kernel, x: &[f32], t: usize) -> Result<Vec<f32>> {
        let (rows, cols) = (self.rows, self.cols);
        if x.len() != t * cols {
            return Err(ModelError::Invalid(format!(
                "activations have {} values, expected {t} x {cols}",
                x.len()
            )));
        }
        let nb = cols / QK;
        let acts = quantize_rows(x, t, cols);
        let mut y = vec![0f32; t * rows];
        let out = SharedOut(y.as_mut_ptr());
        let out = &out;
        let groups = rows.div_ceil(LANES);
        let work = |range: std::ops::Range<usize>| {
            let mut buf = [[0f32; LANES]; TOKENS];
            for g in range {
                let tiles = &self.tiles[g * nb..(g + 1) * nb];
                let width = LANES.min(rows - g * LANES);
                for t0 in (0..t).step_by(TOKENS) {
                    let n = TOKENS.min(t - t0);
                    kernel.run(tiles, &acts[t0 * nb..(t0 + n) * nb], n, &mut buf);
                    for (i, vals) in buf.iter().enumerate().take(n) {
                        let at = (t0 + i) * rows + g * LANES;
                        // SAFETY: `at + width <= t * rows`, inside `y`, which outlives this
                        // call; group `g` alone writes columns `8g..8g + width` of each row,
                        // so no two workers write the same element and nothing reads `y`
                        // until the pool call returns.
                        unsafe {
                            std::ptr::copy_nonoverlapping(vals.as_ptr(), out.0.add(at), width)
                        };
                    }
                }
            }
        };
        if t * rows * cols < 1 << 16 {
            work(0..groups);
        } else {
            candle_core::utils::barrier_pool().execute_chunked(groups, work);
        }
        Ok(y)
    }

    /// Applies the weight to `x: [T, cols]` (f32, CPU), giving `[T, rows]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let t = x.dim(0)?;
        let xs = x.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let y = self.matmul(&xs, t)?;
        Ok(Tensor::from_vec(y, (t, self.rows), x.device())?)
    }
}

mod dequant;

#[cfg(test)]
mod tests;
