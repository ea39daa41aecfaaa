//! VecInfer's key and value codecs. A key `k` of kv head `h` is smoothed per channel
//! (`k / lambda`), rotated by the seeded randomized Hadamard of (layer, head) and split into
//! sub-vectors of `sub` values, each stored as the 8-bit index of its nearest centroid among
//! the 256 of its sub-position's codebook (see [`Books`]). A query is mapped the other way
//! (`q * lambda`, same rotation), so `q' . k' = q . k`, and `prepare` turns it into a lookup
//! table `LUT[s][c] = q'_s . c`: scoring a key is `d / sub` table lookups. Values are rotated
//! (no smoothing) and coded the same way with their own codebooks; attention accumulates them
//! per code (see [`ValueAccum`]) and rotates back once per query row.

use crate::attention::{axpy, dot};
use crate::codec::hadamard::Rotation;
use crate::compressed::{KernelKind, KeyCodec, ValueCodec};
use crate::{CacheError, Result};
use kvq_kernels::spec::{KeySpec, ValueSpec, VqSpec};
use kvq_kernels::{KernelData, NearestCodebook};
use std::sync::OnceLock;

/// Centroids per codebook: indices are one byte.
pub const CENTROIDS: usize = 256;

/// The rotation seed of kv head `head` of `layer` for keys (`values = false`) or values.
pub fn rotation_seed(seed: u64, layer: usize, head: usize, values: bool) -> u64 {
    let base = if values { seed ^ 0xA5A5 } else { seed };
    base ^ ((layer as u64) << 32) ^ (head as u64 + 1)
}

/// The rotations of one layer's kv heads.
pub fn rotations(d: usize, heads: usize, layer: usize, seed: u64, values: bool) -> Vec<Rotation> {
    (0..heads)
        .map(|h| Rotation::new(d, rotation_seed(seed, layer, h, values)))
        .collect()
}

fn check_dims(d: usize, sub: usize) -> Result<()> {
    if !d.is_power_of_two() || sub == 0 || !d.is_multiple_of(sub) {
        return Err(CacheError::Shape(format!(
            "vecinfer needs a power-of-two head_dim divisible by sub_dim; got {d} and {sub}"
        )));
    }
    Ok(())
}

/// Checks a `[heads * d]` per-channel table; returns `heads`.
fn check_heads(x: &[f32], d: usize, what: &str) -> Result<usize> {
    if x.is_empty() || !x.len().is_multiple_of(d) {
        return Err(CacheError::Calibration(format!(
            "{} {what} are not [heads, {d}]",
            x.len()
        )));
    }
    if let Some(bad) = x.iter().find(|v| !v.is_finite()) {
        return Err(CacheError::Calibration(format!(
            "{what}: {bad} is not finite"
        )));
    }
    Ok(x.len() / d)
}

/// A layer's codebooks for keys or values: one shared by every sub-position (`[256, sub]`), or
/// one per sub-position (`[d / sub, 256, sub]`).
pub struct Books {
    sub: usize,
    data: Vec<f32>,
    /// The same codebooks coordinate-major (`[n][sub][256]`): query tables and histogram
    /// decoding then run as 256-wide vector loops.
    by_coord: Vec<f32>,
    nearest: Vec<NearestCodebook>,
}

impl Books {
    /// `data`: `[n, 256, sub]` with n = 1 or `d / sub`.
    pub fn new(d: usize, sub: usize, data: &[f32]) -> Result<Self> {
        check_dims(d, sub)?;
        let n_sub = d / sub;
        let one = CENTROIDS * sub;
        if data.len() != one && data.len() != n_sub * one {
            return Err(CacheError::Calibration(format!(
                "codebooks of {} values are neither [{CENTROIDS}, {sub}] nor [{n_sub}, {CENTROIDS}, {sub}]",
                data.len()
            )));
        }
        let nearest = data
            .chunks_exact(one)
            .map(|b| NearestCodebook::new(b, sub))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let mut by_coord = vec![0f32; data.len()];
        for (book, t) in data.chunks_exact(one).zip(by_coord.chunks_exact_mut(one)) {
            for (c, centroid) in book.chunks_exact(sub).enumerate() {
                for (j, &x) in centroid.iter().enumerate() {
                    t[j * CENTROIDS + c] = x;
                }
            }
        }
        Ok(Self {
            sub,
            data: data.to_vec(),
            by_coord,
            nearest,
        })
    }

