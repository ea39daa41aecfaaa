//! Sliding-window caches roll, for every method: a cache that releases what left the window
//! answers exactly like one that keeps everything (same codes, same ranges), its resident bytes
//! stop growing at the window, and truncating into released rows is an error, not a panic.

use crate::codec::rng::SplitMix;
use crate::compressed::{CodecFactory, CompressedCache};
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

/// How [`every_method`] builds its caches.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// As the registry does: rows that left a sliding window are dropped.
    Rolling,
    /// Every row kept (what a rolling cache must equal).
    KeepAll,
    /// Rolling, with the rows in tensors and attention in tensor ops (a GPU cache's path).
    Tensor,
}

fn compressed<F: CodecFactory>(f: &F, g: CacheGeometry, mode: Mode) -> Box<dyn KvCache> {
    let (k, v) = f.codecs(0, &g).expect("codecs");
    let c = CompressedCache::new(
        g,
        f.method(),
        Arc::new(k),
        Arc::new(v),
        f.window(),
        f.sinks(),
    )
    .with_key_centering(f.key_centering());
    Box::new(match mode {
        Mode::Rolling => c,
        Mode::KeepAll => c.keep_all(),
        Mode::Tensor => c.tensor_path().expect("tensor path"),
    })
}

fn dense<E: crate::methods::dense::Element>(g: CacheGeometry, mode: Mode) -> Box<dyn KvCache> {
    let c = crate::methods::dense::DenseCache::<E>::new(g);
    Box::new(match mode {
        Mode::Rolling => c,
        Mode::KeepAll => c.keep_all(),
        Mode::Tensor => c.tensor_path(),
    })
}

/// Every method at `g`, built as `mode` says. Compressed ones with a 16-token fp16 window and 2
/// sinks, so most of the window is read from codes.
pub(crate) fn every_method(g: CacheGeometry, mode: Mode) -> Vec<(String, Box<dyn KvCache>)> {
    let (window, sinks) = (16, 2);
    let cal = Arc::new(VecInferCalibration::random(1, g.n_kv_heads, g.head_dim, 7));
    let vecinfer = VecInferFactory {
        window,
        sinks,
        ..VecInferFactory::new(cal, 4, DEFAULT_SEED).expect("factory")
    };
    vec![
        ("fp16".into(), dense::<half::f16>(g, mode)),
        ("f32".into(), dense::<f32>(g, mode)),
        (
            "turboquant-mse".into(),
            compressed(
                &TurboQuantMseFactory {
                    window,
                    sinks,
                    ..TurboQuantMseFactory::new(3)
                },
                g,
                mode,
            ),
        ),
        (
            "turboquant-rvq".into(),
            compressed(
                &TurboQuantRvqFactory {
                    window,
                    sinks,
                    ..TurboQuantRvqFactory::new(4)
                },
                g,
                mode,
            ),
        ),
        (
            "turboquant-prod".into(),
            compressed(
                &TurboQuantProdFactory {
                    window,
                    sinks,
                    ..TurboQuantProdFactory::new(3)
                },
                g,
                mode,
            ),
        ),
        (
            "qjl".into(),
            compressed(
                &QjlFactory {
                    window,
                    sinks,
                    ..QjlFactory::new(3)
                },
                g,
                mode,
            ),
        ),
        ("vecinfer".into(), compressed(&vecinfer, g, mode)),
    ]
}

/// Every method: (name, rolling, keeping everything).
fn all() -> Vec<(String, Pair)> {
    every_method(geom(), Mode::Rolling)
        .into_iter()
        .zip(every_method(geom(), Mode::KeepAll))
        .map(|((name, a), (_, b))| (name, (a, b)))
        .collect()
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
