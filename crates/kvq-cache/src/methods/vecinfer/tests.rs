//! VecInfer tests on synthetic keys with outlier channels: the fused op against
//! `kvq_kernels::attend_reference`, LUT scores against decoded keys, PQ code round trips
//! (proptest), both value accumulations, resident bytes as promised, generation-equivalent
//! prefill, the calibration file round trip and the registry entry. Attention on real SmolLM2
//! keys is tested in tests/tests/vecinfer.rs.

use super::calibration::{
    CalibrationMeta, FORMAT, FixedCalibration, Smoothing, TrainOptions, train_layer, utc_now,
};
use super::capture::{CaptureFactory, LayerCapture};
use super::*;
use crate::attention::attention_reference;
use crate::codec::kmeans::KMeansConfig;
use crate::compressed::{KeyCodec, ValueCodec};
use crate::registry::{BuildArgs, CalibrationSource};
use crate::testkit::gauss;
use crate::traits::CacheFactory;
use candle_core::{Device, Tensor};
use kvq_kernels::{AttendParams, attend_reference, compressed_attend, encode_keys, encode_values};
use proptest::prelude::*;
use std::sync::OnceLock;

const KVH: usize = 2;
const HEADS: usize = 4;
const D: usize = 64;
const LAYERS: usize = 2;

/// Keys `[KVH, t, D]` with a few outlier channels (as real keys have), values plain Gaussian.
fn keys(t: usize, seed: u64) -> Vec<f32> {
    let mut k = gauss(KVH * t * D, seed);
    for (i, x) in k.iter_mut().enumerate() {
        if matches!(i % D, 3 | 17 | 40) {
            *x *= 8.0;
        }
    }
    k
}

fn geom(max_tokens: usize) -> CacheGeometry {
    CacheGeometry {
        n_heads: HEADS,
        n_kv_heads: KVH,
        head_dim: D,
        sliding_window: None,
        max_tokens,
    }
}

/// A calibration trained on 2000 synthetic tokens per layer (both sub_dims), built once.
fn calibration() -> Arc<VecInferCalibration> {
    static CAL: OnceLock<Arc<VecInferCalibration>> = OnceLock::new();
    CAL.get_or_init(|| {
        let t = 2000;
        let opts = TrainOptions {
            sub_dims: vec![4, 8],
            kmeans: KMeansConfig {
                iters: 10,
                max_samples: 16_384,
                ..KMeansConfig::default()
            },
            seed: DEFAULT_SEED,
            smoothing: Smoothing::KeyMax,
            per_position: true,
        };
        let layers = (0..LAYERS)
            .map(|l| {
                let (k, v) = (keys(t, 10 + l as u64), gauss(KVH * t * D, 20 + l as u64));
                let cap = LayerCapture {
                    n_kv_heads: KVH,
                    n_heads: HEADS,
                    head_dim: D,
                    keys: k.chunks(t * D).map(<[f32]>::to_vec).collect(),
                    values: v.chunks(t * D).map(<[f32]>::to_vec).collect(),
                    queries: vec![],
                };
                train_layer(l, &cap, &opts).unwrap()
            })
            .collect();
        Arc::new(VecInferCalibration {
            meta: meta("synthetic-hash"),
            layers,
        })
    })
    .clone()
}

fn meta(hash: &str) -> CalibrationMeta {
    CalibrationMeta {
        format: FORMAT,
        method: METHOD.into(),
        model_hash: hash.into(),
        model_name: "synthetic".into(),
        text_name: "gauss".into(),
        text_sha256: "-".into(),
        tokens: 2000,
        sub_dims: vec![4, 8],
        centroids: 256,
        seed: DEFAULT_SEED,
        smoothing: "key-max".into(),
        per_position: true,
        n_layers: LAYERS,
        n_kv_heads: KVH,
        head_dim: D,
        kmeans_samples: 16_384,
        kmeans_iters: 10,
        date: utc_now(),
        kvq_version: env!("CARGO_PKG_VERSION").into(),
        seconds: 0.0,
    }
}

fn factory(sub: usize) -> VecInferFactory {
    VecInferFactory::new(calibration(), sub, DEFAULT_SEED).unwrap()
}

