//! Sliding-window caches roll, for every method: a cache that releases what left the window
//! answers exactly like one that keeps everything (same codes, same ranges), its resident bytes
//! stop growing at the window, and truncating into released rows is an error, not a panic.

use crate::codec::sketch::SplitMix;
use crate::compressed::{CodecFactory, CompressedCache};
use crate::methods::dense::{F32Cache, Fp16Cache};
use crate::methods::qjl::QjlFactory;
use crate::methods::turboquant_mse::TurboQuantMseFactory;
use crate::methods::turboquant_prod::TurboQuantProdFactory;
use crate::methods::turboquant_rvq::TurboQuantRvqFactory;
use crate::methods::vecinfer::calibration::VecInferCalibration;
use crate::methods::vecinfer::{DEFAULT_SEED, VecInferFactory};
use crate::traits::{CacheGeometry, KvCache};
use candle_core::{Device, Tensor};
use std::sync::Arc;

const SLIDING: usize = 200;
const KVH: usize = 2;
const HEADS: usize = 4;
const D: usize = 64;

fn geom() -> CacheGeometry {
    CacheGeometry {
        n_heads: HEADS,
        n_kv_heads: KVH,
        head_dim: D,
        sliding_window: Some(SLIDING),
        max_tokens: 4096,
    }
}

/// A rolling cache and one of the same method that keeps every row.
type Pair = (Box<dyn KvCache>, Box<dyn KvCache>);

/// [`Pair`] of `f`'s method.
fn compressed<F: CodecFactory>(f: &F) -> Pair {
    let make = || {
        let (k, v) = f.codecs(0, &geom()).expect("codecs");
        CompressedCache::new(
            geom(),
            f.method(),
            Arc::new(k),
            Arc::new(v),
            f.window(),
            f.sinks(),
        )
        .with_key_centering(f.key_centering())
    };
    (Box::new(make()), Box::new(make().keep_all()))
}

/// Every method: (name, rolling, keeping everything). Compressed ones with a 16-token fp16 window
/// and 2 sinks, so most of the window is read from codes.
fn all() -> Vec<(String, Pair)> {
    let mut out: Vec<(String, Pair)> = vec![
        (
            "fp16".into(),
            (
                Box::new(Fp16Cache::new(geom())),
                Box::new(Fp16Cache::new(geom()).keep_all()),
            ),
        ),
        (
            "f32".into(),
            (
                Box::new(F32Cache::new(geom())),
                Box::new(F32Cache::new(geom()).keep_all()),
            ),
        ),
    ];
    let mut push = |name: &str, pair: Pair| out.push((name.to_string(), pair));
    let (window, sinks) = (16, 2);
    push(
        "turboquant-mse",
        compressed(&TurboQuantMseFactory {
            window,
            sinks,
            ..TurboQuantMseFactory::new(3)
        }),
    );
    push(
        "turboquant-rvq",
        compressed(&TurboQuantRvqFactory {
            window,
            sinks,
            ..TurboQuantRvqFactory::new(4)
        }),
    );
    push(
        "turboquant-prod",
        compressed(&TurboQuantProdFactory {
            window,
            sinks,
            ..TurboQuantProdFactory::new(3)
        }),
    );
    push(
        "qjl",
        compressed(&QjlFactory {
            window,
            sinks,
            ..QjlFactory::new(3)
        }),
    );
    let cal = Arc::new(VecInferCalibration::random(1, KVH, D, 7));
    let vecinfer = VecInferFactory {
        window,
        sinks,
        ..VecInferFactory::new(cal, 4, DEFAULT_SEED).expect("factory")
    };
    push("vecinfer", compressed(&vecinfer));
    out
}

fn tensor(rng: &mut SplitMix, heads: usize, t: usize) -> Tensor {
    Tensor::from_vec(rng.gauss_vec(heads * t * D), (heads, t, D), &Device::Cpu).expect("tensor")
}

#[test]
fn rolling_caches_equal_keeping_everything_and_stop_growing() {
    // Prompt chunks (prefill, past the window at once) and single decode steps.
    let mut steps = vec![150, 1, 1, 90];
    steps.extend([1; 40]);
    steps.push(300);
    steps.extend([1; 100]);
    steps.push(257);
    steps.extend([1; 300]);
    steps.push(64);
    steps.extend([1; 1200]);
    for (name, (mut rolling, mut full)) in all() {
        let mut rng = SplitMix::new(11);
        let mut resident = Vec::new();
        for &t in &steps {
            let (k, v) = (tensor(&mut rng, KVH, t), tensor(&mut rng, KVH, t));
            let q = tensor(&mut rng, HEADS, t);
            for c in [&mut rolling, &mut full] {
                c.append(&k, &v).expect("append");
            }
            let a = rolling.attend(&q, 0.125).expect("attend");
            let b = full.attend(&q, 0.125).expect("attend");
            let diff = (a - b)
                .and_then(|x| x.abs()?.max_all()?.to_scalar::<f32>())
                .expect("diff");
            assert!(
                diff <= 1e-6,
                "{name}: at {} tokens the rolling cache differs by {diff}",
                rolling.len()
            );
            resident.push((rolling.len(), rolling.resident_bytes()));
        }
        let (len, end) = (rolling.len(), rolling.resident_bytes());
        eprintln!(
            "{name}: {len} tokens, rolling {end} bytes, keeping everything {}",
            full.resident_bytes()
        );
        assert!(len > 5 * SLIDING, "{len}");
        // Stops growing: nothing after 1000 tokens above the most held between 600 and 1000.
        let most = |lo: usize, hi: usize| {
            resident
                .iter()
                .filter(|(n, _)| (lo..hi).contains(n))
                .map(|&(_, b)| b)
                .max()
                .unwrap_or(0)
        };
        assert!(
            most(1000, usize::MAX) <= most(600, 1000),
            "{name}: {} bytes after 1000 tokens, {} before",
            most(1000, usize::MAX),
            most(600, 1000)
        );
        assert!(
            2 * end < full.resident_bytes(),
            "{name}: rolling {end} bytes, keeping everything {}",
            full.resident_bytes()
        );
        // Truncating into released rows is an error (dense caches can still go back within the
        // window; compressed ones keep fp16 rows only for the next query).
        if name.starts_with('f') {
            rolling
                .truncate(len - 10)
                .expect("truncate within the window");
        }
        assert!(rolling.truncate(SLIDING).is_err(), "{name}");
    }
}
