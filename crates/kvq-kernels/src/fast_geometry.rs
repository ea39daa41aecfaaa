//! The geometry of the version-5 CUDA decode attention that needs no GPU (kernels/cuda/
//! turboquant_mse/fast.cuh; launched by cuda/fast.rs): the f16 scale of a level table, the f16
//! rounding of VecInfer's codebooks, the shared-memory layout of a block, the number of splits.
//! Plain functions, tested in CI.

/// Largest dynamic shared memory a block may ask for on sm_90 (227 KiB).
pub const MAX_SMEM: usize = 227 * 1024;

/// Most code splits plus the exact block per (row, kv head) (`KVQ_FAST_MAX_SLOTS`).
pub const MAX_SLOTS: usize = 256;

/// A scale `s` in [1, 2) for which every level times `s` rounds to f16 with the smallest
/// largest relative error (the fast kernels' tables hold `level * s` in f16 and divide `s` back
/// out): at 1 and 2 bits the few distinct magnitudes round nearly exactly, at 4 bits the worst
/// level's error falls from ~3e-4 to ~1e-4 (Lloyd-Max Gaussian levels).
pub fn f16_scale(levels: &[f32]) -> f32 {
    let mut mags: Vec<f32> = levels
        .iter()
        .map(|x| x.abs())
        .filter(|x| x.is_finite() && *x > 0.0)
        .collect();
    mags.sort_by(f32::total_cmp);
    mags.dedup();
    if mags.is_empty() {
        return 1.0;
    }
    const STEPS: usize = 1 << 14;
    let worst = |s: f32| {
        mags.iter()
            .map(|&m| {
                let x = m * s;
                ((half::f16::from_f32(x).to_f32() - x) / x).abs()
            })
            .fold(0f32, f32::max)
    };
    let mut best = (worst(1.0), 1.0f32);
    for i in 1..STEPS {
        let s = 1.0 + i as f32 / STEPS as f32;
        let w = worst(s);
        if w < best.0 {
            best = (w, s);
        }
    }
    best.1
}

/// VecInfer's codebooks (`[books][256][sub]`, f32) rounded to f16 for the fast kernel with the
/// rounding errors of each book's coordinate summing to about zero over its 256 centroids:
/// every entry is one of its two f16 neighbours (at most one unit in the last place off, where
/// rounding to nearest is half of one), picked by error diffusion in centroid order.
///
/// Why: a value's output is a probability-weighted mean of centroids, so the part of the f16
/// errors that all centroids share (their mean, per coordinate) adds up coherently over the
/// rows while the output itself shrinks like one over the square root of the rows it averages.
/// With rounding to nearest the parity run on an H100 measured relative errors growing from
/// 5e-4 at 4,096 positions to 1.03e-3 at 32,768 (bar 1e-3); the mean error cancelled, the
/// error stays near the other terms' 2e-4 (a simulation of that case: 1.45e-3 -> 2.9e-4).
pub fn balanced_f16(books: &[f32], sub: usize) -> Vec<half::f16> {
    use half::f16;
    let mut out: Vec<f16> = books.iter().map(|&x| f16::from_f32(x)).collect();
    if sub == 0 {
        return out;
    }
    let book = 256 * sub;
    for b in 0..books.len().div_ceil(book) {
        let lo = b * book;
        let hi = (lo + book).min(books.len());
        for j in 0..sub {
            let mut err = 0f64;
            for i in (lo + j..hi).step_by(sub) {
                let x = books[i];
                let near = f16::from_f32(x);
                if !x.is_finite() || near.to_f32() == x || !near.is_finite() {
                    continue;
                }
                // The neighbour on the other side of x.
                let step = if near.to_f32() < x { 1i16 } else { -1 };
                let other = next_f16(near, step);
                let dn = f64::from(near.to_f32()) - f64::from(x);
                let pick = match other {
                    Some(o) if o.is_finite() => {
                        let dother = f64::from(o.to_f32()) - f64::from(x);
                        if (err + dother).abs() < (err + dn).abs() {
                            o
                        } else {
                            near
                        }
                    }
                    _ => near,
                };
                err += f64::from(pick.to_f32()) - f64::from(x);
                out[i] = pick;
            }
        }
    }
    out
}

