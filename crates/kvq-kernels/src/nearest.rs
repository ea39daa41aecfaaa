//! Fused nearest-centroid search: for each sub-vector `x[i]` (`[N, sub]` f32) the index of the
//! closest row of a codebook (`[C, sub]` f32) by squared Euclidean distance, as `[N]` u32.
//!
//! The fused path never builds the `[N, C, sub]` difference tensor the seed's `quantize_vq`
//! materialized (the Falcon3 OOM): the codebook is transposed once into blocks of [`LANES`]
//! centroids, and each sub-vector's distances to a block are accumulated in a few vector
//! registers, keeping a running (distance, index) minimum per lane. Memory is O(N + C * sub).
//! [`nearest_centroid_reference`] is that materializing formulation, kept for tests and as the
//! benchmark baseline. Ties go to the lowest index in both.

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

/// Centroids scored together (one 512-bit or two 256-bit vectors of f32).
pub const LANES: usize = 16;

/// Rows per parallel task (large enough that spawning costs nothing next to the scan).
const ROWS_PER_TASK: usize = 1024;

/// A codebook laid out for the fused search: blocks of [`LANES`] centroids, each block stored
/// as `[sub][LANES]` (coordinate-major), padded with `+inf` centroids that never win.
#[derive(Debug, Clone)]
pub struct NearestCodebook {
    sub: usize,
    n: usize,
    blocks: usize,
    cols: Vec<f32>,
}

impl NearestCodebook {
    /// Prepares `codebook` (`[C, sub]` row-major, C >= 1).
    pub fn new(codebook: &[f32], sub: usize) -> Result<Self> {
        if sub == 0 || codebook.is_empty() || !codebook.len().is_multiple_of(sub) {
            bail!(
                "nearest-centroid: a codebook of {} values is not [C, {sub}] with C >= 1",
                codebook.len()
            )
        }
        let n = codebook.len() / sub;
        if u32::try_from(n).is_err() {
            bail!("nearest-centroid: {n} centroids do not fit u32 indices")
        }
        let blocks = n.div_ceil(LANES);
        let mut cols = vec![f32::INFINITY; blocks * sub * LANES];
        for (c, row) in codebook.chunks_exact(sub).enumerate() {
            let (b, l) = (c / LANES, c % LANES);
            for (i, &v) in row.iter().enumerate() {
                cols[(b * sub + i) * LANES + l] = v;
            }
        }
        Ok(Self {
            sub,
            n,
            blocks,
            cols,
        })
    }

    /// Dimension of a sub-vector.
    pub fn sub_dim(&self) -> usize {
        self.sub
    }

    /// Number of centroids.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Always false: a codebook has at least one centroid.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Index and squared distance of the centroid nearest to `x` (`sub` values).
    #[inline]
    pub fn nearest(&self, x: &[f32]) -> (u32, f32) {
        match self.sub {
            4 => scan::<4>(&self.cols, self.blocks, x),
            8 => scan::<8>(&self.cols, self.blocks, x),
            2 => scan::<2>(&self.cols, self.blocks, x),
            1 => scan::<1>(&self.cols, self.blocks, x),
            16 => scan::<16>(&self.cols, self.blocks, x),
            _ => scan_dyn(&self.cols, self.blocks, self.sub, x),
        }
    }

    /// Nearest centroid of each `sub`-value row of `x`, on the calling thread. `idx` gets one
    /// index per row; `dist`, when given, the squared distances.
    pub fn assign(&self, x: &[f32], idx: &mut [u32], dist: Option<&mut [f32]>) {
        match dist {
            Some(dist) => {
                let rows = x.chunks_exact(self.sub).zip(idx.iter_mut());
                for ((row, i), d) in rows.zip(dist.iter_mut()) {
                    (*i, *d) = self.nearest(row);
                }
            }
            None => {
                for (row, i) in x.chunks_exact(self.sub).zip(idx.iter_mut()) {
                    *i = self.nearest(row).0;
                }
            }
        }
    }

