//! Key centering in compressed caches: keys sharing a large common part (as Qwen2.5's k bias
//! gives them) attend as well as keys without it, and centering does not depend on how the
//! text was split into appends.

use crate::attention::attention_reference;
use crate::compressed::{CENTER_ROWS, CodecFactory, CompressedCache};
use crate::methods::qjl::QjlFactory;
use crate::methods::turboquant_mse::TurboQuantMseFactory;
use crate::methods::turboquant_prod::TurboQuantProdFactory;
use crate::testkit::{gauss, geom, tensor};
use crate::traits::KvCache;
use candle_core::Tensor;
use std::sync::Arc;

const T: usize = 300;

/// Rows `from..from + n` of every head of `x` (`[heads][len][d]`, d = 64), as a tensor.
fn rows(x: &[f32], heads: usize, len: usize, from: usize, n: usize) -> Tensor {
    let d = 64;
    let out: Vec<f32> = (0..heads)
        .flat_map(|h| {
            x[(h * len + from) * d..(h * len + from + n) * d]
                .iter()
                .copied()
        })
        .collect();
    tensor(&out, (heads, n, d))
}

/// Relative L2 distance of `got` from `want`.
fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| f64::from(a - b).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| f64::from(*b).powi(2)).sum();
    (num / den).sqrt()
}

fn cache<F: CodecFactory>(f: &F, centered: bool) -> CompressedCache {
    let (k, v) = f.codecs(0, &geom()).expect("codecs");
    CompressedCache::new(geom(), f.method(), Arc::new(k), Arc::new(v), 8, 2)
        .with_key_centering(centered.then_some(0.0))
}

/// Relative L2 error of the last query row's attention through `f`'s cache against exact
/// attention, with every key shifted by `offset` in each coordinate; averaged over 3 data seeds.
fn error<F: CodecFactory>(f: &F, centered: bool, offset: f32) -> f64 {
    let g = geom();
    let (h, kvh, d) = (g.n_heads, g.n_kv_heads, g.head_dim);
    let mut total = 0.0;
    for seed in 0..3u64 {
        let mut k = gauss(kvh * T * d, 10 * seed + 1);
        k.iter_mut().for_each(|x| *x += offset);
        let v = gauss(kvh * T * d, 10 * seed + 2);
        let q = gauss(h * d, 10 * seed + 3);
        let mut c = cache(f, centered);
        c.append(&tensor(&k, (kvh, T, d)), &tensor(&v, (kvh, T, d)))
            .expect("append");
        let got = c
            .attend(&tensor(&q, (h, 1, d)), 0.125)
            .and_then(|x| Ok(x.flatten_all()?.to_vec1::<f32>()?))
            .expect("attend");
        // One query row, at position T - 1.
        let want = attention_reference(&q, &k, &v, h, kvh, 1, T, d, 0.125, None);
        total += rel_l2(&got, &want);
    }
    total / 3.0
}

#[test]
fn a_common_part_of_the_keys_costs_nothing_when_centered() {
    // An offset of 3 per coordinate puts 90% of the keys' energy in their common part.
    let mse = TurboQuantMseFactory::new(3);
    let prod = TurboQuantProdFactory::new(3);
    let qjl = QjlFactory::new(3);
    let rows = [
        (
            "turboquant-mse 3-bit",
            [
                error(&mse, true, 0.0),
                error(&mse, true, 3.0),
                error(&mse, false, 3.0),
            ],
        ),
        (
            "turboquant-prod 3-bit",
            [
                error(&prod, true, 0.0),
                error(&prod, true, 3.0),
                error(&prod, false, 3.0),
            ],
        ),
        (
            "qjl 3-bit",
            [
                error(&qjl, true, 0.0),
                error(&qjl, true, 3.0),
                error(&qjl, false, 3.0),
            ],
        ),
    ];
    for (name, [plain, centered, raw]) in rows {
        eprintln!(
            "{name}: no offset {plain:.4}, offset centered {centered:.4}, offset raw {raw:.4}"
        );
        // The center is the mean of 64 keys, so it carries their noise: within 15%.
        assert!(centered < 1.15 * plain, "{name}: {centered} vs {plain}");
        // Measured: raw 2.4x (MSE), 3.6x (Prod), 2.0x (QJL) the centered error.
        assert!(
            raw > 1.8 * centered,
            "{name}: raw {raw} vs centered {centered}"
        );
    }
}