    /// Sub-position `pos`'s codebook coordinate-major: `[sub][256]`.
    #[inline]
    fn by_coord(&self, pos: usize) -> &[f32] {
        let one = CENTROIDS * self.sub;
        let b = self.book(pos);
        &self.by_coord[b * one..(b + 1) * one]
    }

    /// `lut[c] = q . centroid c` of sub-position `pos` for all 256 centroids (`q`: `sub` values).
    fn table(&self, pos: usize, q: &[f32], lut: &mut [f32]) {
        lut.fill(0.0);
        for (&qj, coord) in q.iter().zip(self.by_coord(pos).chunks_exact(CENTROIDS)) {
            axpy(lut, qj, coord);
        }
    }

    /// `out += sum_c w[c] * centroid c` of sub-position `pos` (`out`: `sub` values).
    fn weighted_sum(&self, pos: usize, w: &[f32], out: &mut [f32]) {
        if w.iter().all(|&x| x == 0.0) {
            return; // gathered instead (a short run), or no compressed positions
        }
        for (o, coord) in out
            .iter_mut()
            .zip(self.by_coord(pos).chunks_exact(CENTROIDS))
        {
            *o += dot(w, coord);
        }
    }

    /// Which codebook sub-position `pos` uses.
    #[inline]
    fn book(&self, pos: usize) -> usize {
        if self.nearest.len() == 1 { 0 } else { pos }
    }

    /// The 256 centroids (`[256 * sub]`) sub-position `pos` is coded with.
    #[inline]
    pub fn centroids(&self, pos: usize) -> &[f32] {
        let one = CENTROIDS * self.sub;
        let b = self.book(pos);
        &self.data[b * one..(b + 1) * one]
    }

    /// Codes `u` (already transformed), one byte per sub-vector.
    fn encode(&self, u: &[f32], out: &mut [u8]) {
        for (pos, (o, x)) in out.iter_mut().zip(u.chunks_exact(self.sub)).enumerate() {
            // Indices are below CENTROIDS = 256.
            *o = self.nearest[self.book(pos)].nearest(x).0 as u8;
        }
    }

    /// The centroids of `code` (transformed domain).
    fn decode(&self, code: &[u8], out: &mut [f32]) {
        let sub = self.sub;
        for (pos, (o, &c)) in out.chunks_exact_mut(sub).zip(code).enumerate() {
            let c = c as usize;
            o.copy_from_slice(&self.centroids(pos)[c * sub..(c + 1) * sub]);
        }
    }
}

/// One layer's key codec.
pub struct VqKeyCodec {
    d: usize,
    sub: usize,
    /// `[heads][d]` smoothing factors and their inverses.
    lambda: Vec<f32>,
    inv_lambda: Vec<f32>,
    rotations: Vec<Rotation>,
    books: Books,
    data: OnceLock<KernelData<KeySpec>>,
}

fn signs_of(rotations: &[Rotation]) -> Vec<f32> {
    rotations
        .iter()
        .flat_map(|r| r.signs().iter().copied())
        .collect()
}

impl VqKeyCodec {
    /// `lambda`: `[heads * d]` smoothing factors (positive); `book`: see [`Books::new`].
    pub fn new(
        d: usize,
        sub: usize,
        layer: usize,
        seed: u64,
        lambda: &[f32],
        book: &[f32],
    ) -> Result<Self> {
        let books = Books::new(d, sub, book)?;
        check_heads(lambda, d, "smoothing factors")?;
        if let Some(bad) = lambda.iter().find(|l| !(l.is_finite() && **l > 0.0)) {
            return Err(CacheError::Calibration(format!(
                "smoothing factor {bad} is not positive and finite"
            )));
        }
        let heads = lambda.len() / d;
        Ok(Self {
            d,
            sub,
            inv_lambda: lambda.iter().map(|l| 1.0 / l).collect(),
            lambda: lambda.to_vec(),
            rotations: rotations(d, heads, layer, seed, false),
            books,
            data: OnceLock::new(),
        })
    }