    /// [`assign`](Self::assign) over rayon's pool, rows split into fixed blocks (the result
    /// does not depend on the thread count).
    pub fn assign_par(&self, x: &[f32], idx: &mut [u32], dist: Option<&mut [f32]>) {
        let rows = x.len() / self.sub;
        if rows < 2 * ROWS_PER_TASK {
            return self.assign(x, idx, dist);
        }
        let xs = x.par_chunks(ROWS_PER_TASK * self.sub);
        let is = idx[..rows].par_chunks_mut(ROWS_PER_TASK);
        match dist {
            Some(dist) => xs
                .zip(is)
                .zip(dist[..rows].par_chunks_mut(ROWS_PER_TASK))
                .for_each(|((x, i), d)| self.assign(x, i, Some(d))),
            None => xs.zip(is).for_each(|(x, i)| self.assign(x, i, None)),
        }
    }
}

/// The register-resident scan for a sub-vector of `S` values: per lane a running minimum over
/// the blocks, then the lowest-index minimum over the lanes.
#[inline(always)]
fn scan<const S: usize>(cols: &[f32], blocks: usize, x: &[f32]) -> (u32, f32) {
    let mut xs = [0f32; S];
    xs.copy_from_slice(&x[..S]);
    let mut best = [f32::INFINITY; LANES];
    let mut arg = [0u32; LANES];
    for (b, block) in cols.chunks_exact(S * LANES).take(blocks).enumerate() {
        let mut d = [0f32; LANES];
        for (i, &xi) in xs.iter().enumerate() {
            let col = &block[i * LANES..(i + 1) * LANES];
            for l in 0..LANES {
                let t = xi - col[l];
                d[l] += t * t;
            }
        }
        let base = (b * LANES) as u32;
        for l in 0..LANES {
            let better = d[l] < best[l];
            best[l] = if better { d[l] } else { best[l] };
            arg[l] = if better { base + l as u32 } else { arg[l] };
        }
    }
    reduce_lanes(&best, &arg)
}

/// The same scan for any sub-vector length.
fn scan_dyn(cols: &[f32], blocks: usize, sub: usize, x: &[f32]) -> (u32, f32) {
    let mut best = [f32::INFINITY; LANES];
    let mut arg = [0u32; LANES];
    for (b, block) in cols.chunks_exact(sub * LANES).take(blocks).enumerate() {
        let mut d = [0f32; LANES];
        for (i, &xi) in x[..sub].iter().enumerate() {
            let col = &block[i * LANES..(i + 1) * LANES];
            for l in 0..LANES {
                let t = xi - col[l];
                d[l] += t * t;
            }
        }
        for l in 0..LANES {
            if d[l] < best[l] {
                best[l] = d[l];
                arg[l] = (b * LANES + l) as u32;
            }
        }
    }
    reduce_lanes(&best, &arg)
}

#[inline(always)]
fn reduce_lanes(best: &[f32; LANES], arg: &[u32; LANES]) -> (u32, f32) {
    let mut k = 0;
    for l in 1..LANES {
        if best[l] < best[k] || (best[l] == best[k] && arg[l] < arg[k]) {
            k = l;
        }
    }
    (arg[k], best[k])
}

/// A contiguous f32 `[rows, width]` slice of a storage.
fn f32_matrix<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<(&'a [f32], usize)> {
    let CpuStorage::F32(data) = s else {
        bail!("nearest-centroid: {what} must be f32")
    };
    let &[_, width] = l.dims() else {
        bail!(
            "nearest-centroid: {what} must be rank 2, got {:?}",
            l.dims()
        )
    };
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("nearest-centroid: {what} must be contiguous")
    };
    Ok((&data[start..end], width))
}

struct NearestOp;

impl CustomOp2 for NearestOp {
    fn name(&self) -> &'static str {
        "kvq-nearest-centroid"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, sub) = f32_matrix(s1, l1, "x")?;
        let (cb, cb_sub) = f32_matrix(s2, l2, "codebook")?;
        if sub != cb_sub {
            bail!("nearest-centroid: sub-vectors of {sub} values, centroids of {cb_sub}")
        }
        let n = l1.dims()[0];
        let book = NearestCodebook::new(cb, sub)?;
        let mut out = vec![0u32; n];
        book.assign_par(x, &mut out, None);
        Ok((CpuStorage::U32(out), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::ops::nearest_fwd(s1, l1, s2, l2)
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        s1: &candle_core::MetalStorage,
        l1: &Layout,
        s2: &candle_core::MetalStorage,
        l2: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        crate::metal::ops::nearest_fwd(s1, l1, s2, l2)
    }
}

