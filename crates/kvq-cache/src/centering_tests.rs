//! Key centering in compressed caches: keys sharing a large common part (as Qwen2.5's k bias
//! gives them) attend as well as keys without it, and centering does not depend on how the
//! text was split into appends.

use crate::attention::attention_reference;
use crate::compressed::{CENTER_ROWS, CodecFactory, CompressedCache};
use crate::methods::qjl::QjlFactory;
use crate::methods::turboquant_mse::TurboQuantMseFactory;
use crate::methods::turboquant_mse::test_support::{gauss, geom};
use crate::methods::turboquant_prod::TurboQuantProdFactory;
use crate::traits::KvCache;
use candle_core::{Device, Tensor};
use std::sync::Arc;

const T: usize = 300;

fn tensor(x: &[f32], shape: (usize, usize, usize)) -> Tensor {
    Tensor::from_slice(x, shape, &Device::Cpu).expect("tensor")
}

fn cache<F: CodecFactory>(f: &F, centered: bool) -> CompressedCache {
    let (k, v) = f.codecs(0, &geom()).expect("codecs");
    CompressedCache::new(geom(), f.method(), Arc::new(k), Arc::new(v), 8, 2)
        .with_key_centering(centered)
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
        let num: f64 = got
            .iter()
            .zip(&want)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
        total += (num / den).sqrt();
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
        // Measured: raw 2.2x (MSE), 3.5x (Prod), 2.0x (QJL) the centered error.
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
    let part = |x: &[f32], heads: usize, from: usize, n: usize| -> Tensor {
        let rows: Vec<f32> = (0..heads)
            .flat_map(|hh| {
                x[(hh * t + from) * d..(hh * t + from + n) * d]
                    .iter()
                    .copied()
            })
            .collect();
        tensor(&rows, (heads, n, d))
    };
    let f = TurboQuantMseFactory::new(3);
    let mut whole = cache(&f, true);
    whole
        .append(&part(&k, kvh, 0, t), &part(&v, kvh, 0, t))
        .expect("append");
    let a = whole.attend(&part(&q, h, 0, t), 0.125).expect("attend");
    // Chunks of 25: the center is fixed inside the third chunk.
    let mut split = cache(&f, true);
    for from in (0..t).step_by(25) {
        let n = 25.min(t - from);
        split
            .append(&part(&k, kvh, from, n), &part(&v, kvh, from, n))
            .expect("append");
        let b = split.attend(&part(&q, h, from, n), 0.125).expect("attend");
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
    assert!(build(&args("")).expect("default").center_keys);
    assert!(
        !build(&args("center_keys = false"))
            .expect("off")
            .center_keys
    );
    let err = build(&args("center_keys = 1")).expect_err("not a bool");
    assert!(err.to_string().contains("true or false"), "{err}");
    let qjl = QjlFactory::from_args(&BuildArgs {
        request_bits: None,
        preset_bits: Some(3),
        params: &args("center_keys = false"),
        calibration: None,
    })
    .expect("qjl");
    assert!(!qjl.center_keys);
}