fn tensor(v: Vec<f32>, shape: (usize, usize, usize)) -> Tensor {
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

#[test]
fn op_matches_attend_reference() {
    for sub in [4, 8] {
        let (kc, vc) = factory(sub).codecs(1, &geom(4096)).unwrap();
        let (kc, vc): (Arc<dyn KeyCodec>, Arc<dyn ValueCodec>) = (Arc::new(kc), Arc::new(vc));
        let n = 600;
        let kcodes = encode_keys(&kc, &tensor(keys(n, 5), (KVH, n, D))).unwrap();
        let vcodes = encode_values(&vc, &tensor(gauss(KVH * n * D, 6), (KVH, n, D))).unwrap();
        let t = 3;
        let q = gauss(HEADS * t * D, 7);
        // Long and short compressed ranges: both value accumulations run.
        for window in [8, 500] {
            let p = AttendParams {
                scale: 0.125,
                first_pos: n - t,
                window,
                sinks: 2,
                sliding_window: None,
                code_first: 0,
                exact_before: 0,
            };
            let got = compressed_attend(
                &kc,
                &vc,
                p,
                &tensor(q.clone(), (HEADS, t, D)),
                &kcodes,
                &vcodes,
            )
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
            let kb = kcodes.flatten_all().unwrap().to_vec1::<u8>().unwrap();
            let vb = vcodes.flatten_all().unwrap().to_vec1::<u8>().unwrap();
            let want = attend_reference(kc.as_ref(), vc.as_ref(), p, &q, HEADS, &kb, &vb, KVH);
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-4 * b.abs().max(1.0),
                    "sub {sub} window {window} [{i}]: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn lut_scores_equal_dot_products_with_decoded_keys() {
    let (kc, _) = factory(4).codecs(0, &geom(64)).unwrap();
    let k = keys(20, 8);
    let q = gauss(D, 9);
    let mut state = vec![0f32; kc.state_len()];
    for h in 0..KVH {
        kc.prepare(h, &q, &mut state);
        let mut codes = vec![0u8; 20 * kc.code_bytes()];
        for (row, code) in k[h * 20 * D..(h + 1) * 20 * D]
            .chunks(D)
            .zip(codes.chunks_mut(16))
        {
            kc.encode(h, row, code);
        }
        let mut s = vec![0f32; 20];
        kc.scores(h, &state, &codes, &mut s);
        let mut dec = vec![0f32; D];
        for (j, code) in codes.chunks(16).enumerate() {
            kc.decode(h, code, &mut dec);
            let want: f32 = q.iter().zip(&dec).map(|(a, b)| a * b).sum();
            assert!(
                (s[j] - want).abs() < 1e-3 * want.abs().max(1.0),
                "{} vs {want}",
                s[j]
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// decode then encode gives the code back, for any code (keys and values, both sub_dims).
    #[test]
    fn pq_codes_round_trip(sub in prop::sample::select(vec![4usize, 8]), head in 0..KVH, layer in 0..LAYERS, seed in any::<u64>()) {
        let (kc, vc) = factory(sub).codecs(layer, &geom(64)).unwrap();
        let mut rng = crate::codec::rng::SplitMix::new(seed);
        let code: Vec<u8> = (0..D / sub).map(|_| rng.below(256) as u8).collect();
        let mut x = vec![0f32; D];
        let mut again = vec![0u8; D / sub];
        kc.decode(head, &code, &mut x);
        kc.encode(head, &x, &mut again);
        prop_assert_eq!(&again, &code);
        vc.decode(head, &code, &mut x);
        ValueCodec::encode(&vc, head, &x, &mut again);
        prop_assert_eq!(&again, &code);
    }
}

#[test]
fn gather_and_histogram_accumulate_the_same() {
    let f = factory(4);
    let (_, vc) = f.codecs(0, &geom(64)).unwrap();
    let n = 300;
    let v = gauss(n * D, 11);
    let mut codes = vec![0u8; n * 16];
    for (row, c) in v.chunks(D).zip(codes.chunks_mut(16)) {
        ValueCodec::encode(&vc, 0, row, c);
    }
    let probs: Vec<f32> = gauss(n, 12).iter().map(|x| x.abs() / n as f32).collect();
    let run = |accum| {
        let (_, vc) = VecInferFactory { accum, ..f.clone() }
            .codecs(0, &geom(64))
            .unwrap();
        let mut acc = vec![0f32; vc.acc_len()];
        vc.accumulate(0, &probs, &codes, &mut acc);
        let mut out = vec![0f32; D];
        vc.finish(0, &acc, &mut out);
        out
    };
    let (a, b) = (run(ValueAccum::Gather), run(ValueAccum::Histogram));
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() < 1e-5, "{x} vs {y}");
    }
}

/// Relative error of decode attention (window `window`) against exact attention.
fn attention_error(sub: usize, window: usize, len: usize) -> f32 {
    let g = geom(4096);
    let f = VecInferFactory {
        window,
        ..factory(sub)
    };
    let mut cache = f.create(1, &g).unwrap();
    let (k, v, q) = (
        keys(len, 30),
        gauss(KVH * len * D, 31),
        gauss(HEADS * D, 32),
    );
    // Queries correlated with keys give peaked attention, like a model's.
    cache
        .append(
            &tensor(k.clone(), (KVH, len, D)),
            &tensor(v.clone(), (KVH, len, D)),
        )
        .unwrap();
    let out = cache
        .attend(&tensor(q.clone(), (HEADS, 1, D)), 0.125)
        .unwrap();
    let out = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let want = attention_reference(&q, &k, &v, HEADS, KVH, 1, len, D, 0.125, None);
    let num: f32 = out.iter().zip(&want).map(|(a, b)| (a - b).powi(2)).sum();
    let den: f32 = want.iter().map(|b| b * b).sum();
    (num / den).sqrt()
}

#[test]
fn attention_error_is_small_and_grows_as_bits_fall() {
    let (e2, e1) = (attention_error(4, 1, 400), attention_error(8, 1, 400));
    assert!(e2 < e1, "2-bit {e2} vs 1-bit {e1}");
    // Gaussian data is VQ's worst case (no structure to learn) and these random queries give
    // very peaked attention, so the bounds are loose (TurboQuant-MSE at 3 bits, window 1: 0.71
    // here); tests/tests/vecinfer.rs measures real SmolLM2 keys.
    assert!(e2 < 0.6 && e1 < 1.0, "{e2} {e1}");
    assert!(
        attention_error(4, 1000, 400) < 2e-3,
        "window covering everything is fp16"
    );
}

#[test]
fn prefill_rows_see_what_generation_would() {
    let g = geom(4096);
    let f = VecInferFactory {
        window: 16,
        sinks: 2,
        ..factory(4)
    };
    let t = 50;
    let (k, v, q) = (
        keys(t, 40),
        gauss(KVH * t * D, 41),
        gauss(HEADS * t * D, 42),
    );
    let (kt, vt, qt) = (
        tensor(k, (KVH, t, D)),
        tensor(v, (KVH, t, D)),
        tensor(q, (HEADS, t, D)),
    );
    let mut chunked = f.create(0, &g).unwrap();
    chunked.append(&kt, &vt).unwrap();
    let a = chunked.attend(&qt, 0.125).unwrap();
    let mut stepped = f.create(0, &g).unwrap();
    for i in 0..t {
        stepped
            .append(&kt.narrow(1, i, 1).unwrap(), &vt.narrow(1, i, 1).unwrap())
            .unwrap();
        let b = stepped
            .attend(&qt.narrow(1, i, 1).unwrap().contiguous().unwrap(), 0.125)
            .unwrap();
        let diff = (a.narrow(1, i, 1).unwrap() - b).unwrap().abs().unwrap();
        let diff = diff.max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-5, "row {i}: {diff}");
    }
}

#[test]
fn resident_bytes_match_the_packed_size() {
    for sub in [4, 8] {
        let g = geom(8192);
        let mut cache = factory(sub).create(0, &g).unwrap();
        let len = 8192 - 64;
        let k = tensor(keys(len, 50), (KVH, len, D));
        cache.append(&k, &k).unwrap();
        // As a model does: each append is followed by its queries (here the last row only).
        let q = tensor(keys(1, 52), (KVH, 1, D))
            .repeat((g.n_heads / KVH, 1, 1))
            .unwrap();
        cache.attend(&q, 0.125).unwrap();
        let one = tensor(keys(1, 51), (KVH, 1, D));
        for _ in 0..64 {
            cache.append(&one, &one).unwrap();
            cache.attend(&q, 0.125).unwrap();
        }
        let n = cache.len();
        // Promised: d / sub one-byte indices per token and head for keys and for values (8 / sub
        // bits per element), plus the fp16 window of 64 tokens.
        let promised = KVH * (n * 2 * (D / sub) + 2 * 64 * D * 2);
        let got = cache.resident_bytes();
        let ratio = got as f64 / promised as f64;
        assert!(
            (0.95..=1.05).contains(&ratio),
            "sub {sub}: resident {got} vs promised {promised}"
        );
    }
}

#[test]
fn calibration_file_round_trips_and_rejects_another_model() {
    let dir = std::env::temp_dir().join(format!("kvq-vecinfer-cal-{}", std::process::id()));
    let cal = calibration();
    let (st, json) = cal.write(&dir, "vecinfer").unwrap();
    assert!(st.is_file() && json.is_file());
    let back = VecInferCalibration::read(&dir, "vecinfer", Some("synthetic-hash")).unwrap();
    assert_eq!(&back, cal.as_ref());
    let err = VecInferCalibration::read(&dir, "vecinfer", Some("another-model")).unwrap_err();
    assert!(
        err.to_string().contains("not for the loaded model"),
        "{err}"
    );
    // A metadata file swapped in from another model is caught by the hash in the tensors.
    let mut other = cal.meta.clone();
    other.model_hash = "another-model".into();
    std::fs::write(&json, serde_json::to_string(&other).unwrap()).unwrap();
    let err = VecInferCalibration::read(&dir, "vecinfer", Some("another-model")).unwrap_err();
    assert!(err.to_string().contains("different models"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn registry_entry_needs_a_calibration_and_maps_bits_to_sub_dim() {
    let params = toml::Table::new();
    let e = entry();
    let err = (e.build)(&BuildArgs {
        request_bits: None,
        preset_bits: None,
        params: &params,
        calibration: None,
    })
    .err()
    .unwrap();
    assert!(err.to_string().contains("kvq calibrate"), "{err}");
    let src: Arc<dyn CalibrationSource> = Arc::new(FixedCalibration(calibration()));
    for (bits, code) in [(Some(1), 8), (Some(2), 16), (None, 16)] {
        let f = (e.build)(&BuildArgs {
            request_bits: bits,
            preset_bits: None,
            params: &params,
            calibration: Some(&src),
        })
        .unwrap();
        let mut c = f.create(0, &geom(4096)).unwrap();
        let k = tensor(keys(300, 60), (KVH, 300, D));
        c.append(&k, &k).unwrap();
        let q = tensor(gauss(HEADS * D, 61), (HEADS, 1, D));
        c.attend(&q, 0.125).unwrap();
        // Key and value codes of 300 positions (grown to 512 rows) plus the fp16 window.
        let fp16 = 2 * KVH * 63 * D * 2;
        assert!(c.resident_bytes() >= 2 * KVH * 512 * code, "bits {bits:?}");
        assert!(
            c.resident_bytes() <= 2 * KVH * 512 * code + fp16 * 5 / 4,
            "bits {bits:?}"
        );
    }
    let mut p = toml::Table::new();
    p.insert("seed".into(), toml::Value::Integer(5));
    let err = (e.build)(&BuildArgs {
        request_bits: None,
        preset_bits: None,
        params: &p,
        calibration: Some(&src),
    })
    .err()
    .unwrap();
    assert!(err.to_string().contains("seed"), "{err}");
    // Too many layers for the calibration is an error at create time, not a panic.
    let f = (e.build)(&BuildArgs {
        request_bits: None,
        preset_bits: None,
        params: &params,
        calibration: Some(&src),
    })
    .unwrap();
    assert!(f.create(LAYERS, &geom(64)).is_err());
}

#[test]
fn capture_records_what_passes_through() {
    let f = CaptureFactory::new(true);
    let g = geom(64);
    let mut caches = crate::traits::LayerCaches::new(&f, &[g, g]).unwrap();
    let k = tensor(keys(5, 70), (KVH, 5, D));
    let q = tensor(gauss(HEADS * 5 * D, 71), (HEADS, 5, D));
    caches.layer(1).append(&k, &k).unwrap();
    caches.layer(1).attend(&q, 0.125).unwrap();
    let cap = f.take();
    assert_eq!((cap.len(), cap[1].tokens(), cap[0].tokens()), (2, 5, 0));
    assert_eq!(cap[1].queries[3].len(), 5 * D);
    assert_eq!(cap[1].keys[1], keys(5, 70)[5 * D..].to_vec());
}

#[test]
fn calibration_times_survive_the_json_round_trip() {
    // Without serde_json's `float_roundtrip` this value came back as 3.921515691, and a saved
    // calibration no longer equalled the one in memory (seen in CI).
    let seconds = 3.921_515_690_999_999_7_f64;
    let text = serde_json::to_string(&seconds).expect("json");
    let back: f64 = serde_json::from_str(&text).expect("json");
    assert_eq!(back.to_bits(), seconds.to_bits(), "{text}");
}
