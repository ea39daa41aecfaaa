//! Tests of the Q4_1 kernels: bit-equality with the scalar reference and with candle.
use super::*;
use candle_core::quantized::QMatMul;
use candle_core::{Device, Module};
use proptest::prelude::*;

/// xorshift64*: deterministic test data without another dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// `n` values uniform in [-1, 1).
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 ^= self.0 >> 12;
                self.0 ^= self.0 << 25;
                self.0 ^= self.0 >> 27;
                let r = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
                r as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }
}

fn quantized(w: &[f32], rows: usize, cols: usize) -> QTensor {
    let w = Tensor::from_vec(w.to_vec(), (rows, cols), &Device::Cpu).expect("tensor");
    QTensor::quantize(&w, GgmlDType::Q4_1).expect("quantize")
}

fn kernels() -> Vec<Kernel> {
    let mut ks = vec![Kernel::Scalar];
    #[cfg(target_arch = "x86_64")]
    {
        let best = Kernel::best();
        if best != Kernel::Scalar {
            ks.push(Kernel::Avx2);
        }
        if best == Kernel::Vnni {
            ks.push(Kernel::Vnni);
        }
    }
    ks
}

/// Every kernel against the reference, bit for bit: the arithmetic is the same, so this is
/// stricter than a relative tolerance.
fn check_kernels(q: &QTensor, x: &[f32], t: usize) {
    let (rows, cols) = q.shape().dims2().expect("2-D");
    let data = q.data().expect("data");
    let want = matmul_q4_1_reference(&data, rows, cols, x, t).expect("reference");
    let w = Q41Weight::from_blocks(&data, rows, cols).expect("repack");
    for k in kernels() {
        let got = w.matmul_with(k, x, t).expect("matmul");
        for (i, (g, r)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                r.to_bits(),
                "{k:?} [{rows}x{cols}] t={t} at {i}: {g} vs {r}"
            );
        }
    }
}

#[test]
fn kernels_match_reference_on_model_shapes() {
    let mut rng = Rng::new(7);
    for (rows, cols) in [(576, 576), (1536, 576), (576, 1536), (192, 576)] {
        let q = quantized(&rng.vec(rows * cols), rows, cols);
        for t in [1, 3, 17] {
            check_kernels(&q, &rng.vec(t * cols), t);
        }
    }
}

#[test]
fn matches_candle_qmatmul() {
    let mut rng = Rng::new(11);
    for (rows, cols, t) in [(576, 576, 1), (1536, 576, 3), (576, 1536, 17), (200, 64, 5)] {
        let q = quantized(&rng.vec(rows * cols), rows, cols);
        let w = Q41Weight::from_qtensor(&q).expect("repack").expect("Q4_1");
        let x = Tensor::from_vec(rng.vec(t * cols), (t, cols), &Device::Cpu).expect("x");
        let got = w.forward(&x).expect("ours");
        let want = QMatMul::from_qtensor(q)
            .expect("qmatmul")
            .forward(&x)
            .expect("candle");
        assert_eq!(got.dims(), want.dims());
        let got = got
            .flatten_all()
            .and_then(|g| g.to_vec1::<f32>())
            .expect("v");
        let want = want
            .flatten_all()
            .and_then(|g| g.to_vec1::<f32>())
            .expect("v");
        let scale = want.iter().fold(1f32, |a, v| a.max(v.abs()));
        for (i, (g, r)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - r).abs() <= 1e-5 * scale,
                "[{rows}x{cols}] t={t} at {i}: {g} vs {r}"
            );
        }
    }
}

#[test]
fn rejects_bad_shapes() {
    assert!(Q41Weight::from_blocks(&[0; 20], 1, 16).is_err());
    assert!(Q41Weight::from_blocks(&[0; 20], 2, 32).is_err());
    let w = Q41Weight::from_blocks(&[0; 40], 2, 32).expect("repack");
    assert!(w.matmul(&[0.0; 33], 1).is_err());
    assert_eq!(w.matmul(&[0.0; 64], 2).expect("zeros"), vec![0.0; 4]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn kernels_match_reference_on_random_shapes(
        rows in 1usize..40,
        blocks in 1usize..6,
        t in 1usize..10,
        seed in any::<u64>(),
    ) {
        let cols = blocks * QK;
        let mut rng = Rng::new(seed);
        let q = quantized(&rng.vec(rows * cols), rows, cols);
        check_kernels(&q, &rng.vec(t * cols), t);
    }
}