/// Fused nearest-centroid argmin: `x` `[N, sub]` f32, `codebook` `[C, sub]` f32 (both
/// contiguous) to `[N]` u32 indices, multithreaded, without a `[N, C, sub]` intermediate.
pub fn nearest_centroid(x: &Tensor, codebook: &Tensor) -> Result<Tensor> {
    x.apply_op2_no_bwd(codebook, &NearestOp)
}

/// The seed's materializing formulation, the baseline the fused op is tested and measured
/// against: `diff = x[:, None, :] - codebook[None, :, :]` (`[N, C, sub]`), squared, summed over
/// `sub`, argmin over `C`.
pub fn nearest_centroid_reference(x: &Tensor, codebook: &Tensor) -> Result<Tensor> {
    let diff = x.unsqueeze(1)?.broadcast_sub(&codebook.unsqueeze(0)?)?;
    diff.sqr()?.sum(2)?.argmin(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn uniform(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Same indices as the materializing reference, except where the two distances tie exactly
    /// (then both are minima, checked in f64).
    fn check(n: usize, c: usize, sub: usize) {
        let dev = Device::Cpu;
        let x = uniform(n * sub, 1 + sub as u64);
        let cb = uniform(c * sub, 2 + c as u64);
        let xt = Tensor::from_vec(x.clone(), (n, sub), &dev).unwrap();
        let ct = Tensor::from_vec(cb.clone(), (c, sub), &dev).unwrap();
        let got = nearest_centroid(&xt, &ct)
            .unwrap()
            .to_vec1::<u32>()
            .unwrap();
        let want = nearest_centroid_reference(&xt, &ct)
            .unwrap()
            .to_vec1::<u32>()
            .unwrap();
        let d2 = |i: usize, k: u32| -> f64 {
            let k = k as usize;
            (0..sub)
                .map(|j| (x[i * sub + j] as f64 - cb[k * sub + j] as f64).powi(2))
                .sum()
        };
        let mut differ = 0;
        for i in 0..n {
            if got[i] != want[i] {
                differ += 1;
                let (a, b) = (d2(i, got[i]), d2(i, want[i]));
                assert!(
                    (a - b).abs() <= 1e-6 * a.max(b).max(1e-12),
                    "row {i}: {} at {a} vs {} at {b}",
                    got[i],
                    want[i]
                );
            }
        }
        assert!(differ * 1000 <= n, "{differ} of {n} indices differ");
    }

    #[test]
    fn matches_the_materializing_reference() {
        check(5000, 256, 4);
        check(3000, 256, 8);
        check(700, 37, 3);
        check(64, 1, 4);
        check(2100, 100, 16);
    }

    #[test]
    fn ties_go_to_the_lowest_index() {
        // Centroids 3 and 20 (different lanes and blocks) are equally near.
        let mut cb = vec![10f32; 32 * 4];
        cb[3 * 4..4 * 4].copy_from_slice(&[1.0, 0.0, 0.0, 0.0]);
        cb[20 * 4..21 * 4].copy_from_slice(&[-1.0, 0.0, 0.0, 0.0]);
        let book = NearestCodebook::new(&cb, 4).unwrap();
        assert_eq!(book.nearest(&[0.0; 4]), (3, 1.0));
    }

    #[test]
    fn parallel_and_serial_agree_with_distances() {
        let (n, sub) = (10_000, 4);
        let x = uniform(n * sub, 9);
        let book = NearestCodebook::new(&uniform(256 * sub, 10), sub).unwrap();
        let (mut a, mut b) = (vec![0u32; n], vec![0u32; n]);
        let (mut da, mut db) = (vec![0f32; n], vec![0f32; n]);
        book.assign(&x, &mut a, Some(&mut da));
        book.assign_par(&x, &mut b, Some(&mut db));
        assert_eq!(a, b);
        assert_eq!(da, db);
    }

    #[test]
    fn bad_shapes_are_errors() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((4, 4), candle_core::DType::F32, &dev).unwrap();
        let c = Tensor::zeros((8, 8), candle_core::DType::F32, &dev).unwrap();
        assert!(nearest_centroid(&x, &c).is_err());
        assert!(NearestCodebook::new(&[], 4).is_err());
    }
}
