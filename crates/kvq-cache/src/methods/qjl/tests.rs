//! QJL tests: value group codes round trip, the key estimate is unbiased over sketch seeds,
//! attention close to exact attention and better with more bits, the window and sinks exact,
//! prefill equivalent to generation, the fused op equal to its reference, resident bytes as
//! promised, and the bits accounting of the module doc.

use super::*;
use crate::compressed::{KeyCodec, ValueCodec};
use crate::testkit::{
    attention_error, gauss, geom, mean_and_se, op_vs_reference, pairs, prefill_vs_steps,
    resident_ratio, seed_averaged_error,
};
use proptest::prelude::*;

proptest! {
    #[test]
    fn value_groups_round_trip(
        bits in proptest::sample::select(VALUE_BITS.to_vec()),
        gexp in 3u32..=6,
        raw in proptest::collection::vec(-20f32..20.0, 64),
    ) {
        let group = 1usize << gexp;
        let c = GroupCodec::new(64, bits, group).unwrap();
        let mut code = vec![0u8; ValueCodec::code_bytes(&c)];
        ValueCodec::encode(&c, 0, &raw, &mut code);
        let mut dec = vec![0f32; 64];
        ValueCodec::decode(&c, 0, &code, &mut dec);
        let levels = ((1u32 << bits) - 1) as f32;
        for (xs, ys) in raw.chunks(group).zip(dec.chunks(group)) {
            let lo = xs.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            // Min-max gives each value within half a step (plus fp16 rounding of the scale and
            // minimum); the 2-bit range search may clip, but never has a larger squared error.
            let half = (hi - lo) / levels * 0.5 + 0.02;
            if bits > 2 {
                for (x, y) in xs.iter().zip(ys) {
                    prop_assert!((x - y).abs() <= half, "{} vs {} (tol {})", x, y, half);
                }
            }
            let sse: f32 = xs.iter().zip(ys).map(|(x, y)| (x - y).powi(2)).sum();
            prop_assert!(sse <= xs.len() as f32 * half * half, "sse {}", sse);
        }
        // Re-encoding the reconstruction keeps it (codes and parameters are a fixed point).
        let mut again = vec![0u8; code.len()];
        ValueCodec::encode(&c, 0, &dec, &mut again);
        let mut dec2 = vec![0f32; 64];
        ValueCodec::decode(&c, 0, &again, &mut dec2);
        for (a, b) in dec.iter().zip(&dec2) {
            prop_assert!((a - b).abs() <= 0.02 * (1.0 + a.abs()), "{} vs {}", a, b);
        }
        // accumulate + finish with weights equals the weighted decodes.
        let mut acc = vec![0f32; c.acc_len()];
        let two: Vec<u8> = code.iter().chain(&again).copied().collect();
        c.accumulate(0, &[0.25, 0.75], &two, &mut acc);
        let mut out = vec![0f32; 64];
        c.finish(0, &acc, &mut out);
        for ((o, a), b) in out.iter().zip(&dec).zip(&dec2) {
            let want = 0.25 * a + 0.75 * b;
            prop_assert!((o - want).abs() <= 1e-4 * (1.0 + want.abs()));
        }
    }

    #[test]
    fn key_codes_round_trip_through_decode(seed in any::<u64>(), outliers in 0usize..4) {
        // scores() equals the inner product with decode(): the estimate is linear in q.
        let c = QjlKeyCodec::new(64, 1, 96, outliers, 0, seed).unwrap();
        let (q, k) = (gauss(64, seed ^ 1), gauss(64, seed ^ 2));
        let mut code = vec![0u8; c.code_bytes()];
        c.encode(0, &k, &mut code);
        let mut state = vec![0f32; c.state_len()];
        c.prepare(0, &q, &mut state);
        let mut s = [0f32];
        c.scores(0, &state, &code, &mut s);
        let mut dec = vec![0f32; 64];
        KeyCodec::decode(&c, 0, &code, &mut dec);
        let via: f32 = q.iter().zip(&dec).map(|(a, b)| a * b).sum();
        prop_assert!((s[0] - via).abs() <= 1e-3 * (1.0 + via.abs()), "{} {}", s[0], via);
    }
}

#[test]
fn trimmed_two_bit_values_beat_min_max() {
    // RMS reconstruction error of 2-bit groups of 32 Gaussians (2000 rows): the trimmed range
    // search against plain min-max quantization.
    let c = GroupCodec::new(64, 2, 32).unwrap();
    let (mut ours, mut minmax) = (0f64, 0f64);
    for i in 0..2000 {
        let x = gauss(64, 500 + i);
        let mut code = vec![0u8; ValueCodec::code_bytes(&c)];
        ValueCodec::encode(&c, 0, &x, &mut code);
        let mut dec = vec![0f32; 64];
        ValueCodec::decode(&c, 0, &code, &mut dec);
        ours += x
            .iter()
            .zip(&dec)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum::<f64>();
        for g in x.chunks(32) {
            let lo = g.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = g.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let s = (hi - lo) / 3.0;
            minmax += g
                .iter()
                .map(|&v| ((lo + s * ((v - lo) / s).round() - v) as f64).powi(2))
                .sum::<f64>();
        }
    }
    let ratio = (ours / minmax).sqrt();
    eprintln!("2-bit values: trimmed / min-max RMS error {ratio:.3}");
    assert!(ratio < 0.85, "{ratio}");
}

