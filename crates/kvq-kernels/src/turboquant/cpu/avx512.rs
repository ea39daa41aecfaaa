//! The AVX-512 (F, BW, VBMI) paths of the codebook kernels, for head dims 64, 128 and 256 and
//! indices of 1 to 6 bits. A row is read 64 coordinates (8 * bits bytes) at a time with one masked
//! load; for each 16 coordinates a byte permute puts the two bytes holding each index into its
//! 32-bit lane and a variable shift brings the index to bit 0. The bits above it are left as they
//! are: the codebook is stored periodically, so the register permute that looks the level up
//! (`vpermps` for up to 16 levels, `vpermi2ps` for 32, two of them and a blend for 64) ignores
//! them. Scores multiply-add the levels with the query and reduce 16 rows' lanes at once with
//! one transpose-and-add tree; for 2- and 4-bit indices of 16+ rows they instead zero-extend 16
//! bytes to lanes and shift (no byte permute), with the query reordered to match once per call.
//! Value sums keep the whole accumulator in registers across all rows (the byte permute measured
//! faster there).

use crate::turboquant::{Rows, Table};
use std::arch::x86_64::*;

/// Whether this CPU runs these paths.
pub fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vbmi")
}

/// How to unpack the four 16-coordinate steps of a 64-coordinate chunk.
struct Unpack {
    /// Byte permute: lane `l` of step `t` gets the two bytes holding index `16t + l`.
    perm: [__m512i; 4],
    /// Per-lane right shift that brings that index to bit 0.
    shift: [__m512i; 4],
    /// Load mask of one chunk (`8 * bits` bytes).
    mask: u64,
    chunk_bytes: usize,
}

/// The byte permutes and shifts of `B`-bit indices, built at compile time.
struct Controls<const B: u32>;