#[test]
fn centering_does_not_depend_on_how_the_text_was_split() {
    let g = geom();
    let (h, kvh, d) = (g.n_heads, g.n_kv_heads, g.head_dim);
    let t = CENTER_ROWS + 40;
    let mut k = gauss(kvh * t * d, 21);
    k.iter_mut().for_each(|x| *x += 2.0);
    let (v, q) = (gauss(kvh * t * d, 22), gauss(h * t * d, 23));
    let f = TurboQuantMseFactory::new(3);
    let mut whole = cache(&f, true);
    whole
        .append(&rows(&k, kvh, t, 0, t), &rows(&v, kvh, t, 0, t))
        .expect("append");
    let a = whole.attend(&rows(&q, h, t, 0, t), 0.125).expect("attend");
    // Chunks of 25: the center is fixed inside the third chunk.
    let mut split = cache(&f, true);
    for from in (0..t).step_by(25) {
        let n = 25.min(t - from);
        split
            .append(&rows(&k, kvh, t, from, n), &rows(&v, kvh, t, from, n))
            .expect("append");
        let b = split
            .attend(&rows(&q, h, t, from, n), 0.125)
            .expect("attend");
        let diff = (a.narrow(1, from, n).expect("rows") - b)
            .and_then(|x| x.abs()?.max_all()?.to_scalar::<f32>())
            .expect("diff");
        assert!(diff < 1e-5, "rows {from}..{}: {diff}", from + n);
    }
}

#[test]
fn presets_turn_centering_off_and_bad_values_are_errors() {
    use crate::registry::BuildArgs;
    let args = |text: &str| -> toml::Table { toml::from_str(text).expect("toml") };
    let build = |params: &toml::Table| {
        TurboQuantMseFactory::from_args(&BuildArgs {
            request_bits: None,
            preset_bits: Some(4),
            params,
            calibration: None,
        })
    };
    let default = build(&args("")).expect("default");
    assert!(default.center_keys && default.center_min_share == 0);
    assert_eq!(default.key_centering(), Some(0.0));
    let off = build(&args("center_keys = false")).expect("off");
    assert_eq!(off.key_centering(), None);
    let some = build(&args("center_min_share = 90")).expect("some heads");
    assert_eq!(some.key_centering(), Some(0.9));
    let err = build(&args("center_keys = 1")).expect_err("not a bool");
    assert!(
        err.to_string().contains("center_keys") && err.to_string().contains("boolean"),
        "{err}"
    );
    let qjl = QjlFactory::from_args(&BuildArgs {
        request_bits: None,
        preset_bits: Some(3),
        params: &args("center_keys = false"),
        calibration: None,
    })
    .expect("qjl");
    assert_eq!(qjl.key_centering(), None);
}

#[test]
fn heads_whose_common_part_is_small_code_raw_keys() {
    // An offset of 3 per coordinate is 90% of the keys' energy: centered at a 50% threshold,
    // raw at 95% (the same output as no centering at all).
    let f = TurboQuantMseFactory::new(3);
    let with = |centering: Option<f32>| {
        let g = geom();
        let (h, kvh, d) = (g.n_heads, g.n_kv_heads, g.head_dim);
        let mut k = gauss(kvh * T * d, 31);
        k.iter_mut().for_each(|x| *x += 3.0);
        let v = gauss(kvh * T * d, 32);
        let q = gauss(h * d, 33);
        let (kc, vc) = f.codecs(0, &g).expect("codecs");
        let mut c = CompressedCache::new(g, f.method(), Arc::new(kc), Arc::new(vc), 8, 2)
            .with_key_centering(centering);
        c.append(&tensor(&k, (kvh, T, d)), &tensor(&v, (kvh, T, d)))
            .expect("append");
        c.attend(&tensor(&q, (h, 1, d)), 0.125)
            .and_then(|x| Ok(x.flatten_all()?.to_vec1::<f32>()?))
            .expect("attend")
    };
    let (half, high, none) = (with(Some(0.5)), with(Some(0.95)), with(None));
    let dist = |a: &[f32], b: &[f32]| -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).powi(2))
            .sum::<f32>()
            .sqrt()
    };
    // Raw keys at a 95% threshold differ from no centering only by their fp16 rounding.
    let (d_high, d_half) = (dist(&high, &none), dist(&half, &none));
    eprintln!("distance from no centering: 95% threshold {d_high:.5}, 50% {d_half:.5}");
    assert!(d_high < 0.2 * d_half, "{d_high} vs {d_half}");
}