/// The f16 one unit in the last place above (`step` 1) or below (-1) `x`, if there is one.
fn next_f16(x: half::f16, step: i16) -> Option<half::f16> {
    use half::f16;
    let v = x.to_f32();
    if v == 0.0 {
        let tiny = f16::from_bits(1);
        return Some(if step > 0 { tiny } else { -tiny });
    }
    // For a nonzero f16 the bit pattern of its magnitude is monotonic.
    let bits = x.to_bits();
    let away = (v > 0.0) == (step > 0);
    let mag = bits & 0x7fff;
    let mag = if away {
        mag.checked_add(1)?
    } else {
        mag.checked_sub(1)?
    };
    Some(f16::from_bits((bits & 0x8000) | mag))
}

/// What a fast kernel keeps in shared memory besides its stages (kernels/cuda/common/fast_frame.cuh
/// `fast_layout`): rows of pair tables, k steps of sketch fragments, floats of projection
/// scratch (the query fragments always have their place).
#[derive(Debug, Clone, Copy)]
pub struct Tables {
    pub rows: usize,
    pub sketch_steps: usize,
    pub proj_floats: usize,
}

impl Tables {
    /// The scalar-code kernels (TurboQuant MSE, RVQ; Prod with its sketch of m = d).
    pub fn scalar(d: usize, (kb, vb): (usize, usize), sketch: bool) -> Self {
        Self {
            rows: 1 << (2 * kb.max(vb)),
            sketch_steps: if sketch { d / 16 } else { 0 },
            proj_floats: if sketch { 4 * 8 * d } else { 0 },
        }
    }

    /// The VecInfer kernel: `bytes` of f16 codebooks (keys' and values', a multiple of 256).
    pub fn books(bytes: usize) -> Self {
        Self {
            rows: bytes.div_ceil(256),
            sketch_steps: 0,
            proj_floats: 0,
        }
    }

    /// The QJL kernel: value pair tables of `vb` bits, a sketch padded to `m_pad` (a multiple
    /// of 64).
    pub fn qjl(vb: usize, m_pad: usize) -> Self {
        Self {
            rows: 1 << (2 * vb),
            sketch_steps: m_pad / 16,
            proj_floats: 8 * m_pad,
        }
    }
}

/// Shared-memory bytes of a block (common/fast_frame.cuh `fast_layout`, field for field).
pub fn smem(
    d: usize,
    t: Tables,
    (nw, stages): (usize, usize),
    (kcb, vcb): (usize, usize),
) -> usize {
    let mut at = t.rows * 256;
    if t.sketch_steps > 0 {
        at += 16 * 256;
    }
    at += 8 * d * 4;
    at += (d / 16) * 32 * 16;
    at += t.sketch_steps * 32 * 16 + t.proj_floats * 4;
    at += 2 * nw * 8 * 4 + 16;
    let stage = |cb: usize| (16 * cb + 48 + 15) & !15;
    let stages = nw * stages * (stage(kcb) + stage(vcb));
    let merge = nw * 8 * (d + d / 16 + 1) * 4;
    let fin = 8 * (MAX_SLOTS + 1) * 4 + 8 * d * 4;
    at + stages.max(merge).max(fin)
}

/// Code splits per (row, kv head) pair, at most `most`: as many as fit one wave of one block per
/// multiprocessor (each block builds its lookup tables once; a second wave of smaller blocks
/// would repeat that for a few percent of balance).
pub fn splits(pairs: usize, sms: usize, most: usize) -> usize {
    (sms / pairs.max(1)).clamp(1, most.max(1))
}

/// What a block costs besides its chunks, in chunk rounds (one 16-row chunk per warp): its
/// tables, queries and merge. Nsight Compute on an H100 (llama3-8b, batch 1, mse-4bit): a block
/// of one round per warp took ~18 us and a round ~2 us; the exact rows' block takes about as long
/// as a short code block, so blocks past the first wave start that much later.
pub const BLOCK_ROUNDS: usize = 8;

