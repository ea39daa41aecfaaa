//! The one seeded random stream of the crate: splitmix64, with uniforms, bounded integers and
//! Box-Muller Gaussians; small, and the same on every platform (rotation signs, sketch
//! matrices, k-means seeding and the tests' data all come from it).

/// A splitmix64 stream.
#[derive(Debug, Clone)]
pub struct SplitMix {
    state: u64,
    spare: Option<f64>,
}

impl SplitMix {
    /// A stream seeded by `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            state: seed,
            spare: None,
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (n >= 1).
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// A standard Gaussian sample (Box-Muller; the second of each pair is kept for the next
    /// call).
    pub fn gauss(&mut self) -> f64 {
        if let Some(g) = self.spare.take() {
            return g;
        }
        let (u1, u2) = (self.uniform().max(1e-300), self.uniform());
        let r = (-2.0 * u1.ln()).sqrt();
        let t = 2.0 * std::f64::consts::PI * u2;
        self.spare = Some(r * t.sin());
        r * t.cos()
    }

    /// `n` standard Gaussian samples as f32.
    pub fn gauss_vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.gauss() as f32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_splitmix64_reference_values() {
        // splitmix64 seeded with 0 (Vigna's reference implementation).
        let mut r = SplitMix::new(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn bounded_and_unit_draws_stay_in_range() {
        let mut r = SplitMix::new(42);
        for _ in 0..10_000 {
            assert!(r.below(7) < 7);
            let u = r.uniform();
            assert!((0.0..1.0).contains(&u));
        }
    }

    #[test]
    fn gaussians_have_unit_variance() {
        let g = SplitMix::new(5).gauss_vec(100_000);
        let mean = g.iter().map(|&x| x as f64).sum::<f64>() / g.len() as f64;
        let var = g.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / g.len() as f64;
        assert!(
            mean.abs() < 0.01 && (var - 1.0).abs() < 0.02,
            "{mean} {var}"
        );
    }
}
