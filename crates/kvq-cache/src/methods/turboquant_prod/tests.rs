//! TurboQuant-Prod tests: the key estimate is unbiased over seeds and linear in the query,
//! attention close to exact attention and better with more bits, the window and sinks exact,
//! prefill equivalent to generation, the fused op equal to its reference, resident bytes as
//! promised.

use super::*;
use crate::compressed::CodecFactory;
use crate::compressed::ValueCodec;
use crate::testkit::{
    attention_error, gauss, geom, mean_and_se, op_vs_reference, pairs, prefill_vs_steps,
    resident_ratio, seed_averaged_error,
};
use proptest::prelude::*;
use std::sync::Arc;

fn estimate(c: &ProdKeyCodec, q: &[f32], k: &[f32]) -> f32 {
    let mut code = vec![0u8; c.code_bytes()];
    c.encode(0, k, &mut code);
    let mut state = vec![0f32; c.state_len()];
    c.prepare(0, q, &mut state);
    let mut s = [0f32];
    c.scores(0, &state, &code, &mut s);
    s[0]
}

proptest! {
    #[test]
    fn scores_equal_the_decoded_key_product(seed in any::<u64>(), bits in 2u32..=5) {
        let c = ProdKeyCodec::new(64, 1, bits, 0, seed).unwrap();
        let (q, k) = (gauss(64, seed ^ 1), gauss(64, seed ^ 2));
        let s = estimate(&c, &q, &k);
        let mut code = vec![0u8; c.code_bytes()];
        c.encode(0, &k, &mut code);
        let mut dec = vec![0f32; 64];
        c.decode(0, &code, &mut dec);
        let via: f32 = q.iter().zip(&dec).map(|(a, b)| a * b).sum();
        prop_assert!((s - via).abs() <= 1e-3 * (1.0 + via.abs()), "{} {}", s, via);
    }
}

#[test]
fn key_estimate_is_unbiased_over_seeds() {
    // 10000 independent seeds (rotation and sketch matrix) per (q, k) pair and per key_bits;
    // the mean estimate must be within 3 standard errors of the exact q . k.
    let (d, n) = (64, 10_000);
    for bits in [2, 3] {
        for (q, k) in pairs(d) {
            let exact: f64 = q.iter().zip(&k).map(|(a, b)| (a * b) as f64).sum();
            let (mean, se) = mean_and_se(n, |seed| {
                let c = ProdKeyCodec::new(d, 1, bits, 0, seed).unwrap();
                estimate(&c, &q, &k) as f64
            });
            assert!(
                (mean - exact).abs() < 3.0 * se,
                "key_bits {bits}: mean {mean} vs exact {exact} (se {se})"
            );
        }
    }
}

#[test]
fn code_sizes_are_as_documented() {
    for bits in [2u32, 3, 4] {
        let (k, v) = TurboQuantProdFactory::new(bits).codecs(0, &geom()).unwrap();
        let kb = 4 + 8 * bits as usize;
        assert_eq!(KeyCodec::code_bytes(&k), kb);
        assert_eq!(ValueCodec::code_bytes(&v), kb - 2);
    }
}

#[test]
fn attention_error_shrinks_with_bits() {
    // Relative L2 error of a decode step's attention output against exact attention: Gaussian
    // q, k, v at d = 64, scale 1/8, 300 compressed tokens, averaged over 4 method seeds and 2
    // data seeds.
    let err = |bits: u32| {
        let make = |seed| TurboQuantProdFactory {
            seed,
            window: 8,
            ..TurboQuantProdFactory::new(bits)
        };
        seed_averaged_error(make, |_| {})
    };
    let (e2, e3, e4) = (err(2), err(3), err(4));
    eprintln!(
        "turboquant-prod attention relative error: 2 bits {e2:.4}, 3 bits {e3:.4}, 4 bits {e4:.4}"
    );
    assert!(e4 < e3 && e3 < e2, "{e2} {e3} {e4}");
    // The 1-bit residual sketch (m = d) adds noise of about sqrt(pi/2 * mse(b-1)) of the score's
    // spread, so at equal bits Prod is noisier than TurboQuant-MSE (3 bits: about 0.25).
    assert!(e2 < 1.0 && e3 < 0.6 && e4 < 0.3, "{e2} {e3} {e4}");
}

#[test]
fn window_and_sinks_are_exact_up_to_f16() {
    let f = |window, sinks| TurboQuantProdFactory {
        window,
        sinks,
        ..TurboQuantProdFactory::new(2)
    };
    assert!(attention_error(&f(1000, 0), 300, 1) < 2e-3);
    assert!(attention_error(&f(1, 400), 300, 1) < 2e-3);
}

#[test]
fn prefill_rows_see_what_generation_would() {
    let f = TurboQuantProdFactory {
        window: 16,
        sinks: 2,
        ..TurboQuantProdFactory::new(3)
    };
    let diff = prefill_vs_steps(&f);
    assert!(diff < 1e-5, "{diff}");
}

#[test]
fn fused_op_matches_the_reference() {
    for bits in [2, 3, 4] {
        let (k, v) = TurboQuantProdFactory::new(bits).codecs(0, &geom()).unwrap();
        let err = op_vs_reference(Arc::new(k), Arc::new(v));
        assert!(err < 1e-4, "bits {bits}: {err}");
    }
}

#[test]
fn resident_bytes_match_the_packed_size() {
    for bits in [2, 3, 4] {
        let f = TurboQuantProdFactory::new(bits);
        let (k, v) = f.codecs(0, &geom()).unwrap();
        let ratio = resident_ratio(&f, KeyCodec::code_bytes(&k), ValueCodec::code_bytes(&v));
        assert!((0.95..=1.05).contains(&ratio), "bits {bits}: {ratio}");
    }
}

#[test]
fn bits_select_key_and_value_bits() {
    let build = |bits: Option<u8>, params: &toml::Table| {
        (entry().build)(&crate::registry::BuildArgs {
            request_bits: bits,
            preset_bits: None,
            params,
            calibration: None,
        })
    };
    let mut params = toml::Table::new();
    assert!(build(Some(3), &params).is_ok());
    params.insert("key_bits".into(), toml::Value::Integer(6));
    assert!(build(None, &params).is_err());
    params.insert("key_bits".into(), toml::Value::Integer(5));
    params.insert("value_bits".into(), toml::Value::Integer(4));
    assert!(build(None, &params).is_ok());
    params.insert("value_bits".into(), toml::Value::Integer(0));
    assert!(build(None, &params).is_err());
}

#[test]
fn preset_bits_fill_the_part_it_does_not_set() {
    let params: toml::Table = toml::from_str("value_bits = 3\nwindow = 8").unwrap();
    let args = |request_bits, preset_bits| crate::registry::BuildArgs {
        request_bits,
        preset_bits,
        params: &params,
        calibration: None,
    };
    // A preset with `bits = 4` and an explicit `value_bits = 3`: 4-bit keys, 3-bit values.
    let f = TurboQuantProdFactory::from_args(&args(None, Some(4))).unwrap();
    assert_eq!((f.key_bits, f.value_bits, f.window), (4, 3, 8));
    // Request bits override both parts; the other params stay.
    let f = TurboQuantProdFactory::from_args(&args(Some(2), Some(4))).unwrap();
    assert_eq!((f.key_bits, f.value_bits, f.window), (2, 2, 8));
    // Neither: the method's default (3) for the part the preset leaves out.
    let f = TurboQuantProdFactory::from_args(&args(None, None)).unwrap();
    assert_eq!((f.key_bits, f.value_bits), (3, 3));
}
