//! Seeded Gaussian sign sketches (the QJL transform): a Gaussian matrix `S` (m x d) per layer
//! and kv head, `sign(S x)` packed 8 signs per byte, and the unbiased inner-product estimate
//! `q . x ~ sqrt(pi/2) / m * ||x|| * <S q, sign(S x)>`.
//!
//! The hot loop is the sketch dot `<S q, sign(S x)>` over many packed sign rows for one query.
//! `prepare` turns `sqrt(pi/2)/m * S q` into a per-query table: for each byte position `j` of a
//! sign row, `table[j][b]` is the signed sum of the 8 projections the byte `b` selects, so a row
//! costs one table load and one add per 8 signs ([`SignSketch::dot`]). Matrices are generated
//! once per (seed, m, d) and shared by every cache that uses them (a weak-keyed process table), so
//! sequences do not each hold megabytes of sketch state.

use super::rng::SplitMix;
use crate::{CacheError, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// `sqrt(pi / 2)`: the QJL estimator's constant (E|g| = sqrt(2/pi) for g ~ N(0, 1)).
pub const QJL_CONST: f32 = 1.253_314_1;

/// A seed for one (layer, head) of a method, mixed so that nearby inputs give unrelated streams.
pub fn head_seed(seed: u64, layer: usize, head: usize) -> u64 {
    let mut s = SplitMix::new(seed ^ 0x51_4A4C_0000_0000);
    let a = s.next_u64();
    SplitMix::new(a ^ ((layer as u64) << 20) ^ head as u64).next_u64()
}

/// An m x d matrix S of standard Gaussians, stored transposed (`data[j * m + i] = S[i][j]`): a
/// projection is then d axpys over contiguous columns of length m, which vectorize.
#[derive(Debug)]
struct Matrix {
    data: Vec<f32>,
}

type MatrixKey = (u64, usize, usize);

/// The process-wide table of live sketch matrices, so caches built with the same seed and shape
/// share one copy.
fn matrix(seed: u64, m: usize, d: usize) -> Arc<Matrix> {
    static LIVE: OnceLock<Mutex<HashMap<MatrixKey, Weak<Matrix>>>> = OnceLock::new();
    let live = LIVE.get_or_init(|| Mutex::new(HashMap::new()));
    // A panic elsewhere while holding the lock leaves the map usable: it only holds weak handles.
    let mut map = live.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(found) = map.get(&(seed, m, d)).and_then(Weak::upgrade) {
        return found;
    }
    let fresh = Arc::new(Matrix {
        data: SplitMix::new(seed).gauss_vec(m * d),
    });
    map.retain(|_, w| w.strong_count() > 0);
    map.insert((seed, m, d), Arc::downgrade(&fresh));
    fresh
}

/// Packs the signs of `proj` (bit `i` set when `proj[i] >= 0`), 8 per byte, LSB first.
pub fn pack_signs(proj: &[f32], out: &mut [u8]) {
    for (byte, chunk) in out.iter_mut().zip(proj.chunks(8)) {
        *byte = chunk
            .iter()
            .enumerate()
            .fold(0u8, |b, (i, &x)| b | (u8::from(x >= 0.0) << i));
    }
}

/// The sign (+1 or -1) at index `i` of a packed sign row.
#[inline]
pub fn sign_at(packed: &[u8], i: usize) -> f32 {
    if (packed[i / 8] >> (i % 8)) & 1 == 1 {
        1.0
    } else {
        -1.0
    }
}

/// The 256 signed sums of 8 (scaled) projections: the low and the high 4 give 16 sums each (every
/// entry one add from an earlier one), then entry `b` is `lo[b & 15] + hi[b >> 4]`, written a row
/// of 16 at a time.
fn fill_table(a8: &[f32; 8], t: &mut [f32; 256]) {
    let nibble = |a4: &[f32]| {
        let mut n = [0f32; 16];
        n[0] = -(a4[0] + a4[1] + a4[2] + a4[3]);
        for b in 1..16 {
            n[b] = n[b & (b - 1)] + 2.0 * a4[b.trailing_zeros() as usize];
        }
        n
    };
    let (lo, hi) = (nibble(&a8[..4]), nibble(&a8[4..]));
    let (rows, _) = t.as_chunks_mut::<16>();
    for (row, &h) in rows.iter_mut().zip(&hi) {
        // Each row opaque to the optimizer: otherwise it vectorizes down the columns and writes
        // them with scatters, several times slower than one 16-wide add and store per row.
        let row = std::hint::black_box(row);
        for (x, &l) in row.iter_mut().zip(&lo) {
            *x = l + h;
        }
    }
}

/// The sign sketches of one layer: one Gaussian matrix per kv head.
#[derive(Debug, Clone)]
pub struct SignSketch {
    mats: Vec<Arc<Matrix>>,
    m: usize,
}

impl SignSketch {
    /// Sketch dimension `m` (a positive multiple of 8) for `heads` heads of dimension `d`,
    /// matrices seeded by (`seed`, `layer`, head).
    pub fn new(m: usize, d: usize, heads: usize, layer: usize, seed: u64) -> Result<Self> {
        if m == 0 || !m.is_multiple_of(8) {
            return Err(CacheError::Shape(format!(
                "sketch dimension must be a positive multiple of 8, got {m}"
            )));
        }
        if d == 0 {
            return Err(CacheError::Shape("sketch of a zero head_dim".into()));
        }
        let mats = (0..heads)
            .map(|h| matrix(head_seed(seed, layer, h), m, d))
            .collect();
        Ok(Self { mats, m })
    }

    /// Sketch dimension.
    pub fn m(&self) -> usize {
        self.m
    }

    /// The device description: every head's matrix transposed, `[heads][d][m]`.
    pub fn spec(&self) -> kvq_kernels::spec::SketchSpec {
        kvq_kernels::spec::SketchSpec {
            m: self.m,
            matrices: self
                .mats
                .iter()
                .flat_map(|mat| mat.data.iter().copied())
                .collect(),
        }
    }

    /// Bytes of one packed sign row (`m / 8`).
    pub fn sign_bytes(&self) -> usize {
        self.m / 8
    }

    /// `out = S x` (m values) for kv head `head`.
    pub fn project(&self, head: usize, x: &[f32], out: &mut [f32]) {
        out.fill(0.0);
        for (col, &xj) in self.mats[head].data.chunks_exact(self.m).zip(x) {
            crate::attention::axpy(out, xj, col);
        }
    }

    /// Writes `sign(S x)` packed into `out` (`sign_bytes` bytes).
    pub fn encode(&self, head: usize, x: &[f32], out: &mut [u8]) {
        let mut proj = vec![0f32; self.m];
        self.project(head, x, &mut proj);
        pack_signs(&proj, &mut out[..self.sign_bytes()]);
    }

    /// Length of the per-query table [`prepare`](Self::prepare) fills: 256 per sign byte.
    pub fn table_len(&self) -> usize {
        self.sign_bytes() * 256
    }

    /// Fills `table` for query `q`: with `a = sqrt(pi/2)/m * S q`, `table[j * 256 + b]` is
    /// `sum_i (bit i of b ? a[8j + i] : -a[8j + i])`, so that [`dot`](Self::dot) of a sign row
    /// is `sqrt(pi/2)/m * <S q, sign(S x)>`, the estimate of `q . x / ||x||`.
    pub fn prepare(&self, head: usize, q: &[f32], table: &mut [f32]) {
        let mut a = vec![0f32; self.m];
        self.project(head, q, &mut a);
        let c = QJL_CONST / self.m as f32;
        a.iter_mut().for_each(|x| *x *= c);
        let (tables, _) = table.as_chunks_mut::<256>();
        for (t, a8) in tables.iter_mut().zip(a.as_chunks::<8>().0) {
            fill_table(a8, t);
        }
    }

    /// `sqrt(pi/2)/m * <S q, s>` for the packed sign row `signs`, from `prepare`'s table: one
    /// load and one add per byte, four independent sums.
    #[inline]
    pub fn dot(table: &[f32], signs: &[u8]) -> f32 {
        let (tables, _) = table.as_chunks::<256>();
        let mut acc = [0f32; 4];
        let (t4, t_rest) = tables.as_chunks::<4>();
        let (s4, s_rest) = signs.as_chunks::<4>();
        for (t, s) in t4.iter().zip(s4) {
            for l in 0..4 {
                acc[l] += t[l][s[l] as usize];
            }
        }
        for (t, &s) in t_rest.iter().zip(s_rest) {
            acc[0] += t[s as usize];
        }
        (acc[0] + acc[1]) + (acc[2] + acc[3])
    }

    /// `out += w * sqrt(pi/2)/m * S^T s`: the vector whose inner product with `q` is `w` times
    /// the sketch estimate (references and tests only).
    pub fn decode_add(&self, head: usize, signs: &[u8], w: f32, out: &mut [f32]) {
        let c = w * QJL_CONST / self.m as f32;
        let s: Vec<f32> = (0..self.m).map(|i| c * sign_at(signs, i)).collect();
        for (o, col) in out
            .iter_mut()
            .zip(self.mats[head].data.chunks_exact(self.m))
        {
            *o += crate::attention::dot(col, &s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn signs_round_trip(raw in proptest::collection::vec(-4f32..4.0, 1..200)) {
            let mut packed = vec![0u8; raw.len().div_ceil(8)];
            pack_signs(&raw, &mut packed);
            for (i, &x) in raw.iter().enumerate() {
                prop_assert_eq!(sign_at(&packed, i), if x >= 0.0 { 1.0 } else { -1.0 });
            }
        }

        #[test]
        fn table_dot_equals_the_direct_sum(seed in any::<u64>(), mb in 1usize..24) {
            let (m, d) = (mb * 8, 16);
            let sk = SignSketch::new(m, d, 1, 0, seed).unwrap();
            let mut rng = SplitMix::new(seed ^ 1);
            let (q, x) = (rng.gauss_vec(d), rng.gauss_vec(d));
            let mut signs = vec![0u8; sk.sign_bytes()];
            sk.encode(0, &x, &mut signs);
            let mut table = vec![0f32; sk.table_len()];
            sk.prepare(0, &q, &mut table);
            let fast = SignSketch::dot(&table, &signs);
            let mut sq = vec![0f32; m];
            sk.project(0, &q, &mut sq);
            let direct: f32 = sq.iter().enumerate().map(|(i, a)| a * sign_at(&signs, i)).sum::<f32>()
                * QJL_CONST / m as f32;
            prop_assert!((fast - direct).abs() <= 1e-4 * (1.0 + direct.abs()), "{} {}", fast, direct);
            let mut dec = vec![0f32; d];
            sk.decode_add(0, &signs, 1.0, &mut dec);
            let via_decode: f32 = q.iter().zip(&dec).map(|(a, b)| a * b).sum();
            prop_assert!((via_decode - direct).abs() <= 1e-4 * (1.0 + direct.abs()));
        }
    }

    #[test]
    fn matrices_are_shared_and_seeded() {
        let a = SignSketch::new(64, 32, 2, 3, 9).unwrap();
        let b = SignSketch::new(64, 32, 2, 3, 9).unwrap();
        assert!(Arc::ptr_eq(&a.mats[1], &b.mats[1]));
        assert!(!Arc::ptr_eq(&a.mats[0], &a.mats[1]));
        let c = SignSketch::new(64, 32, 2, 4, 9).unwrap();
        assert_ne!(a.mats[0].data, c.mats[0].data);
        assert!(SignSketch::new(12, 32, 1, 0, 0).is_err());
    }
}
