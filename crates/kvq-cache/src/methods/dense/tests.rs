//! Dense cache tests: attention against the exact reference, block growth, truncation.

use super::*;
use crate::CacheError;
use crate::attention::attention_reference;

fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    // xorshift: deterministic, no dependency.
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 20_000) as f32 / 10_000.0 - 1.0
        })
        .collect()
}

fn geom(window: Option<usize>) -> CacheGeometry {
    CacheGeometry {
        n_heads: 6,
        n_kv_heads: 2,
        head_dim: 16,
        sliding_window: window,
        max_tokens: 4096,
    }
}

/// Appends `chunks` of positions, attends after each, and compares with the reference on the
/// f16-rounded keys and values.
fn check(chunks: &[usize], window: Option<usize>) {
    check_with::<f16>(chunks, window, |x| f16::from_f32(x).to_f32(), 1e-4);
    check_with::<f32>(chunks, window, |x| x, 1e-5);
}

fn check_with<E: Element>(
    chunks: &[usize],
    window: Option<usize>,
    round: fn(f32) -> f32,
    tol: f32,
) {
    let g = geom(window);
    let (h, kvh, d) = (g.n_heads, g.n_kv_heads, g.head_dim);
    let mut cache = DenseCache::<E>::new(g);
    let mut all_k: Vec<Vec<f32>> = vec![Vec::new(); kvh];
    let mut all_v: Vec<Vec<f32>> = vec![Vec::new(); kvh];
    let dev = Device::Cpu;
    for (c, &t) in chunks.iter().enumerate() {
        let k = rand_vec(kvh * t * d, 3 * c as u64 + 1);
        let v = rand_vec(kvh * t * d, 3 * c as u64 + 2);
        let q = rand_vec(h * t * d, 3 * c as u64 + 3);
        for hh in 0..kvh {
            all_k[hh].extend(k[hh * t * d..(hh + 1) * t * d].iter().map(|&x| round(x)));
            all_v[hh].extend(v[hh * t * d..(hh + 1) * t * d].iter().map(|&x| round(x)));
        }
        let kt = Tensor::from_vec(k, (kvh, t, d), &dev).unwrap();
        let vt = Tensor::from_vec(v, (kvh, t, d), &dev).unwrap();
        let qt = Tensor::from_vec(q.clone(), (h, t, d), &dev).unwrap();
        cache.append(&kt, &vt).unwrap();
        let out = cache.attend(&qt, 0.25).unwrap();
        let out = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let len = cache.len();
        let kf: Vec<f32> = all_k.concat();
        let vf: Vec<f32> = all_v.concat();
        let want = attention_reference(&q, &kf, &vf, h, kvh, t, len, d, 0.25, window);
        let err = out
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            err < tol,
            "{} chunk {c} (t={t}, len={len}): max error {err}",
            E::METHOD
        );
    }
}

#[test]
fn decode_steps_match_reference() {
    check(&[1; 20], None);
}

#[test]
fn prefill_then_decode_across_blocks() {
    check(&[300, 1, 1, 40, 1], None);
}

#[test]
fn long_decode_in_parallel_spans_matches_reference() {
    // 700 positions: six spans per kv head, enough work for the pool; a few rows at once
    // (speculative-sized chunks) take the same path with per-row causal ranges.
    check(&[700, 1, 5, 1, 8], None);
    // The window starts mid-span and the rows' windows differ.
    check(&[700, 1, 6, 1], Some(200));
}

#[test]
fn prompt_tiles_match_reference() {
    // Chunks over the decode loop's 8 rows take the tiles: ragged last tiles, chunks that start
    // mid-block and mid-span, a window shorter than a tile's positions and one longer.
    check(&[37, 300, 19, 9, 1], None);
    check(&[37, 300, 19, 9, 1], Some(11));
    check(&[129, 257], Some(150));
}

#[test]
fn sliding_window_matches_reference() {
    check(&[100, 1, 1, 30, 1], Some(32));
}

#[test]
fn grows_in_blocks_and_truncates() {
    let g = geom(None);
    let mut cache = Fp16Cache::new(g);
    let dev = Device::Cpu;
    let block_bytes = 2 * g.n_kv_heads * BLOCK_TOKENS * g.head_dim * 2;
    assert_eq!(cache.resident_bytes(), 0);
    let k = Tensor::zeros((2, 1, 16), DType::F32, &dev).unwrap();
    cache.append(&k, &k).unwrap();
    assert_eq!(cache.resident_bytes(), block_bytes);
    let k = Tensor::zeros((2, BLOCK_TOKENS, 16), DType::F32, &dev).unwrap();
    cache.append(&k, &k).unwrap();
    assert_eq!(cache.len(), BLOCK_TOKENS + 1);
    assert_eq!(cache.resident_bytes(), 2 * block_bytes);
    cache.truncate(10).unwrap();
    assert_eq!(cache.len(), 10);
    assert_eq!(cache.resident_bytes(), block_bytes);
}

#[test]
fn rejects_wrong_shapes() {
    let mut cache = Fp16Cache::new(geom(None));
    let dev = Device::Cpu;
    let bad = Tensor::zeros((3, 1, 16), DType::F32, &dev).unwrap();
    assert!(matches!(
        cache.append(&bad, &bad),
        Err(CacheError::Shape(_))
    ));
    let q = Tensor::zeros((6, 1, 16), DType::F32, &dev).unwrap();
    assert!(matches!(cache.attend(&q, 1.0), Err(CacheError::Shape(_))));
}

#[test]
fn device_mask_equals_host_mask() {
    let dev = candle_core::Device::Cpu;
    for (t, len, from, window) in [
        (1, 1, 0, None),
        (5, 40, 0, None),
        (7, 40, 12, Some(9)),
        (16, 16, 0, Some(1)),
        (3, 1000, 990, Some(4)),
    ] {
        let want = causal_mask(t, len, from, window, &dev).expect("host mask");
        let got = device::causal_mask_on(t, len, from, window, &dev).expect("tensor mask");
        let (a, b) = (
            want.flatten_all().and_then(|x| x.to_vec1::<f32>()),
            got.flatten_all().and_then(|x| x.to_vec1::<f32>()),
        );
        assert_eq!(
            a.expect("host"),
            b.expect("tensor"),
            "t {t} len {len} from {from} {window:?}"
        );
    }
}
