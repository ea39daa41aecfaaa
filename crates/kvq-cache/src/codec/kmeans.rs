//! k-means for product-VQ codebooks (VecInfer): k-means++ seeding, Lloyd iterations whose
//! assignment step is the fused nearest-centroid search of kvq-kernels (parallel, no
//! `[N, k, dim]` intermediate), empty clusters re-seeded from the worst-fit points, and
//! subsampling of large inputs. Deterministic given the seed: the parallel assignment writes
//! per-point results and every reduction runs in a fixed order.

use super::rng::SplitMix;
use crate::{CacheError, Result};
use kvq_kernels::NearestCodebook;

/// How to run k-means.
#[derive(Debug, Clone, PartialEq)]
pub struct KMeansConfig {
    /// Number of centroids.
    pub k: usize,
    /// Most Lloyd iterations.
    pub iters: usize,
    /// Inputs with more points are subsampled (without replacement) to this many.
    pub max_samples: usize,
    /// Seed of the subsample and of the k-means++ draws.
    pub seed: u64,
    /// Stop when an iteration lowers the mean squared distance by less than this fraction.
    pub tol: f64,
}

impl Default for KMeansConfig {
    fn default() -> Self {
        Self {
            k: 256,
            iters: 25,
            max_samples: 65_536,
            seed: 0x6b6d_6561_6e73,
            tol: 1e-4,
        }
    }
}

/// A trained codebook.
#[derive(Debug, Clone, PartialEq)]
pub struct KMeans {
    /// `[k, dim]` row-major.
    pub centroids: Vec<f32>,
    /// Dimension of a point.
    pub dim: usize,
    /// Mean squared distance of the (sampled) points to their centroid at the last assignment.
    pub mse: f64,
    /// Lloyd iterations run.
    pub iterations: usize,
}

/// `count` distinct indices of `0..n`, ascending (a partial Fisher-Yates shuffle).
pub fn sample_indices(n: usize, count: usize, rng: &mut SplitMix) -> Vec<usize> {
    let count = count.min(n);
    let mut all: Vec<usize> = (0..n).collect();
    for i in 0..count {
        let j = i + rng.below(n - i);
        all.swap(i, j);
    }
    all.truncate(count);
    all.sort_unstable();
    all
}

/// k-means++ seeding: the first centroid uniformly, each next one with probability
/// proportional to the squared distance to the nearest centroid chosen so far. The points are
/// transposed once (`[dim][n]`) so each distance update is a vectorized pass over all points
/// that also sums the new weights.
fn seed_plus_plus(pts: &[f32], dim: usize, k: usize, rng: &mut SplitMix) -> Vec<f32> {
    let n = pts.len() / dim;
    let point = |i: usize| &pts[i * dim..(i + 1) * dim];
    let mut cols = vec![0f32; dim * n];
    for (i, p) in pts.chunks_exact(dim).enumerate() {
        for (j, &v) in p.iter().enumerate() {
            cols[j * n + i] = v;
        }
    }
    let mut centroids = Vec::with_capacity(k * dim);
    let mut d2 = vec![f32::INFINITY; n];
    let mut scratch = vec![0f32; n];
    let mut pick = rng.below(n);
    for chosen in 0..k {
        let c = point(pick).to_vec();
        centroids.extend_from_slice(&c);
        if chosen + 1 == k {
            break;
        }
        // scratch = |x - c|^2 for every point, column by column.
        scratch.fill(0.0);
        for (col, &cj) in cols.chunks_exact(n).zip(&c) {
            for (s, &x) in scratch.iter_mut().zip(col) {
                let t = x - cj;
                *s += t * t;
            }
        }
        let mut total = 0f64;
        for (d, &s) in d2.iter_mut().zip(&scratch) {
            *d = d.min(s);
            total += *d as f64;
        }
        pick = if total > 0.0 {
            let mut r = rng.uniform() * total;
            let mut at = n - 1;
            for (i, &d) in d2.iter().enumerate() {
                r -= d as f64;
                if r < 0.0 && d > 0.0 {
                    at = i;
                    break;
                }
            }
            at
        } else {
            // Every point sits on a centroid already: duplicates are all that is left.
            rng.below(n)
        };
    }
    centroids
}

