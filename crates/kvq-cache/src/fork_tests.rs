//! `KvCache::fork`: a copy continues exactly as the original would have, and the two never
//! share a buffer (appending to one leaves the other's answers unchanged), for every method on
//! the CPU path and on the tensor path (a GPU cache's buffers).

use crate::codec::rng::SplitMix;
use crate::rolling_tests::{Mode, every_method};
use crate::traits::{CacheGeometry, KvCache};
use candle_core::{Device, Tensor};

fn tensor(rng: &mut SplitMix, heads: usize, t: usize, d: usize) -> Tensor {
    Tensor::from_vec(rng.gauss_vec(heads * t * d), (heads, t, d), &Device::Cpu).expect("tensor")
}

/// Appends `t` random positions (keys with a common part, so centering matters) and attends
/// their queries; the output.
fn step(c: &mut dyn KvCache, g: CacheGeometry, t: usize, seed: u64) -> Tensor {
    let mut rng = SplitMix::new(seed);
    let d = g.head_dim;
    let k = (tensor(&mut rng, g.n_kv_heads, t, d) + 2.0).expect("shift");
    let v = tensor(&mut rng, g.n_kv_heads, t, d);
    let q = tensor(&mut rng, g.n_heads, t, d);
    c.append(&k, &v).expect("append");
    c.attend(&q, 0.125).expect("attend")
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .and_then(|x| x.abs()?.max_all()?.to_scalar::<f32>())
        .expect("diff")
}

/// Prefix: a 90-token chunk and 5 single steps. Then the fork and the original continue with
/// different tokens, interleaved, and each must equal a fresh cache fed the same sequence.
fn check(mode: Mode) {
    let g = CacheGeometry {
        n_heads: 6,
        n_kv_heads: 2,
        head_dim: 64,
        sliding_window: None,
        max_tokens: 4096,
    };
    let prefix: Vec<(usize, u64)> = [(90, 1)]
        .into_iter()
        .chain((2..7).map(|s| (1, s)))
        .collect();
    let fresh = || every_method(g, mode);
    for (((name, mut orig), (_, mut want_a)), (_, mut want_b)) in
        fresh().into_iter().zip(fresh()).zip(fresh())
    {
        for &(t, s) in &prefix {
            step(orig.as_mut(), g, t, s);
            step(want_a.as_mut(), g, t, s);
            step(want_b.as_mut(), g, t, s);
        }
        let mut forked = orig.fork().expect("fork");
        assert_eq!(forked.len(), orig.len(), "{name}");
        assert_eq!(forked.method(), orig.method(), "{name}");
        // A host copy holds its rows without the original's spare capacity.
        let (fb, ob) = (forked.resident_bytes(), orig.resident_bytes());
        assert!(fb > 0 && fb <= ob, "{name}: fork {fb} bytes, original {ob}");
        for i in 0..40u64 {
            // The fork writes first: if the two shared a buffer, the original would read it.
            let (tb, ta) = (1 + (i as usize % 3) * 10, 1);
            let b = step(forked.as_mut(), g, tb, 1000 + i);
            let wb = step(want_b.as_mut(), g, tb, 1000 + i);
            let a = step(orig.as_mut(), g, ta, 2000 + i);
            let wa = step(want_a.as_mut(), g, ta, 2000 + i);
            let (da, db) = (max_diff(&a, &wa), max_diff(&b, &wb));
            assert!(da == 0.0, "{name}: original after the fork, step {i}: {da}");
            assert!(db == 0.0, "{name}: the fork, step {i}: {db}");
        }
    }
}

#[test]
fn forks_continue_independently_on_the_cpu_path() {
    check(Mode::Rolling);
}

#[test]
fn forks_continue_independently_on_the_tensor_path() {
    check(Mode::Tensor);
}

/// `allow_rewind(r)`: after a prefix, truncating to any of its last `r` positions (inside the
/// fp16 window, past it, and before the key center is fixed) and continuing equals a fresh
/// cache fed the kept positions and then the same continuation, exactly.
fn check_rewind(mode: Mode) {
    let g = CacheGeometry {
        n_heads: 6,
        n_kv_heads: 2,
        head_dim: 64,
        sliding_window: None,
        max_tokens: 4096,
    };
    let rewind = 24;
    // (prefix steps, how far back to truncate): a long prefix cut inside and past the
    // window of 16, and a short one cut before the center is fixed.
    let cases: [(&[(usize, u64)], usize); 3] = [
        (&[(90, 1), (1, 2), (1, 3), (30, 4)], 5),
        (&[(90, 1), (1, 2), (1, 3), (30, 4)], 23),
        (&[(6, 1), (1, 2)], 4),
    ];
    for (prefix, back) in cases {
        for ((name, mut held), (_, mut want)) in
            every_method(g, mode).into_iter().zip(every_method(g, mode))
        {
            held.allow_rewind(rewind);
            for &(t, s) in prefix {
                step(held.as_mut(), g, t, s);
            }
            let n = held.len() - back;
            held.truncate(n).expect("truncate within the rewind");
            assert_eq!(held.len(), n, "{name}");
            // The fresh cache sees the same positions: the prefix cut at n.
            let mut fed = 0;
            for &(t, s) in prefix {
                let mut rng = SplitMix::new(s);
                let d = g.head_dim;
                let k = (tensor(&mut rng, g.n_kv_heads, t, d) + 2.0).expect("shift");
                let v = tensor(&mut rng, g.n_kv_heads, t, d);
                let q = tensor(&mut rng, g.n_heads, t, d);
                let take = t.min(n - fed);
                if take == 0 {
                    break;
                }
                want.append(
                    &k.narrow(1, 0, take).expect("k"),
                    &v.narrow(1, 0, take).expect("v"),
                )
                .expect("append");
                want.attend(&q.narrow(1, 0, take).expect("q"), 0.125)
                    .expect("attend");
                fed += take;
            }
            for i in 0..12u64 {
                let t = 1 + (i as usize % 2) * 7;
                let a = step(held.as_mut(), g, t, 3000 + i);
                let w = step(want.as_mut(), g, t, 3000 + i);
                let dd = max_diff(&a, &w);
                assert!(
                    dd == 0.0,
                    "{name}, back {back}: step {i} after the rewind: {dd}"
                );
            }
        }
    }
}

#[test]
fn rewinds_continue_exactly_on_the_cpu_path() {
    check_rewind(Mode::Rolling);
}

#[test]
fn rewinds_continue_exactly_on_the_tensor_path() {
    check_rewind(Mode::Tensor);
}