impl<const B: u32> Controls<B> {
    const PERM: [[u8; 64]; 4] = {
        let mut perm = [[0u8; 64]; 4];
        let mut i = 0;
        while i < 64 {
            let bit = i * B as usize;
            let (t, lane) = (i / 16, i % 16);
            perm[t][4 * lane] = (bit / 8) as u8;
            let next = bit / 8 + 1;
            perm[t][4 * lane + 1] = if next < 63 { next } else { 63 } as u8;
            i += 1;
        }
        perm
    };
    const SHIFT: [[u32; 16]; 4] = {
        let mut shift = [[0u32; 16]; 4];
        let mut i = 0;
        while i < 64 {
            shift[i / 16][i % 16] = ((i * B as usize) % 8) as u32;
            i += 1;
        }
        shift
    };
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
fn unpack_controls<const B: u32>() -> Unpack {
    let mut p = [_mm512_setzero_si512(); 4];
    let mut s = [_mm512_setzero_si512(); 4];
    for t in 0..4 {
        // SAFETY: 64-byte loads from 64-byte arrays.
        unsafe {
            p[t] = _mm512_loadu_si512(Controls::<B>::PERM[t].as_ptr().cast());
            s[t] = _mm512_loadu_si512(Controls::<B>::SHIFT[t].as_ptr().cast());
        }
    }
    let chunk_bytes = 8 * B as usize;
    Unpack {
        perm: p,
        shift: s,
        mask: (1u64 << chunk_bytes) - 1,
        chunk_bytes,
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
fn tables(table: &Table) -> [__m512; 4] {
    let mut t = [_mm512_setzero_ps(); 4];
    for (k, v) in t.iter_mut().enumerate() {
        // SAFETY: 16 floats at 16k of a 64-float array.
        *v = unsafe { _mm512_loadu_ps(table.periodic().as_ptr().add(16 * k)) };
    }
    t
}

/// The levels of 16 indices (bits above `B` ignored).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
fn lookup<const B: u32>(idx: __m512i, t: &[__m512; 4]) -> __m512 {
    if B <= 4 {
        _mm512_permutexvar_ps(idx, t[0])
    } else if B == 5 {
        _mm512_permutex2var_ps(t[0], idx, t[1])
    } else {
        let lo = _mm512_permutex2var_ps(t[0], idx, t[1]);
        let hi = _mm512_permutex2var_ps(t[2], idx, t[3]);
        let upper = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
        _mm512_mask_blend_ps(upper, lo, hi)
    }
}

/// The 16 indices of step `t` of a chunk whose bytes are loaded in `bytes`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
fn indices(u: &Unpack, bytes: __m512i, t: usize) -> __m512i {
    _mm512_srlv_epi32(_mm512_permutexvar_epi8(u.perm[t], bytes), u.shift[t])
}

/// Row `r`'s scale (see `Rows::scale_at`), read without bounds checks.
///
/// # Safety
/// `Rows::check` has passed for at least `r + 1` rows.
#[inline]
unsafe fn scale(rows: &Rows<'_>, r: usize) -> f32 {
    match rows.scale_at {
        // SAFETY: check() covers `scale_at + 2` bytes of every row.
        Some(at) => unsafe {
            let p = rows.data.as_ptr().add(r * rows.stride + at);
            half::f16::from_bits(u16::from_le_bytes([*p, *p.add(1)])).to_f32()
        },
        None => 1.0,
    }
}

/// The 16 per-lane products `q * levels` of row `r`, summed over the row's steps (lane sums
/// still to be added).
///
/// # Safety
/// `Rows::check` has passed for at least `r + 1` rows of `16 * S` indices of `B` bits.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
unsafe fn row_products<const B: u32, const S: usize, const Z: bool>(
    u: &Unpack,
    tb: &[__m512; 4],
    qv: &[__m512; S],
    rows: &Rows<'_>,
    r: usize,
) -> __m512 {
    let at = r * rows.stride + rows.offset;
    let mut acc = _mm512_setzero_ps();
    if Z && zero_extends(B) {
        let e = (8 / B) as usize;
        for g in 0..S / e {
            // SAFETY: the row's `S * 16 * B / 8` packed bytes lie inside `data` (check()); group
            // g is bytes 16g..16g + 16 of them.
            let bytes = unsafe {
                _mm512_cvtepu8_epi32(_mm_loadu_si128(rows.data.as_ptr().add(at + 16 * g).cast()))
            };
            for m in 0..e {
                let idx = _mm512_srl_epi32(bytes, _mm_cvtsi32_si128((m as u32 * B) as i32));
                acc = _mm512_fmadd_ps(lookup::<B>(idx, tb), qv[g * e + m], acc);
            }
        }
        return acc;
    }
    for k in 0..S / 4 {
        // SAFETY: the row's `S * 16 * B / 8` packed bytes lie inside `data` (check()); the mask
        // reads the `8 * B` bytes of chunk k only.
        let bytes = unsafe {
            _mm512_maskz_loadu_epi8(
                u.mask,
                rows.data.as_ptr().add(at + k * u.chunk_bytes).cast(),
            )
        };
        for t in 0..4 {
            let v = lookup::<B>(indices(u, bytes, t), tb);
            acc = _mm512_fmadd_ps(v, qv[4 * k + t], acc);
        }
    }
    acc
}

/// Whether `B`-bit indices are unpacked by zero-extending bytes to 32-bit lanes (2 and 4 bits:
/// no index straddles a byte). Lane `j` of step `s` then holds coordinate [`lane_coord`].
const fn zero_extends(bits: u32) -> bool {
    bits == 2 || bits == 4
}

/// The coordinate lane `j` of step `s` holds: `j + 16 s` in general; with zero-extended bytes
/// (`e = 8 / bits` indices a byte), byte `j` of 16-byte group `s / e`, index `s % e` in it.
fn lane_coord(bits: u32, s: usize, j: usize) -> usize {
    if bits != 0 && zero_extends(bits) {
        let e = (8 / bits) as usize;
        (s / e) * 16 * e + j * e + s % e
    } else {
        16 * s + j
    }
}

/// Loads `x` (16 * S floats) into the step order of `bits`-bit indices (0: coordinate order).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
fn load_steps<const S: usize>(bits: u32, x: &[f32]) -> [__m512; S] {
    let mut v = [_mm512_setzero_ps(); S];
    let mut lanes = [0f32; 16];
    for (s, vs) in v.iter_mut().enumerate() {
        for (j, l) in lanes.iter_mut().enumerate() {
            *l = x[lane_coord(bits, s, j)];
        }
        // SAFETY: 16 floats from a 16-float array.
        *vs = unsafe { _mm512_loadu_ps(lanes.as_ptr()) };
    }
    v
}

/// Stores vectors in the step order of `bits`-bit indices (0: coordinate order) back to `x`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
fn store_steps<const S: usize>(bits: u32, v: &[__m512; S], x: &mut [f32]) {
    let mut lanes = [0f32; 16];
    for (s, vs) in v.iter().enumerate() {
        // SAFETY: 16 floats into a 16-float array.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *vs) };
        for (j, l) in lanes.iter().enumerate() {
            x[lane_coord(bits, s, j)] = *l;
        }
    }
}

/// Lane sums of four vectors, as four partial sums per 128-bit segment: segment `s` of the
/// result holds `[a, b, c, d]`'s sums over their own segment `s`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
fn fold4(a: __m512, b: __m512, c: __m512, d: __m512) -> __m512 {
    let ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    let cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    _mm512_add_ps(
        _mm512_shuffle_ps::<0x44>(ab, cd),
        _mm512_shuffle_ps::<0xEE>(ab, cd),
    )
}

/// Adds segment pairs: `[x.s0 + x.s1, x.s2 + x.s3, y.s0 + y.s1, y.s2 + y.s3]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
fn fold_segments(x: __m512, y: __m512) -> __m512 {
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(x, y),
        _mm512_shuffle_f32x4::<0xDD>(x, y),
    )
}

/// `S` = d / 16 steps of 16 coordinates. Rows go 16 at a time, so the 16 lane sums are one
/// transpose-and-add tree instead of 16 horizontal reductions.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
fn dot_impl<const B: u32, const S: usize, const Z: bool>(
    q: &[f32],
    table: &Table,
    rows: Rows<'_>,
    out: &mut [f32],
) {
    let u = unpack_controls::<B>();
    let tb = tables(table);
    assert!(q.len() >= 16 * S && rows.d == 16 * S);
    let qv = load_steps::<S>(if Z { B } else { 0 }, q);
    let n = out.len();
    let mut r = 0;
    // SAFETY (row_products, scale): the caller ran `Rows::check` for `out.len()` rows.
    while r + 16 <= n {
        let mut quads = [_mm512_setzero_ps(); 4];
        for (g, quad) in quads.iter_mut().enumerate() {
            let b = r + 4 * g;
            let (p0, p1, p2, p3) = unsafe {
                (
                    row_products::<B, S, Z>(&u, &tb, &qv, &rows, b),
                    row_products::<B, S, Z>(&u, &tb, &qv, &rows, b + 1),
                    row_products::<B, S, Z>(&u, &tb, &qv, &rows, b + 2),
                    row_products::<B, S, Z>(&u, &tb, &qv, &rows, b + 3),
                )
            };
            *quad = fold4(p0, p1, p2, p3);
        }
        let sums = fold_segments(
            fold_segments(quads[0], quads[1]),
            fold_segments(quads[2], quads[3]),
        );
        let mut scales = [1f32; 16];
        if rows.scale_at.is_some() {
            for (i, s) in scales.iter_mut().enumerate() {
                *s = unsafe { scale(&rows, r + i) };
            }
        }
        // SAFETY: r + 16 <= out.len(); 16 floats from a 16-float array.
        unsafe {
            let sv = _mm512_loadu_ps(scales.as_ptr());
            _mm512_storeu_ps(out.as_mut_ptr().add(r), _mm512_mul_ps(sums, sv));
        }
        r += 16;
    }
    for (i, o) in out.iter_mut().enumerate().skip(r) {
        let v = unsafe { row_products::<B, S, Z>(&u, &tb, &qv, &rows, i) };
        *o = _mm512_reduce_add_ps(v) * unsafe { scale(&rows, i) };
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
fn axpy_impl<const B: u32, const S: usize>(
    w: &[f32],
    table: &Table,
    rows: Rows<'_>,
    acc: &mut [f32],
) {
    let u = unpack_controls::<B>();
    let tb = tables(table);
    assert!(acc.len() >= 16 * S && rows.d == 16 * S);
    // Value sums always unpack with the byte permute: measured (min of 300 interleaved runs,
    // 8192 rows, d = 64) 26.8 us against 30 (2-bit) and 35 us (4-bit) with zero-extended bytes,
    // which win for scores instead (22 us against 30.5).
    let mut a = load_steps::<S>(0, acc);
    for (r, &wr) in w.iter().enumerate() {
        let at = r * rows.stride + rows.offset;
        // SAFETY: the caller ran `Rows::check` for `w.len()` rows.
        let wv = _mm512_set1_ps(wr * unsafe { scale(&rows, r) });
        let row = rows.data.as_ptr();
        for k in 0..S / 4 {
            // SAFETY: as in `row_products`.
            let bytes =
                unsafe { _mm512_maskz_loadu_epi8(u.mask, row.add(at + k * u.chunk_bytes).cast()) };
            for t in 0..4 {
                let v = lookup::<B>(indices(&u, bytes, t), &tb);
                a[4 * k + t] = _mm512_fmadd_ps(v, wv, a[4 * k + t]);
            }
        }
    }
    store_steps::<S>(0, &a, acc);
}

/// Scores with zero-extended bytes where the width allows (the query is reordered once per call).
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
fn dot_reordered<const B: u32, const S: usize>(q: &[f32], t: &Table, r: Rows<'_>, o: &mut [f32]) {
    dot_impl::<B, S, true>(q, t, r, o)
}

/// Scores in coordinate order (no per-call reordering: cheaper for a handful of rows).
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
fn dot_in_order<const B: u32, const S: usize>(q: &[f32], t: &Table, r: Rows<'_>, o: &mut [f32]) {
    dot_impl::<B, S, false>(q, t, r, o)
}

/// Runs `$f::<bits, d / 16>` for the supported shapes, `$fallback` otherwise.
macro_rules! dispatch {
    ($f:ident, $bits:expr, $d:expr, ($($arg:expr),*), $fallback:expr) => {
        match ($bits, $d) {
            (1, 64) => unsafe { $f::<1, 4>($($arg),*) },
            (1, 128) => unsafe { $f::<1, 8>($($arg),*) },
            (1, 256) => unsafe { $f::<1, 16>($($arg),*) },
            (2, 64) => unsafe { $f::<2, 4>($($arg),*) },
            (2, 128) => unsafe { $f::<2, 8>($($arg),*) },
            (2, 256) => unsafe { $f::<2, 16>($($arg),*) },
            (3, 64) => unsafe { $f::<3, 4>($($arg),*) },
            (3, 128) => unsafe { $f::<3, 8>($($arg),*) },
            (3, 256) => unsafe { $f::<3, 16>($($arg),*) },
            (4, 64) => unsafe { $f::<4, 4>($($arg),*) },
            (4, 128) => unsafe { $f::<4, 8>($($arg),*) },
            (4, 256) => unsafe { $f::<4, 16>($($arg),*) },
            (5, 64) => unsafe { $f::<5, 4>($($arg),*) },
            (5, 128) => unsafe { $f::<5, 8>($($arg),*) },
            (5, 256) => unsafe { $f::<5, 16>($($arg),*) },
            (6, 64) => unsafe { $f::<6, 4>($($arg),*) },
            (6, 128) => unsafe { $f::<6, 8>($($arg),*) },
            (6, 256) => unsafe { $f::<6, 16>($($arg),*) },
            _ => $fallback,
        }
    };
}

/// Scores on this path (the caller has checked the rows); the portable path when the CPU lacks
/// the features or the shape is not covered.
pub fn dot_rows(q: &[f32], table: &Table, rows: Rows<'_>, out: &mut [f32]) {
    if !available() {
        return super::portable::dot_rows_portable(q, table, rows, out);
    }
    // SAFETY (each arm): the CPU has avx512f, avx512bw and avx512vbmi (checked above).
    if out.len() >= 16 {
        dispatch!(
            dot_reordered,
            table.bits(),
            rows.d,
            (q, table, rows, out),
            super::portable::dot_rows_portable(q, table, rows, out)
        )
    } else {
        dispatch!(
            dot_in_order,
            table.bits(),
            rows.d,
            (q, table, rows, out),
            super::portable::dot_rows_portable(q, table, rows, out)
        )
    }
}

/// Value sums on this path; falls back like [`dot_rows`].
pub fn axpy_rows(w: &[f32], table: &Table, rows: Rows<'_>, acc: &mut [f32]) {
    if !available() {
        return super::portable::axpy_rows_portable(w, table, rows, acc);
    }
    // SAFETY (each arm): as in `dot_rows`.
    dispatch!(
        axpy_impl,
        table.bits(),
        rows.d,
        (w, table, rows, acc),
        super::portable::axpy_rows_portable(w, table, rows, acc)
    )
}