#[test]
fn key_estimate_is_unbiased_over_sketch_seeds() {
    // 10000 independent sketch matrices per (q, k) pair; the mean estimate must be within 3
    // standard errors of the exact q . k, with and without exact outlier channels.
    let (d, m, n) = (64, 64, 10_000);
    for outliers in [0, 2] {
        for (q, k) in pairs(d) {
            let exact: f64 = q.iter().zip(&k).map(|(a, b)| (a * b) as f64).sum();
            let (mean, se) = mean_and_se(n, |seed| {
                let c = QjlKeyCodec::new(d, 1, m, outliers, 0, seed).unwrap();
                let mut code = vec![0u8; c.code_bytes()];
                c.encode(0, &k, &mut code);
                let mut state = vec![0f32; c.state_len()];
                c.prepare(0, &q, &mut state);
                let mut s = [0f32];
                c.scores(0, &state, &code, &mut s);
                s[0] as f64
            });
            assert!(
                (mean - exact).abs() < 3.0 * se,
                "outliers {outliers}: mean {mean} vs exact {exact} (se {se})"
            );
        }
    }
}

#[test]
fn bits_accounting_matches_the_module_doc() {
    let g = geom();
    for (bits, m, kb, vb) in [
        (2u32, 80usize, 12usize, 20usize),
        (3, 184, 28, 20),
        (4, 240, 44, 20),
    ] {
        let f = QjlFactory::new(bits);
        let (k, v) = f.codecs(0, &g).unwrap();
        assert_eq!(k.sketch_dim(), m, "bits {bits}");
        assert_eq!(
            (KeyCodec::code_bytes(&k), ValueCodec::code_bytes(&v)),
            (kb, vb)
        );
        // Average bits per element over keys and values, norms and scales included.
        let avg = (kb + vb) as f64 * 8.0 / (2.0 * 64.0);
        assert!((avg - bits as f64).abs() <= 0.125, "bits {bits}: {avg}");
    }
    // qjl-3bit at d = 64 is exactly 3.0; at d = 128, 408 sign bits.
    let f = QjlFactory::new(3);
    assert_eq!(f.sketch_dim_for(128).unwrap(), 408);
    assert!(QjlFactory::new(2).sketch_dim_for(8).is_err());
}

/// The seed-averaged attention error of `f` (window 8, 300 compressed tokens; see the testkit).
fn qjl_error(f: &QjlFactory, shape: impl Fn(&mut [f32]) + Copy) -> f32 {
    seed_averaged_error(
        |seed| QjlFactory {
            seed,
            window: 8,
            ..f.clone()
        },
        shape,
    )
}

#[test]
fn attention_error_shrinks_with_bits() {
    // Relative L2 error of a decode step's attention output against exact attention: Gaussian
    // q, k, v at d = 64, scale 1/8, 300 compressed tokens, averaged over 4 sketch seeds and 2
    // data seeds.
    let err = |bits: u32| qjl_error(&QjlFactory::new(bits), |_| {});
    let (e2, e3, e4) = (err(2), err(3), err(4));
    eprintln!("qjl attention relative error: 2 bits {e2:.4}, 3 bits {e3:.4}, 4 bits {e4:.4}");
    assert!(e4 < e3 && e3 < e2, "{e2} {e3} {e4}");
    // The sketch's noise is about sqrt(pi/2 * d/m) of the score's spread (0.75 at m = 176,
    // d = 64); trimmed 2-bit values add about 0.33 (both measured alone with the other exact).
    assert!(e2 < 1.4 && e3 < 1.0 && e4 < 0.8, "{e2} {e3} {e4}");
}

#[test]
fn four_bits_go_to_the_keys() {
    // At 4 bits per element, 2-bit values + a 5.5-bit key part (m = 240) beat 4-bit values + a
    // 3.5-bit key part (m = 112): bits go to the keys, as `QjlFactory::new(4)` has it (on
    // SmolLM2 too, see the module doc).
    let chosen = QjlFactory::new(4);
    let other = QjlFactory {
        value_bits: 4,
        ..chosen.clone()
    };
    let (a, b) = (qjl_error(&chosen, |_| {}), qjl_error(&other, |_| {}));
    eprintln!("4 bits: values 2 + keys 5 -> {a:.4}; values 4 + keys 3 -> {b:.4}");
    assert!(a < 0.9 * b, "{a} vs {b}");
}