/// Runs k-means on the `data.len() / dim` points of `data` (row-major).
pub fn kmeans(data: &[f32], dim: usize, cfg: &KMeansConfig) -> Result<KMeans> {
    if dim == 0 || data.is_empty() || !data.len().is_multiple_of(dim) {
        return Err(CacheError::Shape(format!(
            "k-means: {} values are not a non-empty set of {dim}-dimensional points",
            data.len()
        )));
    }
    if cfg.k == 0 {
        return Err(CacheError::Shape("k-means: k must be at least 1".into()));
    }
    if let Some(bad) = data.iter().find(|v| !v.is_finite()) {
        return Err(CacheError::Shape(format!(
            "k-means: the data holds a non-finite value ({bad})"
        )));
    }
    let mut rng = SplitMix::new(cfg.seed);
    let n_all = data.len() / dim;
    let sampled;
    let pts: &[f32] = if n_all > cfg.max_samples.max(cfg.k) {
        let idx = sample_indices(n_all, cfg.max_samples.max(cfg.k), &mut rng);
        sampled = idx
            .iter()
            .flat_map(|&i| data[i * dim..(i + 1) * dim].iter().copied())
            .collect::<Vec<f32>>();
        &sampled
    } else {
        data
    };
    let n = pts.len() / dim;
    let k = cfg.k;
    let mut centroids = seed_plus_plus(pts, dim, k, &mut rng);
    let mut assign = vec![0u32; n];
    let mut dist = vec![0f32; n];
    let mut mse = f64::INFINITY;
    let mut iterations = 0;
    let mut sums = vec![0f64; k * dim];
    let mut counts = vec![0usize; k];
    for _ in 0..cfg.iters.max(1) {
        let book = NearestCodebook::new(&centroids, dim)?;
        book.assign_par(pts, &mut assign, Some(&mut dist));
        let new_mse = dist.iter().map(|&d| d as f64).sum::<f64>() / n as f64;
        iterations += 1;
        let converged = mse.is_finite() && mse - new_mse <= cfg.tol * mse;
        mse = new_mse;
        if converged {
            break;
        }
        sums.fill(0.0);
        counts.fill(0);
        for (p, &c) in pts.chunks_exact(dim).zip(&assign) {
            let c = c as usize;
            counts[c] += 1;
            for (s, &v) in sums[c * dim..(c + 1) * dim].iter_mut().zip(p) {
                *s += v as f64;
            }
        }
        for c in 0..k {
            if counts[c] > 0 {
                let inv = 1.0 / counts[c] as f64;
                for (o, s) in centroids[c * dim..(c + 1) * dim]
                    .iter_mut()
                    .zip(&sums[c * dim..(c + 1) * dim])
                {
                    *o = (s * inv) as f32;
                }
            }
        }
        reseed_empty(pts, dim, &counts, &dist, &mut centroids);
    }
    Ok(KMeans {
        centroids,
        dim,
        mse,
        iterations,
    })
}

