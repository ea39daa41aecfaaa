//! Data-free Lloyd-Max scalar codebooks: the MSE-optimal 2^b levels for a standard Gaussian
//! (TurboQuant's rotated coordinates) and for a Laplacian (the RVQ residual stage), computed once
//! by the Lloyd iteration with closed-form interval centroids.

use std::sync::OnceLock;

/// A sorted scalar codebook for a unit-scale distribution.
#[derive(Debug, Clone, PartialEq)]
pub struct Codebook {
    /// The reconstruction levels, ascending.
    pub levels: Vec<f32>,
    /// Decision thresholds between consecutive levels (`levels.len() - 1` of them).
    pub thresholds: Vec<f32>,
    /// Mean squared error per coordinate for the unit-scale distribution.
    pub mse: f64,
}

impl Codebook {
    /// Index of the nearest level.
    #[inline]
    pub fn quantize(&self, x: f32) -> u8 {
        self.thresholds.partition_point(|&t| t < x) as u8
    }
}

/// The distributions codebooks are fitted to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dist {
    /// N(0, 1).
    Gaussian,
    /// Laplace(0, 1/sqrt(2)): unit variance.
    Laplace,
}

fn gauss_pdf(x: f64) -> f64 {
    (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

fn gauss_cdf(x: f64) -> f64 {
    0.5 * (1.0 + libm::erf(x / std::f64::consts::SQRT_2))
}

/// Probability mass and first moment of the distribution on `[a, b]`.
fn mass_and_moment(dist: Dist, a: f64, b: f64) -> (f64, f64) {
    match dist {
        Dist::Gaussian => (gauss_cdf(b) - gauss_cdf(a), gauss_pdf(a) - gauss_pdf(b)),
        Dist::Laplace => {
            // Density (lambda / 2) exp(-lambda |x|), lambda = sqrt(2) for unit variance.
            let l = std::f64::consts::SQRT_2;
            // Antiderivatives of the density and of x * density on each half line.
            let cdf = |x: f64| {
                if x < 0.0 {
                    0.5 * (l * x).exp()
                } else {
                    1.0 - 0.5 * (-l * x).exp()
                }
            };
            let m1 = |x: f64| {
                // integral of t * density from -inf to x.
                if x.is_infinite() {
                    0.0
                } else if x < 0.0 {
                    0.5 * (l * x).exp() * (x - 1.0 / l)
                } else {
                    -0.5 * (-l * x).exp() * (x + 1.0 / l)
                }
            };
            (cdf(b) - cdf(a), m1(b) - m1(a))
        }
    }
}

/// Second moment on `[a, b]` about `c`, by Simpson's rule on the density (only used for the MSE report).
fn sq_err(dist: Dist, a: f64, b: f64, c: f64) -> f64 {
    let pdf = |x: f64| match dist {
        Dist::Gaussian => gauss_pdf(x),
        Dist::Laplace => {
            let l = std::f64::consts::SQRT_2;
            0.5 * l * (-l * x.abs()).exp()
        }
    };
    let (a, b) = (a.max(-12.0), b.min(12.0));
    if b <= a {
        return 0.0;
    }
    let n = 400;
    let h = (b - a) / n as f64;
    let f = |x: f64| (x - c) * (x - c) * pdf(x);
    let mut s = f(a) + f(b);
    for i in 1..n {
        let x = a + i as f64 * h;
        s += if i % 2 == 1 { 4.0 } else { 2.0 } * f(x);
    }
    s * h / 3.0
}

/// The interval of level `i` given the thresholds between levels (unbounded at both ends).
fn cell(thresholds: &[f64], i: usize) -> (f64, f64) {
    let a = if i == 0 {
        f64::NEG_INFINITY
    } else {
        thresholds[i - 1]
    };
    let b = thresholds.get(i).copied().unwrap_or(f64::INFINITY);
    (a, b)
}

/// Runs the Lloyd iteration for `2^bits` levels.
pub fn fit(dist: Dist, bits: u32) -> Codebook {
    let n = 1usize << bits;
    // Start from uniform quantiles of a wide range.
    let mut levels: Vec<f64> = (0..n)
        .map(|i| -2.5 + 5.0 * (i as f64 + 0.5) / n as f64)
        .collect();
    let mut thresholds = vec![0f64; n - 1];
    for _ in 0..500 {
        for i in 0..n - 1 {
            thresholds[i] = 0.5 * (levels[i] + levels[i + 1]);
        }
        let mut moved = 0f64;
        for (i, level) in levels.iter_mut().enumerate() {
            let (a, b) = cell(&thresholds, i);
            let (m, mu) = mass_and_moment(dist, a, b);
            if m > 1e-300 {
                let c = mu / m;
                moved = moved.max((c - *level).abs());
                *level = c;
            }
        }
        if moved < 1e-10 {
            break;
        }
    }
    for i in 0..n - 1 {
        thresholds[i] = 0.5 * (levels[i] + levels[i + 1]);
    }
    let mse = (0..n)
        .map(|i| {
            let (a, b) = cell(&thresholds, i);
            sq_err(dist, a, b, levels[i])
        })
        .sum();
    Codebook {
        levels: levels.iter().map(|&x| x as f32).collect(),
        thresholds: thresholds.iter().map(|&x| x as f32).collect(),
        mse,
    }
}

/// The standard deviation of the distribution about each level within that level's cell
/// (`sqrt(E[(x - level)^2 | x in cell])`): the spread of the residual a stage leaves, per level.
pub fn cell_std(dist: Dist, bits: u32) -> Vec<f32> {
    let book = codebook(dist, bits);
    let th: Vec<f64> = book.thresholds.iter().map(|&t| f64::from(t)).collect();
    book.levels
        .iter()
        .enumerate()
        .map(|(i, &l)| {
            let (a, b) = cell(&th, i);
            let (mass, _) = mass_and_moment(dist, a, b);
            if mass > 0.0 {
                (sq_err(dist, a, b, f64::from(l)) / mass).sqrt() as f32
            } else {
                0.0
            }
        })
        .collect()
}

/// The cached unit-scale codebook for `dist` with `bits` bits (1 to 8).
pub fn codebook(dist: Dist, bits: u32) -> &'static Codebook {
    static GAUSS: [OnceLock<Codebook>; 8] = [const { OnceLock::new() }; 8];
    static LAPLACE: [OnceLock<Codebook>; 8] = [const { OnceLock::new() }; 8];
    assert!((1..=8).contains(&bits), "codebook bits must be in 1..=8");
    let slot = match dist {
        Dist::Gaussian => &GAUSS[bits as usize - 1],
        Dist::Laplace => &LAPLACE[bits as usize - 1],
    };
    slot.get_or_init(|| fit(dist, bits))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaussian_levels_match_the_known_optimum() {
        // Max (1960): 1 bit +-0.7979 (MSE 0.3634), 2 bits +-0.4528, +-1.5104 (MSE 0.1175).
        let c1 = codebook(Dist::Gaussian, 1);
        assert!((c1.levels[1] - 0.7979).abs() < 1e-3, "{:?}", c1.levels);
        assert!((c1.mse - 0.3634).abs() < 1e-3, "{}", c1.mse);
        let c2 = codebook(Dist::Gaussian, 2);
        assert!((c2.levels[2] - 0.4528).abs() < 1e-3 && (c2.levels[3] - 1.5104).abs() < 1e-3);
        assert!((c2.mse - 0.1175).abs() < 1e-3, "{}", c2.mse);
        // 3 and 4 bits: 0.03454 and 0.009497.
        assert!((codebook(Dist::Gaussian, 3).mse - 0.03454).abs() < 5e-4);
        assert!((codebook(Dist::Gaussian, 4).mse - 0.009497).abs() < 2e-4);
    }

    #[test]
    fn laplace_one_bit_is_the_conditional_mean() {
        // E[|X|] for unit-variance Laplace is 1/sqrt(2).
        let c = codebook(Dist::Laplace, 1);
        assert!((c.levels[1] - std::f32::consts::FRAC_1_SQRT_2).abs() < 1e-4);
    }

    #[test]
    fn cell_spread_matches_the_closed_form() {
        // One Gaussian bit: the half-normal's variance about its mean, 1 - 2/pi.
        let s = cell_std(Dist::Gaussian, 1);
        let want = (1.0 - 2.0 / std::f64::consts::PI).sqrt() as f32;
        assert!(s.iter().all(|x| (x - want).abs() < 1e-3), "{s:?} vs {want}");
        // Averaged over cells (weighted by mass) the variances give the codebook's MSE.
        for bits in 1..=4 {
            let book = codebook(Dist::Gaussian, bits);
            let th: Vec<f64> = book.thresholds.iter().map(|&t| f64::from(t)).collect();
            let total: f64 = cell_std(Dist::Gaussian, bits)
                .iter()
                .enumerate()
                .map(|(i, sd)| {
                    let (a, b) = cell(&th, i);
                    mass_and_moment(Dist::Gaussian, a, b).0 * f64::from(*sd).powi(2)
                })
                .sum();
            assert!(
                (total - book.mse).abs() < 1e-4 * book.mse.max(1e-3),
                "{total} vs {}",
                book.mse
            );
        }
    }

    #[test]
    fn quantize_picks_the_nearest_level() {
        let c = codebook(Dist::Gaussian, 2);
        for x in [-3.0f32, -1.0, -0.1, 0.2, 0.9, 2.5] {
            let q = c.quantize(x) as usize;
            let best = c
                .levels
                .iter()
                .enumerate()
                .min_by(|a, b| (a.1 - x).abs().total_cmp(&(b.1 - x).abs()))
                .map(|(i, _)| i)
                .unwrap();
            assert_eq!(q, best, "x = {x}");
        }
    }
}
