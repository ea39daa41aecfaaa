//! The one test kit of the compressed methods (QJL, TurboQuant-MSE, -Prod, -RVQ, the centering
//! tests): Gaussian data from the crate's one random stream, the test geometry, distortion of
//! unit vectors, attention error against exact attention, chunked prefill against token by token,
//! resident bytes, the fused op against `kvq_kernels::attend_reference`, and the statistics of
//! the unbiasedness tests.

use crate::attention::attention_reference;
use crate::codec::rng::SplitMix;
use crate::compressed::{KeyCodec, ValueCodec};
use crate::traits::{CacheFactory, CacheGeometry};
use candle_core::{Device, Tensor};
use kvq_kernels::{
    AttendParams, attend_reference, compressed_attend, encode_keys, encode_reference, encode_values,
};
use std::sync::Arc;

/// `n` standard Gaussians from `seed` (`SplitMix::gauss_vec`: both Box-Muller samples of each
/// pair of uniforms).
pub fn gauss(n: usize, seed: u64) -> Vec<f32> {
    SplitMix::new(seed).gauss_vec(n)
}

/// The test geometry: 4 query heads over 2 kv heads of dimension 64 (SmolLM2's head_dim), room
/// for 8192 tokens.
pub fn geom() -> CacheGeometry {
    CacheGeometry {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        sliding_window: None,
        max_tokens: 8192,
    }
}

/// `x` as a CPU tensor of shape `dims`.
pub fn tensor(x: &[f32], dims: (usize, usize, usize)) -> Tensor {
    Tensor::from_vec(x.to_vec(), dims, &Device::Cpu).expect("tensor")
}

/// `||a - b|| / ||b||`.
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let den: f32 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

/// Mean `||x - x_hat||^2` over `n` random unit vectors of dim `d` (seeds 100..100 + n),
/// reconstructed through the value path (`accumulate` with probability 1, then `finish`).
pub fn unit_distortion(c: &dyn ValueCodec, d: usize, n: u64) -> f64 {
    let mut total = 0f64;
    let mut code = vec![0u8; c.code_bytes()];
    for i in 0..n {
        let mut x = gauss(d, 100 + i);
        let norm = x.iter().map(|v| v * v).sum::<f32>().sqrt();
        x.iter_mut().for_each(|v| *v /= norm);
        c.encode(0, &x, &mut code);
        let mut acc = vec![0f32; c.acc_len()];
        c.accumulate(0, &[1.0], &code, &mut acc);
        let mut rec = vec![0f32; d];
        c.finish(0, &acc, &mut rec);
        total += x
            .iter()
            .zip(&rec)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum::<f64>();
    }
    total / n as f64
}

/// Relative L2 error of one decode step's attention output against exact attention, after a
/// `len`-token prefill and one more token (scale 1/8 = 1/sqrt(64)), with data drawn from seeds
/// `seed..seed + 5`.
pub fn attention_error(f: &dyn CacheFactory, len: usize, seed: u64) -> f32 {
    attention_error_with(f, len, seed, |_| {})
}

