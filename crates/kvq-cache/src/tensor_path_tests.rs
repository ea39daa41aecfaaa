//! The tensor path (what every cache does on a GPU: rows in device buffers, attention and the
//! merge with the fp16 rows in tensor ops) answers like the CPU path, for every method, with and
//! without a sliding window, through prompt chunks, decode steps and a truncation; under a
//! sliding window it stops growing too. Run on the CPU, so CI checks it without a GPU.

use crate::codec::rng::SplitMix;
use crate::rolling_tests::{Mode, every_method};
use crate::traits::{CacheGeometry, KvCache};
use candle_core::{Device, Tensor};

fn tensor(rng: &mut SplitMix, heads: usize, t: usize, d: usize) -> Tensor {
    Tensor::from_vec(rng.gauss_vec(heads * t * d), (heads, t, d), &Device::Cpu).expect("tensor")
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .and_then(|x| x.abs()?.max_all()?.to_scalar::<f32>())
        .expect("diff")
}

/// Appends and attends `steps` (tokens per step) in both caches, checking every output.
fn run(name: &str, host: &mut dyn KvCache, dev: &mut dyn KvCache, g: CacheGeometry, seed: u64) {
    let mut steps = vec![3, 1, 30, 1, 1, 200];
    steps.extend([1; 60]);
    steps.push(129);
    steps.extend([1; 40]);
    let mut rng = SplitMix::new(seed);
    let d = g.head_dim;
    for (i, &t) in steps.iter().enumerate() {
        if i == 50 {
            // Back a few tokens, as a stop sequence does: both paths allow it (dense) or
            // refuse it (compressed: fp16 rows are kept only for the next query) alike.
            let n = host.len() - 3;
            let (a, b) = (host.truncate(n), dev.truncate(n));
            assert_eq!(a.is_ok(), b.is_ok(), "{name}: truncate {a:?} / {b:?}");
        }
        let (k, v) = (
            tensor(&mut rng, g.n_kv_heads, t, d),
            tensor(&mut rng, g.n_kv_heads, t, d),
        );
        // Keys with a common part, so centering matters.
        let k = (k + 2.0).expect("shift");
        let q = tensor(&mut rng, g.n_heads, t, d);
        host.append(&k, &v).expect("append");
        dev.append(&k, &v).expect("append");
        let a = host.attend(&q, 0.125).expect("attend");
        let b = dev.attend(&q, 0.125).expect("attend");
        let diff = max_diff(&a, &b);
        assert!(
            diff <= 1e-4,
            "{name}: at {} tokens ({t} new) the tensor path differs by {diff}",
            host.len()
        );
    }
    assert!(dev.resident_bytes() > 0, "{name}");
}

#[test]
fn tensor_path_equals_the_cpu_path() {
    for sliding_window in [None, Some(100)] {
        let g = CacheGeometry {
            n_heads: 6,
            n_kv_heads: 2,
            head_dim: 64,
            sliding_window,
            max_tokens: 4096,
        };
        for ((name, mut host), (_, mut dev)) in every_method(g, Mode::Rolling)
            .into_iter()
            .zip(every_method(g, Mode::Tensor))
        {
            run(&name, host.as_mut(), dev.as_mut(), g, 5);
            if sliding_window.is_some() {
                // Rolling on the tensor path too: 1500 positions seen, a window of 100 held,
                // within twice what the CPU path holds (buffers grow and compact in steps).
                let pick = |mode| {
                    every_method(g, mode)
                        .into_iter()
                        .find(|(n, _)| *n == name)
                        .map(|(_, c)| c)
                        .expect("same method")
                };
                let (mut cpu, mut again) = (pick(Mode::Rolling), pick(Mode::Tensor));
                run(&name, cpu.as_mut(), again.as_mut(), g, 6);
                let mut rng = SplitMix::new(7);
                for _ in 0..1000 {
                    let (k, v) = (tensor(&mut rng, 2, 1, 64), tensor(&mut rng, 2, 1, 64));
                    for c in [&mut cpu, &mut again] {
                        c.append(&k, &v).expect("append");
                    }
                }
                assert!(
                    again.resident_bytes() <= 2 * cpu.resident_bytes(),
                    "{name}: tensor path {} bytes, CPU path {}",
                    again.resident_bytes(),
                    cpu.resident_bytes()
                );
            }
        }
    }
}
