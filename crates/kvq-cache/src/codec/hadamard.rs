//! The randomized Hadamard rotation `x -> H D x / sqrt(n)`: random signs `D` (seeded), then the
//! fast Walsh-Hadamard transform. Orthogonal, so norms and inner products are preserved, and it
//! spreads outlier channels over all coordinates.

/// In-place fast Walsh-Hadamard transform (unnormalized); `x.len()` must be a power of two.
/// Each stage pairs the halves of every block of `2h` values; written over slices so the
/// butterflies of a stage vectorize (the same additions as the textbook loop, in the same order).
pub fn fwht(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for block in x.chunks_exact_mut(2 * h) {
            let (a, b) = block.split_at_mut(h);
            for (p, q) in a.iter_mut().zip(b.iter_mut()) {
                let (u, v) = (*p, *q);
                *p = u + v;
                *q = u - v;
            }
        }
        h *= 2;
    }
}

/// The textbook loop [`fwht`] is tested against.
pub fn fwht_reference(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
}

/// A seeded randomized Hadamard rotation of dimension `n` (a power of two).
#[derive(Debug, Clone)]
pub struct Rotation {
    signs: Vec<f32>,
    scale: f32,
}

impl Rotation {
    /// Signs drawn from a splitmix64 stream seeded by `seed`.
    pub fn new(n: usize, seed: u64) -> Self {
        assert!(
            n.is_power_of_two(),
            "Hadamard dimension must be a power of two"
        );
        let mut r = super::rng::SplitMix::new(seed);
        let signs = (0..n)
            .map(|_| if r.next_u64() & 1 == 0 { 1.0 } else { -1.0 })
            .collect();
        Self {
            signs,
            scale: 1.0 / (n as f32).sqrt(),
        }
    }

    /// The random signs `D` (+1 / -1), what device kernels rotate with.
    pub fn signs(&self) -> &[f32] {
        &self.signs
    }

    /// Dimension.
    pub fn dim(&self) -> usize {
        self.signs.len()
    }

    /// `x <- H D x / sqrt(n)`.
    pub fn apply(&self, x: &mut [f32]) {
        for (v, s) in x.iter_mut().zip(&self.signs) {
            *v *= s;
        }
        fwht(x);
        for v in x.iter_mut() {
            *v *= self.scale;
        }
    }

    /// The inverse: `x <- D H x / sqrt(n)`.
    pub fn invert(&self, x: &mut [f32]) {
        fwht(x);
        for (v, s) in x.iter_mut().zip(&self.signs) {
            *v *= s * self.scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_is_orthogonal_and_invertible() {
        let r = Rotation::new(64, 7);
        let x: Vec<f32> = (0..64).map(|i| ((i * 37) % 11) as f32 - 5.0).collect();
        let y: Vec<f32> = (0..64).map(|i| ((i * 13) % 7) as f32 - 3.0).collect();
        let (mut rx, mut ry) = (x.clone(), y.clone());
        r.apply(&mut rx);
        r.apply(&mut ry);
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(p, q)| p * q).sum::<f32>();
        assert!((dot(&x, &y) - dot(&rx, &ry)).abs() < 1e-3);
        assert!((dot(&x, &x) - dot(&rx, &rx)).abs() < 1e-3);
        r.invert(&mut rx);
        assert!(x.iter().zip(&rx).all(|(a, b)| (a - b).abs() < 1e-4));
    }

    #[test]
    fn fwht_is_the_textbook_loop_bit_for_bit() {
        for n in [1usize, 2, 4, 8, 16, 64, 128, 256, 1024] {
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 113) as f32 / 7.0 - 8.0)
                .collect();
            let (mut a, mut b) = (x.clone(), x);
            fwht(&mut a);
            fwht_reference(&mut b);
            assert!(
                a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()),
                "n = {n}"
            );
        }
    }

    #[test]
    fn seeds_give_different_signs() {
        assert_ne!(Rotation::new(64, 1).signs, Rotation::new(64, 2).signs);
    }
}