#[test]
fn outliers_help_keys_with_outlier_channels() {
    // Equal budget (3 bits per element): 4 exact outlier channels cost 96 sign bits (m = 208
    // -> 112).
    // Raw keys: these are zero-mean, so a center (the mean of 16 of them) only adds its noise.
    let plain = QjlFactory {
        outliers: 0,
        center_keys: false,
        ..QjlFactory::new(3)
    };
    let with = QjlFactory {
        outliers: 4,
        ..plain.clone()
    };
    // Keys whose channels 3, 17, 40, 41 are 8x larger (as in real LLM keys).
    let spiky = |row: &mut [f32]| [3, 17, 40, 41].iter().for_each(|&c| row[c] *= 8.0);
    let (g0, g4) = (qjl_error(&plain, |_| {}), qjl_error(&with, |_| {}));
    let (s0, s4) = (qjl_error(&plain, spiky), qjl_error(&with, spiky));
    eprintln!(
        "outliers 0 -> 4: gaussian keys {g0:.4} -> {g4:.4}; outlier channels {s0:.4} -> {s4:.4}"
    );
    // On Gaussian keys they neither help nor hurt much (0.80 -> 0.80); with outlier channels
    // they cut the error by a fifth (0.81 -> 0.65).
    assert!(s4 < 0.85 * s0, "{s0} -> {s4}");
    assert!((g4 - g0).abs() < 0.1 * g0, "{g0} -> {g4}");
}

fn windowed(window: usize, sinks: usize) -> QjlFactory {
    QjlFactory {
        window,
        sinks,
        ..QjlFactory::new(2)
    }
}

#[test]
fn window_and_sinks_are_exact_up_to_f16() {
    assert!(attention_error(&windowed(1000, 0), 300, 1) < 2e-3);
    assert!(attention_error(&windowed(1, 400), 300, 1) < 2e-3);
}

#[test]
fn prefill_rows_see_what_generation_would() {
    for outliers in [0, 2] {
        let f = QjlFactory {
            outliers,
            ..windowed(16, 2)
        };
        let diff = prefill_vs_steps(&f);
        assert!(diff < 1e-5, "outliers {outliers}: {diff}");
    }
}

#[test]
fn fused_op_matches_the_reference() {
    let g = geom();
    for (bits, outliers) in [(2, 0), (3, 0), (4, 0), (3, 3)] {
        let f = QjlFactory {
            outliers,
            ..QjlFactory::new(bits)
        };
        let (k, v) = f.codecs(0, &g).unwrap();
        let err = op_vs_reference(Arc::new(k), Arc::new(v));
        assert!(err < 1e-4, "bits {bits} outliers {outliers}: {err}");
    }
}

#[test]
fn resident_bytes_match_the_packed_size() {
    for bits in [2, 3, 4] {
        let f = QjlFactory::new(bits);
        let (k, v) = f.codecs(0, &geom()).unwrap();
        let ratio = resident_ratio(&f, KeyCodec::code_bytes(&k), ValueCodec::code_bytes(&v));
        assert!((0.95..=1.05).contains(&ratio), "bits {bits}: {ratio}");
    }
}

#[test]
fn registry_params_shape_the_codecs() {
    let mut params = toml::Table::new();
    params.insert("sketch_dim".into(), toml::Value::Integer(128));
    params.insert("value_bits".into(), toml::Value::Integer(4));
    params.insert("group_size".into(), toml::Value::Integer(16));
    params.insert("window".into(), toml::Value::Integer(32));
    params.insert("outliers".into(), toml::Value::Integer(0));
    fn args(bits: Option<u8>, params: &toml::Table) -> BuildArgs<'_> {
        BuildArgs {
            request_bits: bits,
            preset_bits: None,
            params,
            calibration: None,
        }
    }
    let f = QjlFactory::from_args(&args(None, &params)).unwrap();
    assert_eq!(f.sketch, SketchSize::Fixed(128));
    assert_eq!((f.value_bits, f.group_size, f.window), (4, 16, 32));
    // Request bits re-derive m from the budget; the other params stay.
    let f = QjlFactory::from_args(&args(Some(4), &params)).unwrap();
    assert_eq!(f.sketch, SketchSize::Budget(4));
    // 4 bits, 4-bit values in groups of 16 (6 bits each): 2 bits per key element.
    assert_eq!(f.sketch_dim_for(64).unwrap(), 112);
    params.insert("value_bits".into(), toml::Value::Integer(3));
    assert!(QjlFactory::from_args(&args(None, &params)).is_err());
    params.insert("value_bits".into(), toml::Value::Integer(4));
    assert!(QjlFactory::from_args(&args(Some(2), &params)).is_err());
    params.insert("sketch_dim".into(), toml::Value::Integer(1 << 20));
    assert!(QjlFactory::from_args(&args(None, &params)).is_err());
}