    /// `k / lambda`, rotated: the vector whose sub-vectors are coded.
    pub fn transform(&self, head: usize, k: &[f32], out: &mut [f32]) {
        let il = &self.inv_lambda[head * self.d..(head + 1) * self.d];
        for ((o, &x), &l) in out.iter_mut().zip(k).zip(il) {
            *o = x * l;
        }
        self.rotations[head].apply(out);
    }

    fn n_sub(&self) -> usize {
        self.d / self.sub
    }
}

impl KeyCodec for VqKeyCodec {
    fn head_dim(&self) -> usize {
        self.d
    }

    fn code_bytes(&self) -> usize {
        self.n_sub()
    }

    fn encode(&self, head: usize, k: &[f32], out: &mut [u8]) {
        let mut u = vec![0f32; self.d];
        self.transform(head, k, &mut u);
        self.books.encode(&u, out);
    }

    fn decode(&self, head: usize, code: &[u8], out: &mut [f32]) {
        self.books.decode(code, out);
        self.rotations[head].invert(out);
        let l = &self.lambda[head * self.d..(head + 1) * self.d];
        out.iter_mut().zip(l).for_each(|(o, l)| *o *= l);
    }

    /// A lookup table per sub-position.
    fn state_len(&self) -> usize {
        self.n_sub() * CENTROIDS
    }

    fn prepare(&self, head: usize, q: &[f32], state: &mut [f32]) {
        let l = &self.lambda[head * self.d..(head + 1) * self.d];
        let mut u: Vec<f32> = q.iter().zip(l).map(|(q, l)| q * l).collect();
        self.rotations[head].apply(&mut u);
        let luts = state
            .chunks_exact_mut(CENTROIDS)
            .zip(u.chunks_exact(self.sub));
        for (pos, (lut, qs)) in luts.enumerate() {
            self.books.table(pos, qs, lut);
        }
    }

    fn scores(&self, _head: usize, state: &[f32], codes: &[u8], out: &mut [f32]) {
        let ns = self.n_sub();
        let luts: Vec<&[f32; CENTROIDS]> = state
            .chunks_exact(CENTROIDS)
            .filter_map(|c| c.try_into().ok())
            .collect();
        for (s, code) in out.iter_mut().zip(codes.chunks_exact(ns)) {
            // Two partial sums: more independent loads in flight.
            let (mut a, mut b) = (0f32, 0f32);
            let mut pairs = code.chunks_exact(2).zip(luts.chunks_exact(2));
            for (c, l) in pairs.by_ref() {
                a += l[0][c[0] as usize];
                b += l[1][c[1] as usize];
            }
            if ns % 2 == 1 {
                a += luts[ns - 1][code[ns - 1] as usize];
            }
            *s = a + b;
        }
    }

    fn kernel(&self) -> KernelKind {
        KernelKind::ProductVq
    }

    fn kernel_data(&self) -> Option<&KernelData<KeySpec>> {
        Some(self.data.get_or_init(|| {
            KernelData::new(KeySpec::ProductVq(VqSpec {
                sub: self.sub,
                books: self.books.data.clone(),
                signs: signs_of(&self.rotations),
                lambda: self.lambda.clone(),
            }))
        }))
    }
}

/// How `accumulate` adds probability-weighted values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueAccum {
    /// Gather each code's centroids and add them (`d` multiply-adds per position).
    Gather,
    /// Add each probability to a histogram bin per (sub-position, centroid) (`d / sub` adds
    /// per position) and decode the histogram once in `finish` (`256 * d` multiply-adds).
    Histogram,
    /// Histogram for runs of at least this many positions, gather for shorter ones.
    Auto(usize),
}