/// Moves each empty cluster's centroid onto one of the points farthest from their centroid
/// (largest distance first, ties by index), so every centroid stays in use.
fn reseed_empty(pts: &[f32], dim: usize, counts: &[usize], dist: &[f32], centroids: &mut [f32]) {
    let empty: Vec<usize> = (0..counts.len()).filter(|&c| counts[c] == 0).collect();
    if empty.is_empty() {
        return;
    }
    let mut order: Vec<usize> = (0..dist.len()).collect();
    order.sort_by(|&a, &b| dist[b].total_cmp(&dist[a]).then(a.cmp(&b)));
    for (&c, &p) in empty.iter().zip(order.iter().cycle()) {
        centroids[c * dim..(c + 1) * dim].copy_from_slice(&pts[p * dim..(p + 1) * dim]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dist2(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum()
    }

    /// `per` points around each of `centers` (`[m, dim]`), noise uniform in +-`noise`.
    fn clustered(centers: &[f32], dim: usize, per: usize, noise: f32, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix::new(seed);
        let m = centers.len() / dim;
        let mut out = Vec::with_capacity(m * per * dim);
        for i in 0..per * m {
            // Interleave clusters so no cluster sits in one contiguous run.
            let c = &centers[(i % m) * dim..(i % m + 1) * dim];
            out.extend(
                c.iter()
                    .map(|&v| v + noise * (2.0 * rng.uniform() as f32 - 1.0)),
            );
        }
        out
    }

    fn centers(m: usize, dim: usize, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix::new(seed);
        (0..m * dim)
            .map(|_| 20.0 * rng.uniform() as f32 - 10.0)
            .collect()
    }

    #[test]
    fn recovers_well_separated_clusters() {
        for (dim, m) in [(4, 16), (8, 32)] {
            let truth = centers(m, dim, 3);
            let data = clustered(&truth, dim, 200, 0.05, 4);
            let cfg = KMeansConfig {
                k: m,
                ..KMeansConfig::default()
            };
            let km = kmeans(&data, dim, &cfg).unwrap();
            // Every true center has a centroid within the noise, and the fit is as tight as the
            // noise allows (uniform +-0.05: variance 0.05^2 / 3 per coordinate).
            for t in truth.chunks_exact(dim) {
                let best = km
                    .centroids
                    .chunks_exact(dim)
                    .map(|c| dist2(c, t))
                    .fold(f32::INFINITY, f32::min);
                assert!(best < 1e-3, "dim {dim}: a cluster was missed ({best})");
            }
            let noise_mse = dim as f64 * 0.05f64.powi(2) / 3.0;
            assert!(km.mse < 1.2 * noise_mse, "{} vs {noise_mse}", km.mse);
        }
    }

    #[test]
    fn deterministic_given_the_seed() {
        let data = clustered(&centers(40, 4, 5), 4, 300, 1.0, 6);
        let cfg = KMeansConfig {
            k: 64,
            iters: 8,
            ..KMeansConfig::default()
        };
        let a = kmeans(&data, 4, &cfg).unwrap();
        let b = kmeans(&data, 4, &cfg).unwrap();
        assert_eq!(a, b);
        let c = kmeans(
            &data,
            4,
            &KMeansConfig {
                seed: 99,
                ..cfg.clone()
            },
        )
        .unwrap();
        assert_ne!(a.centroids, c.centroids);
    }

    #[test]
    fn large_inputs_are_subsampled() {
        let data = clustered(&centers(8, 4, 7), 4, 5000, 0.01, 8);
        let cfg = KMeansConfig {
            k: 8,
            max_samples: 2000,
            ..KMeansConfig::default()
        };
        let km = kmeans(&data, 4, &cfg).unwrap();
        assert!(km.mse < 1e-3, "{}", km.mse);
    }

    #[test]
    fn fewer_distinct_points_than_centroids_still_fill_the_codebook() {
        // 3 distinct points, k = 8: no NaN, every centroid is one of the points, mse 0.
        let pts = [0f32, 0.0, 1.0, 1.0, 5.0, -5.0];
        let data: Vec<f32> = pts.iter().cycle().take(6 * 10).copied().collect();
        let cfg = KMeansConfig {
            k: 8,
            ..KMeansConfig::default()
        };
        let km = kmeans(&data, 2, &cfg).unwrap();
        assert_eq!(km.centroids.len(), 16);
        assert_eq!(km.mse, 0.0);
        for c in km.centroids.chunks_exact(2) {
            assert!(pts.chunks_exact(2).any(|p| p == c), "{c:?}");
        }
        // Fewer points than centroids at all.
        let km = kmeans(&pts, 2, &cfg).unwrap();
        assert_eq!(km.mse, 0.0);
    }

    #[test]
    fn empty_clusters_are_reseeded_on_the_worst_points() {
        let pts = [0f32, 0.0, 10.0, 0.0, 0.0, 3.0];
        let mut centroids = vec![0f32, 0.0, 100.0, 100.0];
        reseed_empty(&pts, 2, &[3, 0], &[0.0, 100.0, 9.0], &mut centroids);
        assert_eq!(centroids, [0.0, 0.0, 10.0, 0.0]);
    }

    #[test]
    fn bad_input_is_an_error() {
        let cfg = KMeansConfig::default();
        assert!(kmeans(&[], 4, &cfg).is_err());
        assert!(kmeans(&[1.0; 6], 4, &cfg).is_err());
        assert!(kmeans(&[f32::NAN; 4], 4, &cfg).is_err());
    }
}
