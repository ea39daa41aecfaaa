//! Checks the rotated scalar-codebook methods (TurboQuant-MSE and -RVQ) share in their tests:
//! distortion of unit vectors, attention against exact attention, chunked prefill against token
//! by token, the fused op against `kvq_kernels::attend_reference`, resident bytes.

use crate::attention::attention_reference;
use crate::traits::{CacheFactory, CacheGeometry};
use candle_core::{Device, Tensor};
use kvq_kernels::{AttendParams, KeyCodec, ValueCodec, attend_reference, compressed_attend};
use std::sync::Arc;

/// Standard normal samples (Box-Muller over the crate's splitmix64 stream, one sample per pair
/// of uniforms: the data these tests' bounds were set on).
pub fn gauss(n: usize, seed: u64) -> Vec<f32> {
    let mut r = crate::codec::rng::SplitMix::new(seed);
    (0..n)
        .map(|_| {
            let (u1, u2) = (r.uniform().max(1e-12), r.uniform());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

/// 4 query heads over 2 kv heads of dim 64.
pub fn geom() -> CacheGeometry {
    CacheGeometry {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        sliding_window: None,
        max_tokens: 4096,
    }
}

/// Mean `||x - x_hat||^2` over `n` random unit vectors of dim `d`, reconstructed through the
/// value path (`accumulate` with probability 1, then `finish`).
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

fn tensor(x: &[f32], shape: (usize, usize, usize)) -> Tensor {
    Tensor::from_vec(x.to_vec(), shape, &Device::Cpu).expect("tensor")
}

/// Relative error of a decode step's attention output against exact attention on the same keys
/// and values: `len` tokens appended at once, one more, then one query row.
pub fn attention_error(f: &dyn CacheFactory, len: usize) -> f32 {
    let g = geom();
    let (h, kvh, d) = (g.n_heads, g.n_kv_heads, g.head_dim);
    let mut cache = f.create(0, &g).expect("cache");
    let (k, v, q) = (
        gauss(kvh * len * d, 1),
        gauss(kvh * len * d, 2),
        gauss(h * d, 3),
    );
    let (k1, v1) = (gauss(kvh * d, 4), gauss(kvh * d, 5));
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
    let num: f32 = out.iter().zip(&want).map(|(a, b)| (a - b).powi(2)).sum();
    let den: f32 = want.iter().map(|b| b * b).sum();
    (num / den).sqrt()
}

/// Appending a 120-token chunk (past the keys the key center is fixed from) and attending all
/// its rows equals appending and attending token by token (within 1e-5).
pub fn assert_prefill_matches_steps(f: &dyn CacheFactory) {
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
        assert!(diff < 1e-5, "row {i}: {diff}");
    }
}

/// Resident bytes over the promised size at 8192 tokens (`code_bytes` per token and kv head for
/// keys and for values, plus the fp16 window of 64).
pub fn resident_ratio(f: &dyn CacheFactory, key_bytes: usize, value_bytes: usize) -> f64 {
    let g = CacheGeometry {
        max_tokens: 8192,
        ..geom()
    };
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

/// The fused op (`compressed_attend`) agrees with `attend_reference` on rows of codes encoded by
/// `keys` and `values`: 5 query rows at the end of 300 positions, window 16, 3 sinks.
pub fn assert_op_matches_reference(keys: Arc<dyn KeyCodec>, values: Arc<dyn ValueCodec>) {
    let (nh, kvh, d, n, t) = (4, 2, keys.head_dim(), 300, 5);
    let (kb, vb) = (keys.code_bytes(), values.code_bytes());
    let k = gauss(kvh * n * d, 21);
    let v = gauss(kvh * n * d, 22);
    let q = gauss(nh * t * d, 23);
    let kc = kvq_kernels::encode_reference(|h, x, o| keys.encode(h, x, o), &k, kvh, d, kb);
    let vc = kvq_kernels::encode_reference(|h, x, o| values.encode(h, x, o), &v, kvh, d, vb);
    let p = AttendParams {
        scale: 0.125,
        first_pos: n - t,
        window: 16,
        sinks: 3,
        sliding_window: None,
        code_first: 0,
        exact_before: 0,
    };
    let want = attend_reference(keys.as_ref(), values.as_ref(), p, &q, nh, &kc, &vc, kvh);
    let u8t = |x: &[u8], w: usize| {
        Tensor::from_vec(x.to_vec(), (kvh, n, w), &Device::Cpu).expect("codes")
    };
    let got = compressed_attend(
        &keys,
        &values,
        p,
        &tensor(&q, (nh, t, d)),
        &u8t(&kc, kb),
        &u8t(&vc, vb),
    )
    .and_then(|o| o.flatten_all()?.to_vec1::<f32>())
    .expect("op");
    for (row, (a, b)) in got.chunks(d + 2).zip(want.chunks(d + 2)).enumerate() {
        let mag = b[..d].iter().fold(1e-3f32, |m, x| m.max(x.abs()));
        for (x, y) in a[..d].iter().zip(&b[..d]) {
            assert!((x - y).abs() <= 1e-4 * mag, "row {row}: {x} vs {y}");
        }
        assert!(
            (a[d] - b[d]).abs() <= 1e-4 * b[d].abs().max(1.0),
            "row {row} max"
        );
        assert!(
            (a[d + 1] - b[d + 1]).abs() <= 1e-4 * b[d + 1],
            "row {row} sum"
        );
    }
}