/// One layer's value codec.
pub struct VqValueCodec {
    d: usize,
    sub: usize,
    rotations: Vec<Rotation>,
    books: Books,
    accum: ValueAccum,
    data: OnceLock<KernelData<ValueSpec>>,
}

impl VqValueCodec {
    /// `heads` kv heads; `book`: see [`Books::new`].
    pub fn new(
        d: usize,
        sub: usize,
        layer: usize,
        seed: u64,
        heads: usize,
        book: &[f32],
        accum: ValueAccum,
    ) -> Result<Self> {
        let books = Books::new(d, sub, book)?;
        Ok(Self {
            d,
            sub,
            rotations: rotations(d, heads, layer, seed, true),
            books,
            accum,
            data: OnceLock::new(),
        })
    }

    /// The rotated value whose sub-vectors are coded.
    pub fn transform(&self, head: usize, v: &[f32], out: &mut [f32]) {
        out.copy_from_slice(v);
        self.rotations[head].apply(out);
    }

    fn n_sub(&self) -> usize {
        self.d / self.sub
    }
}

impl ValueCodec for VqValueCodec {
    fn head_dim(&self) -> usize {
        self.d
    }

    fn code_bytes(&self) -> usize {
        self.n_sub()
    }

    fn encode(&self, head: usize, v: &[f32], out: &mut [u8]) {
        let mut u = vec![0f32; self.d];
        self.transform(head, v, &mut u);
        self.books.encode(&u, out);
    }

    fn decode(&self, head: usize, code: &[u8], out: &mut [f32]) {
        self.books.decode(code, out);
        self.rotations[head].invert(out);
    }

    /// `[d]` gathered sums, then `[d / sub][256]` histogram bins.
    fn acc_len(&self) -> usize {
        self.d + self.n_sub() * CENTROIDS
    }

    fn accumulate(&self, _head: usize, probs: &[f32], codes: &[u8], acc: &mut [f32]) {
        let (ns, sub) = (self.n_sub(), self.sub);
        let histogram = match self.accum {
            ValueAccum::Gather => false,
            ValueAccum::Histogram => true,
            ValueAccum::Auto(min) => probs.len() >= min,
        };
        let (direct, hist) = acc.split_at_mut(self.d);
        if histogram {
            let mut bins: Vec<&mut [f32; CENTROIDS]> = hist
                .chunks_exact_mut(CENTROIDS)
                .filter_map(|c| c.try_into().ok())
                .collect();
            for (&p, code) in probs.iter().zip(codes.chunks_exact(ns)) {
                for (bin, &c) in bins.iter_mut().zip(code) {
                    bin[c as usize] += p;
                }
            }
        } else {
            let books: Vec<&[f32]> = (0..ns).map(|pos| self.books.centroids(pos)).collect();
            for (&p, code) in probs.iter().zip(codes.chunks_exact(ns)) {
                for ((a, &c), book) in direct.chunks_exact_mut(sub).zip(code).zip(&books) {
                    let c = c as usize;
                    for (x, y) in a.iter_mut().zip(&book[c * sub..(c + 1) * sub]) {
                        *x += p * y;
                    }
                }
            }
        }
    }

    fn finish(&self, head: usize, acc: &[f32], out: &mut [f32]) {
        let sub = self.sub;
        let (direct, hist) = acc.split_at(self.d);
        out.copy_from_slice(direct);
        let rows = out.chunks_exact_mut(sub).zip(hist.chunks_exact(CENTROIDS));
        for (pos, (o, bins)) in rows.enumerate() {
            self.books.weighted_sum(pos, bins, o);
        }
        self.rotations[head].invert(out);
    }

    fn kernel(&self) -> KernelKind {
        KernelKind::ProductVq
    }

    fn kernel_data(&self) -> Option<&KernelData<ValueSpec>> {
        Some(self.data.get_or_init(|| {
            KernelData::new(ValueSpec::ProductVq(VqSpec {
                sub: self.sub,
                books: self.books.data.clone(),
                signs: signs_of(&self.rotations),
                lambda: Vec::new(),
            }))
        }))
    }
}