/// [`splits`] when each pair also has `exact` blocks of fp16 rows in the same launch: the
/// blocks past one wave start only when the first blocks end (~[`BLOCK_ROUNDS`] rounds), so one
/// split fewer is taken when that fits the wave and costs fewer rounds. `rows` code rows per
/// pair, `round_rows` rows per round of a block (warps x 16).
pub fn splits_with_exact(
    pairs: usize,
    sms: usize,
    most: usize,
    rows: usize,
    round_rows: usize,
    exact: usize,
) -> usize {
    let s = splits(pairs, sms, most);
    let rounds = |s: usize| rows.div_ceil(s.max(1) * round_rows.max(1));
    let over = |s: usize| pairs * (s + exact) > sms;
    if s > 1 && over(s) && rounds(s - 1) <= rounds(s) + BLOCK_ROUNDS {
        s - 1
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_scale_rounds_few_levels_nearly_exactly() {
        let err = |levels: &[f32], s: f32| {
            levels
                .iter()
                .map(|&x| ((half::f16::from_f32(x * s).to_f32() - x * s) / (x * s)).abs())
                .fold(0f32, f32::max)
        };
        // 2-bit Lloyd-Max Gaussian levels: two magnitudes.
        let two = [-1.510_418, -0.452_780_7, 0.452_780_7, 1.510_418];
        let s = f16_scale(&two);
        assert!((1.0..2.0).contains(&s));
        assert!(err(&two, s) < 2e-5, "{}", err(&two, s));
        assert!(err(&two, s) <= err(&two, 1.0));
        // More levels: never worse than no scale.
        let many: Vec<f32> = (0..16).map(|i| (i as f32 - 7.5) * 0.3711).collect();
        assert!(err(&many, f16_scale(&many)) <= err(&many, 1.0));
        assert_eq!(f16_scale(&[]), 1.0);
        assert_eq!(f16_scale(&[0.0]), 1.0);
    }

    #[test]
    fn the_exact_block_stays_in_the_wave_where_that_is_cheaper() {
        // Llama-3-8B at batch 1, 32k rows, 16 warps: 16 splits + 8 exact blocks overflow 132
        // SMs by 4; 15 splits cost one round more than 16 (9 against 8): 15.
        assert_eq!(splits_with_exact(8, 132, 255, 32_700, 256, 1), 15);
        // Batch 8: 2 splits (192 blocks) against 1 split (128): 128 rounds instead of 64.
        assert_eq!(splits_with_exact(64, 132, 255, 32_700, 256, 1), 2);
        // Falcon3 at batch 8 (8 warps): 4 splits, not 3 (86 rounds against 64).
        assert_eq!(splits_with_exact(32, 132, 255, 32_700, 128, 1), 4);
        // Short rows: one round either way.
        assert_eq!(splits_with_exact(64, 132, 255, 4_000, 256, 1), 1);
        // No exact block, or a wave with room: unchanged.
        assert_eq!(splits_with_exact(8, 132, 255, 32_700, 256, 0), 16);
        assert_eq!(splits_with_exact(4, 132, 255, 32_700, 256, 1), 32);
    }

    #[test]
    fn splits_fill_one_wave() {
        // Llama-3-8B: 8 kv heads at batch 1, 64 at batch 8; Falcon3-7B: 4 and 32.
        assert_eq!(splits(8, 132, 255), 16);
        assert_eq!(splits(64, 132, 255), 2);
        assert_eq!(splits(4, 132, 255), 33);
        assert_eq!(splits(32, 132, 255), 4);
        // Short rows cap the splits; many pairs take one each.
        assert_eq!(splits(8, 132, 3), 3);
        assert_eq!(splits(1000, 132, 255), 1);
    }

    #[test]
    fn smem_fits_every_instantiated_width() {
        for d in [64, 128, 256] {
            let nw = if d > 128 { 8 } else { 16 };
            for b in 1..=4 {
                let cb = 2 + d * b / 8;
                assert!(
                    smem(d, Tables::scalar(d, (b, b), false), (nw, 3), (cb, cb)) <= MAX_SMEM,
                    "d {d} b {b}"
                );
            }
            // QJL's presets: (sketch m, outliers) at 3 and 4 bits, 2-bit values in groups of 64.
            for (m, o) in [
                (3 * d - d / 8 * 3, 1),
                (4 * d + 8, 4),
                (2 * 4 * d - 5 * d / 2, 4),
            ] {
                let (kcb, vcb) = (2 + m / 8 + 3 * o, 4 * (d / 64) + d / 4);
                let t = Tables::qjl(2, m.div_ceil(64) * 64);
                assert!(
                    smem(d, t, (nw, 3), (kcb, vcb)) <= MAX_SMEM,
                    "qjl d {d} m {m}"
                );
            }
            // VecInfer: per-position codebooks fit up to d = 128, shared ones everywhere; at
            // d = 256 the keys' per-position books alone fit (the `_vg` kernels).
            for sub in [4, 8] {
                let cb = d / sub;
                let shared = smem(d, Tables::books(2 * 256 * sub * 2), (nw, 3), (cb, cb));
                let per_pos = smem(d, Tables::books(2 * d * 512), (nw, 3), (cb, cb));
                let keys_only = smem(d, Tables::books(d * 512), (nw, 3), (cb, cb));
                assert!(shared <= MAX_SMEM, "vq d {d} s {sub} shared");
                assert!(keys_only <= MAX_SMEM, "vq d {d} s {sub} keys' books");
                assert_eq!(
                    per_pos <= MAX_SMEM,
                    d <= 128,
                    "vq d {d} s {sub} per position"
                );
            }
            for (kb, vb) in [(1, 1), (1, 2), (2, 2), (2, 3), (3, 3), (3, 4)] {
                let (kcb, vcb) = (4 + d * kb / 8 + d / 8, 2 + d * vb / 8);
                assert!(
                    smem(d, Tables::scalar(d, (kb, vb), true), (nw, 3), (kcb, vcb)) <= MAX_SMEM,
                    "prod d {d} {kb}/{vb}"
                );
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
        #[test]
        fn balanced_f16_stays_within_one_ulp_and_cancels_the_mean_error(
            books in proptest::collection::vec(-1.5f32..1.5, 2 * 256 * 4),
        ) {
            use half::f16;
            let sub = 4;
            let bal = balanced_f16(&books, sub);
            proptest::prop_assert_eq!(bal.len(), books.len());
            for (x, b) in books.iter().zip(&bal) {
                let near = f16::from_f32(*x);
                let ulp = (next_f16(near, 1).unwrap().to_f32() - near.to_f32())
                    .abs()
                    .max((next_f16(near, -1).unwrap().to_f32() - near.to_f32()).abs());
                proptest::prop_assert!((b.to_f32() - x).abs() <= ulp, "{} -> {}", x, b);
            }
            for b in 0..2 {
                for j in 0..sub {
                    let sum = |v: &dyn Fn(usize) -> f32| -> f64 {
                        (0..256)
                            .map(|c| b * 256 * sub + c * sub + j)
                            .map(|i| f64::from(v(i)) - f64::from(books[i]))
                            .sum()
                    };
                    let s_bal = sum(&|i| bal[i].to_f32()).abs();
                    // Within one ulp of the largest entries (2^-10 below 2).
                    proptest::prop_assert!(s_bal <= 1.0 / 1024.0, "book {} coordinate {}: {}", b, j, s_bal);
                }
            }
        }
    }

    #[test]
    fn balanced_f16_keeps_exact_values_and_finds_neighbours() {
        use half::f16;
        let b = balanced_f16(&[0.5, -0.25, 1.0 / 3.0], 1);
        assert_eq!((b[0].to_f32(), b[1].to_f32()), (0.5, -0.25));
        assert!((b[2].to_f32() - 1.0 / 3.0).abs() < 1e-3);
        assert!(next_f16(f16::MAX, 1).is_some_and(|x| !x.is_finite()));
        assert_eq!(next_f16(f16::from_f32(0.0), -1), Some(-f16::from_bits(1)));
        assert_eq!(
            next_f16(f16::from_f32(1.0), 1).map(f16::to_f32),
            Some(1.0 + 1.0 / 1024.0)
        );
        assert_eq!(
            next_f16(f16::from_f32(-1.0), 1).map(f16::to_f32),
            Some(-1.0 + 1.0 / 2048.0)
        );
    }
}
