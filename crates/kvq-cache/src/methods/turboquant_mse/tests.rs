//! TurboQuant-MSE tests: distortion within the paper's bound, attention close to exact
//! attention, the window and sinks exact, and resident bytes as promised.

use super::*;
use crate::attention::attention_reference;
use candle_core::{Device, Tensor};

fn gauss(n: usize, seed: u64) -> Vec<f32> {
    // Box-Muller over a splitmix64 stream.
    let mut s = seed;
    let mut next = || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            let (u1, u2) = (next().max(1e-12), next());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

#[test]
fn distortion_is_within_the_paper_bound() {
    // E||x - x_hat||^2 for unit x <= (sqrt(3) pi / 2) 4^-b.
    let d = 128;
    for bits in 1..=4u32 {
        let c = MseCodec::new(d, 1, bits, 0, 1).unwrap();
        let n = 400;
        let mut total = 0f64;
        for i in 0..n {
            let mut x = gauss(d, 100 + i);
            let norm = x.iter().map(|v| v * v).sum::<f32>().sqrt();
            x.iter_mut().for_each(|v| *v /= norm);
            let mut code = vec![0u8; KeyCodec::code_bytes(&c)];
            KeyCodec::encode(&c, 0, &x, &mut code);
            let mut acc = vec![0f32; d];
            c.accumulate(0, &[1.0], &code, &mut acc);
            let mut rec = vec![0f32; d];
            c.finish(0, &acc, &mut rec);
            total += x
                .iter()
                .zip(&rec)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum::<f64>();
        }
        let mse = total / n as f64;
        let bound = 3f64.sqrt() * std::f64::consts::PI / 2.0 * 4f64.powi(-(bits as i32));
        assert!(mse <= bound, "b={bits}: mse {mse} > bound {bound}");
        // And close to the Lloyd-Max optimum it is built from.
        let optimum = codebook(Dist::Gaussian, bits).mse;
        assert!(
            (mse - optimum).abs() < 0.25 * optimum,
            "b={bits}: mse {mse} vs {optimum}"
        );
    }
}

fn geom() -> CacheGeometry {
    CacheGeometry {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        sliding_window: None,
        max_tokens: 4096,
    }
}

/// Relative error of the attention output against exact attention on the same keys and values.
fn attention_error(bits: u32, window: usize, sinks: usize, len: usize) -> f32 {
    let g = geom();
    let (h, kvh, d) = (g.n_heads, g.n_kv_heads, g.head_dim);
    let f = TurboQuantMseFactory {
        window,
        sinks,
        ..TurboQuantMseFactory::new(bits)
    };
    let mut cache = f.create(0, &g).unwrap();
    let dev = Device::Cpu;
    let k = gauss(kvh * len * d, 1);
    let v = gauss(kvh * len * d, 2);
    let q = gauss(h * d, 3);
    cache
        .append(
            &Tensor::from_vec(k.clone(), (kvh, len, d), &dev).unwrap(),
            &Tensor::from_vec(v.clone(), (kvh, len, d), &dev).unwrap(),
        )
        .unwrap();
    // Decode one more step so the query is a single row.
    let k1 = gauss(kvh * d, 4);
    let v1 = gauss(kvh * d, 5);
    cache
        .append(
            &Tensor::from_vec(k1.clone(), (kvh, 1, d), &dev).unwrap(),
            &Tensor::from_vec(v1.clone(), (kvh, 1, d), &dev).unwrap(),
        )
        .unwrap();
    let out = cache
        .attend(
            &Tensor::from_vec(q.clone(), (h, 1, d), &dev).unwrap(),
            0.125,
        )
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
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
    let want = attention_reference(
        &q,
        &join(&k, &k1),
        &join(&v, &v1),
        h,
        kvh,
        1,
        len + 1,
        d,
        0.125,
        None,
    );
    let num: f32 = out.iter().zip(&want).map(|(a, b)| (a - b).powi(2)).sum();
    let den: f32 = want.iter().map(|b| b * b).sum();
    (num / den).sqrt()
}

#[test]
fn attention_error_shrinks_with_bits() {
    let e2 = attention_error(2, 8, 0, 300);
    let e3 = attention_error(3, 8, 0, 300);
    let e4 = attention_error(4, 8, 0, 300);
    assert!(e4 < e3 && e3 < e2, "{e2} {e3} {e4}");
    assert!(e4 < 0.15, "4-bit relative error {e4}");
}

#[test]
fn window_covering_everything_is_exact_up_to_f16() {
    assert!(attention_error(2, 1000, 0, 300) < 2e-3);
    // All-sink: the first tokens are fp16 too.
    assert!(attention_error(2, 1, 400, 300) < 2e-3);
}

#[test]
fn prefill_rows_see_what_generation_would() {
    // Appending a chunk and attending all its rows equals appending token by token.
    let g = geom();
    let (h, kvh, d) = (g.n_heads, g.n_kv_heads, g.head_dim);
    let f = TurboQuantMseFactory {
        window: 16,
        sinks: 2,
        ..TurboQuantMseFactory::new(3)
    };
    let dev = Device::Cpu;
    let t = 50;
    let k = gauss(kvh * t * d, 11);
    let v = gauss(kvh * t * d, 12);
    let q = gauss(h * t * d, 13);
    let mut chunked = f.create(0, &g).unwrap();
    chunked
        .append(
            &Tensor::from_vec(k.clone(), (kvh, t, d), &dev).unwrap(),
            &Tensor::from_vec(v.clone(), (kvh, t, d), &dev).unwrap(),
        )
        .unwrap();
    let a = chunked
        .attend(
            &Tensor::from_vec(q.clone(), (h, t, d), &dev).unwrap(),
            0.125,
        )
        .unwrap();
    let mut stepped = f.create(0, &g).unwrap();
    let kt = Tensor::from_vec(k, (kvh, t, d), &dev).unwrap();
    let vt = Tensor::from_vec(v, (kvh, t, d), &dev).unwrap();
    let qt = Tensor::from_vec(q, (h, t, d), &dev).unwrap();
    for i in 0..t {
        stepped
            .append(&kt.narrow(1, i, 1).unwrap(), &vt.narrow(1, i, 1).unwrap())
            .unwrap();
        let b = stepped
            .attend(&qt.narrow(1, i, 1).unwrap().contiguous().unwrap(), 0.125)
            .unwrap();
        let ai = a.narrow(1, i, 1).unwrap();
        let diff = (ai - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(diff < 1e-5, "row {i}: {diff}");
    }
}

#[test]
fn resident_bytes_match_the_packed_size() {
    let g = CacheGeometry {
        max_tokens: 8192,
        ..geom()
    };
    let bits = 3;
    let f = TurboQuantMseFactory::new(bits);
    let mut cache = f.create(0, &g).unwrap();
    let dev = Device::Cpu;
    let len = 8192 - 64;
    let (kvh, d) = (g.n_kv_heads, g.head_dim);
    let k = Tensor::from_vec(gauss(kvh * len * d, 1), (kvh, len, d), &dev).unwrap();
    cache.append(&k, &k).unwrap();
    let one = Tensor::from_vec(gauss(kvh * d, 2), (kvh, 1, d), &dev).unwrap();
    for _ in 0..64 {
        cache.append(&one, &one).unwrap();
    }
    let n = cache.len();
    // Promised: per token and head, 2 bytes of norm + d * bits / 8 for keys and for values,
    // plus the fp16 window.
    let promised = kvh * (n * 2 * (2 + d * bits as usize / 8) + 2 * 64 * d * 2);
    let got = cache.resident_bytes();
    let ratio = got as f64 / promised as f64;
    assert!(
        (0.95..=1.05).contains(&ratio),
        "resident {got} vs promised {promised}"
    );
}