/// `attention_error` with every key row (d values) passed through `shape` first.
pub fn attention_error_with(
    f: &dyn CacheFactory,
    len: usize,
    seed: u64,
    shape: impl Fn(&mut [f32]),
) -> f32 {
    let g = geom();
    let (h, kvh, d) = (g.n_heads, g.n_kv_heads, g.head_dim);
    let mut cache = f.create(0, &g).expect("cache");
    let mut k = gauss(kvh * len * d, seed);
    let v = gauss(kvh * len * d, seed + 1);
    let q = gauss(h * d, seed + 2);
    let (mut k1, v1) = (gauss(kvh * d, seed + 3), gauss(kvh * d, seed + 4));
    k.chunks_exact_mut(d)
        .chain(k1.chunks_exact_mut(d))
        .for_each(&shape);
    cache
        .append(&tensor(&k, (kvh, len, d)), &tensor(&v, (kvh, len, d)))
        .expect("append");
    cache
        .append(&tensor(&k1, (kvh, 1, d)), &tensor(&v1, (kvh, 1, d)))
        .expect("append");
    let out = cache
        .attend(&tensor(&q, (h, 1, d)), 0.125)
        .and_then(|o| Ok(o.flatten_all()?.to_vec1::<f32>()?))
        .expect("attend");
    let join = |a: &[f32], b: &[f32]| -> Vec<f32> {
        (0..kvh)
            .flat_map(|hh| {
                a[hh * len * d..(hh + 1) * len * d]
                    .iter()
                    .chain(&b[hh * d..(hh + 1) * d])
                    .copied()
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let (kk, vv) = (join(&k, &k1), join(&v, &v1));
    let want = attention_reference(&q, &kk, &vv, h, kvh, 1, len + 1, d, 0.125, None);
    rel_err(&out, &want)
}

/// The mean of `attention_error_with` over 4 method seeds (sketch matrices, rotations: `make`
/// builds the factory for a seed) times 2 data seeds. The error depends on the matrices drawn
/// as much as on the data, so both are averaged.
pub fn seed_averaged_error<F: CacheFactory>(
    make: impl Fn(u64) -> F,
    shape: impl Fn(&mut [f32]) + Copy,
) -> f32 {
    let mut total = 0f32;
    for s in 0..4u64 {
        let f = make(s * 7919 + 1);
        for i in 0..2u64 {
            total += attention_error_with(&f, 300, 100 * i + 1, shape);
        }
    }
    total / 8.0
}

/// Appending a 120-token chunk (past the keys the key center is fixed from) and attending all
/// its rows against appending and attending token by token (what generation sees); returns the
/// largest difference of any output.
pub fn prefill_vs_steps(f: &dyn CacheFactory) -> f32 {
    let g = geom();
    let (h, kvh, d) = (g.n_heads, g.n_kv_heads, g.head_dim);
    let t = 120;
    let kt = tensor(&gauss(kvh * t * d, 11), (kvh, t, d));
    let vt = tensor(&gauss(kvh * t * d, 12), (kvh, t, d));
    let qt = tensor(&gauss(h * t * d, 13), (h, t, d));
    let mut chunked = f.create(0, &g).expect("cache");
    chunked.append(&kt, &vt).expect("append");
    let a = chunked.attend(&qt, 0.125).expect("attend");
    let mut stepped = f.create(0, &g).expect("cache");
    let mut worst = 0f32;
    for i in 0..t {
        let step = |x: &Tensor| x.narrow(1, i, 1).and_then(|x| x.contiguous());
        let (ki, vi, qi) = (step(&kt), step(&vt), step(&qt));
        stepped
            .append(&ki.expect("k"), &vi.expect("v"))
            .expect("append");
        let b = stepped.attend(&qi.expect("q"), 0.125).expect("attend");
        let diff = (a.narrow(1, i, 1).expect("row") - b)
            .and_then(|x| x.abs()?.max_all()?.to_scalar::<f32>())
            .expect("diff");
        worst = worst.max(diff);
    }
    worst
}

/// Resident bytes at 8192 tokens over the promised size: per token and kv head the key and
/// value code bytes, plus the fp16 window (64 tokens of keys and values) amortized.
pub fn resident_ratio(f: &dyn CacheFactory, key_bytes: usize, value_bytes: usize) -> f64 {
    let g = geom();
    let mut cache = f.create(0, &g).expect("cache");
    let (kvh, d) = (g.n_kv_heads, g.head_dim);
    let len = 8192 - 64;
    let k = tensor(&gauss(kvh * len * d, 1), (kvh, len, d));
    cache.append(&k, &k).expect("append");
    // As a model does: each append is followed by its queries (here the last row only).
    let q = tensor(&gauss(g.n_heads * d, 3), (g.n_heads, 1, d));
    cache.attend(&q, 0.125).expect("attend");
    let one = tensor(&gauss(kvh * d, 2), (kvh, 1, d));
    for _ in 0..64 {
        cache.append(&one, &one).expect("append");
        cache.attend(&q, 0.125).expect("attend");
    }
    let n = cache.len();
    let promised = kvh * (n * (key_bytes + value_bytes) + 2 * 64 * d * 2);
    cache.resident_bytes() as f64 / promised as f64
}

/// The fused op (`compressed_attend` on codes from the encode op, which must equal
/// `encode_reference` byte for byte) against `attend_reference` (decode, then exact attention):
/// 5 query rows at the end of 300 positions, window 16, 3 sinks. Returns the largest relative
/// difference of the partial states, row by row: each output against the row's largest, the
/// running max, the softmax sum, and the normalized output (out / sum) in L2.
pub fn op_vs_reference(keys: Arc<dyn KeyCodec>, values: Arc<dyn ValueCodec>) -> f32 {
    let g = geom();
    let (h, kvh, d) = (g.n_heads, g.n_kv_heads, g.head_dim);
    let (n, t) = (300, 5);
    let (k, v) = (gauss(kvh * n * d, 21), gauss(kvh * n * d, 22));
    let q = gauss(h * t * d, 23);
    let kc = encode_keys(&keys, &tensor(&k, (kvh, n, d))).expect("encode keys");
    let vc = encode_values(&values, &tensor(&v, (kvh, n, d))).expect("encode values");
    let flat = |x: &Tensor| {
        x.flatten_all()
            .and_then(|x| x.to_vec1::<u8>())
            .expect("codes")
    };
    let (kb, vb) = (flat(&kc), flat(&vc));
    let (kw, vw) = (keys.code_bytes(), values.code_bytes());
    let key_rows = encode_reference(|hh, x, o| keys.encode(hh, x, o), &k, kvh, d, kw);
    let value_rows = encode_reference(|hh, x, o| values.encode(hh, x, o), &v, kvh, d, vw);
    assert!(
        kb == key_rows,
        "the key encode op differs from its reference"
    );
    assert!(
        vb == value_rows,
        "the value encode op differs from its reference"
    );
    let p = AttendParams {
        scale: 0.125,
        first_pos: n - t,
        window: 16,
        sinks: 3,
        sliding_window: None,
        code_first: 0,
        exact_before: 0,
    };
    let got = compressed_attend(&keys, &values, p, &tensor(&q, (h, t, d)), &kc, &vc)
        .and_then(|o| o.flatten_all()?.to_vec1::<f32>())
        .expect("op");
    let want = attend_reference(keys.as_ref(), values.as_ref(), p, &q, h, &kb, &vb, kvh);
    // Each row is d outputs (unnormalized), the running max, the softmax sum.
    let mut worst = 0f32;
    for (a, b) in got.chunks_exact(d + 2).zip(want.chunks_exact(d + 2)) {
        let mag = b[..d].iter().fold(1e-3f32, |m, x| m.max(x.abs()));
        for (x, y) in a[..d].iter().zip(&b[..d]) {
            worst = worst.max((x - y).abs() / mag);
        }
        worst = worst.max((a[d] - b[d]).abs() / b[d].abs().max(1.0));
        worst = worst.max((a[d + 1] - b[d + 1]).abs() / b[d + 1]);
        let na: Vec<f32> = a[..d].iter().map(|x| x / a[d + 1]).collect();
        let nb: Vec<f32> = b[..d].iter().map(|x| x / b[d + 1]).collect();
        worst = worst.max(rel_err(&na, &nb));
    }
    worst
}

/// Mean and standard error of `estimate(seed)` over `n` seeds.
pub fn mean_and_se(n: u64, estimate: impl Fn(u64) -> f64) -> (f64, f64) {
    let xs: Vec<f64> = (0..n).map(estimate).collect();
    let mean = xs.iter().sum::<f64>() / n as f64;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    (mean, (var / n as f64).sqrt())
}

/// (q, k) pairs: independent, strongly correlated, and anti-correlated with a large norm.
pub fn pairs(d: usize) -> Vec<(Vec<f32>, Vec<f32>)> {
    let q = gauss(d, 71);
    let noise = gauss(d, 72);
    let close: Vec<f32> = q.iter().zip(&noise).map(|(a, b)| a + 0.3 * b).collect();
    let anti: Vec<f32> = q.iter().zip(&noise).map(|(a, b)| -3.0 * a + b).collect();
    vec![(q.clone(), gauss(d, 73)), (q.clone(), close), (q, anti)]
}