/// Output of a cache of `f` (window 8, 2 sinks, centered) for `T` keys and values appended in
/// `chunk`-sized pieces, each followed by its queries; keys and queries scaled by `gain`.
fn run_scaled<F: CodecFactory>(f: &F, gain: f32, chunk: usize) -> (Vec<f32>, Vec<f32>, usize) {
    let g = geom();
    let (h, kvh, d) = (g.n_heads, g.n_kv_heads, g.head_dim);
    let k: Vec<f32> = gauss(kvh * T * d, 41).iter().map(|x| x * gain).collect();
    let v = gauss(kvh * T * d, 42);
    let q: Vec<f32> = gauss(h * T * d, 43).iter().map(|x| x * gain).collect();
    let mut c = cache(f, true);
    let mut out = vec![0f32; h * T * d];
    for from in (0..T).step_by(chunk) {
        let n = chunk.min(T - from);
        c.append(&rows(&k, kvh, T, from, n), &rows(&v, kvh, T, from, n))
            .expect("append");
        let o = c
            .attend(&rows(&q, h, T, from, n), 0.125)
            .and_then(|x| Ok(x.flatten_all()?.to_vec1::<f32>()?))
            .expect("attend");
        for hh in 0..h {
            out[(hh * T + from) * d..(hh * T + from + n) * d]
                .copy_from_slice(&o[hh * n * d..(hh + 1) * n * d]);
        }
    }
    let want = attention_reference(&q, &k, &v, h, kvh, T, T, d, 0.125, None);
    (out, want, c.resident_bytes())
}

#[test]
fn layers_too_sharp_for_codes_stay_fp16() {
    let f = TurboQuantMseFactory::new(3);
    // Gaussian keys and queries: logit spread 0.125 * 8 * 8 = 8, codes answer.
    let (out, want, bytes) = run_scaled(&f, 1.0, 40);
    let plain = rel_l2(&out, &want);
    // Both scaled by 6: spread 288, above SHARP_LOGITS; every key is read from fp16, to fp16's
    // rounding, and no codes are held.
    let (sharp_out, sharp_want, sharp_bytes) = run_scaled(&f, 6.0, 40);
    let sharp = rel_l2(&sharp_out, &sharp_want);
    eprintln!("relative error: plain {plain:.4}, sharp {sharp:.5}; bytes {bytes} vs {sharp_bytes}");
    assert!(plain > 0.05, "codes answer the plain layer: {plain}");
    assert!(sharp < 0.01, "the sharp layer reads fp16: {sharp}");
    // fp16 keys and values of every token (the sinks' copy on top), no codes: 2 bytes per value.
    let fp16_bytes = 2 * 2 * T * 64 * 2;
    assert!(
        sharp_bytes >= fp16_bytes && sharp_bytes < fp16_bytes * 2,
        "{sharp_bytes} bytes, fp16 alone {fp16_bytes}"
    );
    // The decision does not depend on how the text was split.
    let (stepped, _, _) = run_scaled(&f, 6.0, 1);
    let diff = sharp_out
        .iter()
        .zip(&stepped)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(diff < 1e-5, "chunked vs stepped: {diff}");
    let (plain_stepped, _, _) = run_scaled(&f, 1.0, 1);
    let diff = out
        .iter()
        .zip(&plain_stepped)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(diff < 1e-5, "chunked vs stepped: {diff}");
}
