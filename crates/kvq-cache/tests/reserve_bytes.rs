//! `KvCache::reserve_bytes` is what admission reserves for a sequence, so it must bound
//! `resident_bytes` at every step of every method, for random chunk schedules with and without a
//! sliding window, and stay close enough to the real size that the budget buys what it says.

use candle_core::{Device, Tensor};
use kvq_cache::codec::rng::SplitMix;
use kvq_cache::{CacheError, CacheGeometry, CacheRegistry, CacheSpec};
use proptest::prelude::*;

fn geometry(window: Option<usize>) -> CacheGeometry {
    CacheGeometry {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        sliding_window: window,
        max_tokens: 8192,
    }
}

fn rows(rng: &mut SplitMix, heads: usize, t: usize, d: usize) -> Tensor {
    Tensor::from_vec(rng.gauss_vec(heads * t * d), (heads, t, d), &Device::Cpu).expect("tensor")
}

/// Every method the registry builds without calibration (VecInfer needs one: it is covered by
/// its own tests through the same `CompressedCache`).
fn methods() -> Vec<String> {
    let reg = CacheRegistry::builtin();
    reg.names()
        .into_iter()
        .filter(|n| {
            !matches!(
                reg.resolve(&CacheSpec {
                    method: Some(n.clone()),
                    bits: None,
                }),
                Err(CacheError::Calibration(_))
            )
        })
        .collect()
}

/// Appends `tokens` positions to a fresh cache of `method` in chunks from `schedule` (each at
/// most `chunk`), attending after each; returns (worst resident / bound seen, final resident,
/// final bound). The bound is the running maximum of `reserve_bytes`, as the engine keeps it.
fn run(
    method: &str,
    window: Option<usize>,
    tokens: usize,
    chunk: usize,
    seed: u64,
) -> (f64, usize, usize) {
    let reg = CacheRegistry::builtin();
    let factory = reg
        .resolve(&CacheSpec {
            method: Some(method.into()),
            bits: None,
        })
        .expect("method")
        .factory;
    let g = geometry(window);
    let mut cache = factory.create(0, &g).expect("cache");
    let mut bound = cache.reserve_bytes(tokens, chunk);
    let mut rng = SplitMix::new(seed);
    let mut worst = 0f64;
    let mut len = 0;
    while len < tokens {
        let t = (1 + rng.below(chunk)).min(tokens - len);
        let (k, v) = (rows(&mut rng, 2, t, 64), rows(&mut rng, 2, t, 64));
        cache.append(&k, &v).expect("append");
        // Checked after the attend: between the two a layer holds the chunk's fp16 rows.
        cache
            .attend(&rows(&mut rng, 4, t, 64), 0.125)
            .expect("attend");
        worst = worst.max(cache.resident_bytes() as f64 / bound as f64);
        len += t;
        bound = bound.max(cache.reserve_bytes(tokens, chunk));
    }
    (worst, cache.resident_bytes(), bound)
}

#[test]
fn every_method_stays_within_its_reservation() {
    for method in methods() {
        for window in [None, Some(100)] {
            for (chunk, seed, tokens) in [(1, 1, 400), (37, 2, 1300), (512, 3, 1300)] {
                let (worst, resident, bound) = run(&method, window, tokens, chunk, seed);
                assert!(
                    worst <= 1.0,
                    "{method} window {window:?} chunk {chunk}: resident reached {worst:.3} of the reservation"
                );
                // Close to the real size: code rows round up to 256 positions, host fp16 rows
                // may hold twice their rows: the bound stays under 1.8x from a few hundred tokens.
                assert!(
                    bound as f64 <= 1.8 * resident as f64 + 64.0 * 1024.0,
                    "{method} window {window:?} chunk {chunk}: reserved {bound} for {resident} resident"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    #[test]
    fn reservations_hold_for_random_schedules(
        m in 0usize..64,
        tokens in 1usize..700,
        chunk in 1usize..300,
        window in prop::option::of(16usize..200),
        seed in any::<u64>(),
    ) {
        let all = methods();
        let method = &all[m % all.len()];
        let (worst, _, _) = run(method, window, tokens, chunk, seed);
        prop_assert!(worst <= 1.0, "{} reached {:.3} of its reservation", method, worst);
    }
}

/// The README's budget table: what each shipped method reserves per token for a Llama-3.1-8B
/// sized model (32 layers, 8 kv heads of 128), at a few contexts, prompt chunks of 512.
/// `cargo test --release -p kvq-cache --test reserve_bytes -- --ignored --nocapture`
#[test]
#[ignore = "prints the README's table"]
fn print_budget_table() {
    let mut reg = CacheRegistry::builtin();
    reg.load_presets(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/cache"))
        .expect("presets");
    let g = CacheGeometry {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        sliding_window: None,
        max_tokens: 131072,
    };
    println!("| method | bytes per token, 8k context | per token, 32k | one 32k sequence |");
    println!("|---|---|---|---|");
    for name in reg.names() {
        let Ok(r) = reg.resolve(&CacheSpec {
            method: Some(name.clone()),
            bits: None,
        }) else {
            continue;
        };
        let need = |tokens: usize| {
            let c = r.factory.create(0, &g).expect("cache");
            32 * c.reserve_bytes(tokens, 512)
        };
        let (a, b) = (need(8192), need(32768));
        println!(
            "| `{name}` | {:.0} | {:.0} | {:.2} GiB |",
            a as f64 / 8192.0,
            b as f64 / 32768.0,
            b as f64 / f64::from(1u32 << 30)
        );
    }
}
