//! `KvCache::save_state` / `restore_state`: a cache restored from a state (directly, through
//! `LayerCaches` and through a safetensors file) answers exactly as the saved one, for every
//! method on the CPU path and on the tensor path (a GPU cache's buffers): the same length,
//! bytes and truncation answers, bit-identical outputs as both continue, truncate and
//! continue again; before and after the key center is fixed, under a sliding window and in a
//! sharp layer. States that do not fit are errors, never panics, and leave the cache fresh.

use crate::Result;
use crate::codec::rng::SplitMix;
use crate::rolling_tests::{Mode, every_method};
use crate::traits::{CacheFactory, CacheGeometry, CacheState, KvCache, LayerCaches};
use candle_core::{DType, Device, Tensor};

/// What the engine allows every cache to rewind (`allow_rewind`).
pub(crate) const REWIND: usize = 16;

pub(crate) fn geom(sliding_window: Option<usize>) -> CacheGeometry {
    CacheGeometry {
        n_heads: 6,
        n_kv_heads: 2,
        head_dim: 64,
        sliding_window,
        max_tokens: 4096,
    }
}

fn tensor(rng: &mut SplitMix, heads: usize, t: usize, d: usize, gain: f32) -> Tensor {
    let x: Vec<f32> = rng
        .gauss_vec(heads * t * d)
        .iter()
        .map(|v| v * gain)
        .collect();
    Tensor::from_vec(x, (heads, t, d), &Device::Cpu).expect("tensor")
}

/// Appends `t` random positions (keys with a common part, so centering matters; keys and
/// queries scaled by `gain`, 6 making a layer too sharp for codes) and attends their queries.
pub(crate) fn step(
    c: &mut dyn KvCache,
    g: CacheGeometry,
    t: usize,
    seed: u64,
    gain: f32,
) -> Tensor {
    let mut rng = SplitMix::new(seed);
    let d = g.head_dim;
    let k = (tensor(&mut rng, g.n_kv_heads, t, d, gain) + 2.0).expect("shift");
    let v = tensor(&mut rng, g.n_kv_heads, t, d, 1.0);
    let q = tensor(&mut rng, g.n_heads, t, d, gain);
    c.append(&k, &v).expect("append");
    c.attend(&q, 0.125).expect("attend")
}

fn bits(x: &Tensor) -> Vec<u32> {
    let v = x.flatten_all().and_then(|x| x.to_vec1::<f32>());
    v.expect("f32").into_iter().map(f32::to_bits).collect()
}

/// A fresh cache of method `name` at `g`, built as `mode` says.
pub(crate) fn fresh(g: CacheGeometry, mode: Mode, name: &str) -> Box<dyn KvCache> {
    every_method(g, mode)
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, c)| c)
        .expect("a method of every_method")
}

/// The factory of [`fresh`] caches: what `LayerCaches::restore` builds from.
pub(crate) struct ByName {
    pub(crate) name: String,
    pub(crate) mode: Mode,
}

impl CacheFactory for ByName {
    fn method(&self) -> &str {
        &self.name
    }

    fn create(&self, _layer: usize, geom: &CacheGeometry) -> Result<Box<dyn KvCache>> {
        Ok(fresh(*geom, self.mode, &self.name))
    }
}

/// The elements of `t`, as bits.
fn raw(t: &Tensor) -> Vec<u64> {
    let t = t.flatten_all().expect("flatten");
    let v = match t.dtype() {
        DType::U8 => t
            .to_vec1::<u8>()
            .map(|v| v.into_iter().map(u64::from).collect()),
        DType::U32 => t
            .to_vec1::<u32>()
            .map(|v| v.into_iter().map(u64::from).collect()),
        DType::I64 => t
            .to_vec1::<i64>()
            .map(|v| v.into_iter().map(|x| x as u64).collect()),
        DType::F16 => t
            .to_vec1::<half::f16>()
            .map(|v| v.into_iter().map(|x| u64::from(x.to_bits())).collect()),
        DType::F32 => t
            .to_vec1::<f32>()
            .map(|v| v.into_iter().map(|x| u64::from(x.to_bits())).collect()),
        DType::F64 => t
            .to_vec1::<f64>()
            .map(|v| v.into_iter().map(f64::to_bits).collect()),
        other => panic!("a state holds no {other:?}"),
    };
    v.expect("elements")
}

/// Both states have the same tensors: names, dtypes, shapes and bits.
fn assert_same_state(what: &str, a: &CacheState, b: &CacheState) {
    let mut names: Vec<&String> = a.keys().collect();
    names.sort();
    let mut other: Vec<&String> = b.keys().collect();
    other.sort();
    assert_eq!(names, other, "{what}: tensor names");
    for name in names {
        let (x, y) = (&a[name], &b[name]);
        assert_eq!(x.dtype(), y.dtype(), "{what}: {name}");
        assert_eq!(x.dims(), y.dims(), "{what}: {name}");
        assert!(raw(x) == raw(y), "{what}: {name} differs");
    }
}

/// Same length, bytes, truncation answers (every position) and state.
fn assert_same(what: &str, a: &dyn KvCache, b: &dyn KvCache) {
    assert_eq!(a.len(), b.len(), "{what}: len");
    assert_eq!(
        a.resident_bytes(),
        b.resident_bytes(),
        "{what}: resident bytes"
    );
    assert_eq!(
        a.resident_split(),
        b.resident_split(),
        "{what}: resident split"
    );
    assert_eq!(
        a.reserve_bytes(2000, 64),
        b.reserve_bytes(2000, 64),
        "{what}: reserve bytes"
    );
    for n in 0..=a.len() {
        assert_eq!(
            a.can_truncate(n),
            b.can_truncate(n),
            "{what}: can_truncate({n})"
        );
    }
    let (sa, sb) = (a.save_state().expect("save"), b.save_state().expect("save"));
    assert_same_state(what, &sa, &sb);
}

/// Both continue with the same steps; every output bit-identical.
fn continue_both(
    what: &str,
    a: &mut dyn KvCache,
    b: &mut dyn KvCache,
    g: CacheGeometry,
    (steps, seed, gain): (&[usize], u64, f32),
) {
    for (i, &t) in steps.iter().enumerate() {
        let s = seed + i as u64;
        let (x, y) = (step(a, g, t, s, gain), step(b, g, t, s, gain));
        assert!(bits(&x) == bits(&y), "{what}: step {i} ({t} rows) differs");
    }
}

/// One prefix to save: appended in `steps` (each attended) with `gain`, then truncated by
/// `cut` positions.
struct Case {
    what: &'static str,
    window: Option<usize>,
    steps: &'static [(usize, u64)],
    gain: f32,
    cut: usize,
}

const CASES: [Case; 7] = [
    // 8 positions: the key center is not fixed yet (it is at 2 sinks + `CENTER_ROWS`).
    Case {
        what: "before the center",
        window: None,
        steps: &[(6, 1), (1, 2), (1, 3)],
        gain: 1.0,
        cut: 0,
    },
    Case {
        what: "after the center",
        window: None,
        steps: &[(40, 1), (1, 2), (1, 3), (30, 4), (1, 5)],
        gain: 1.0,
        cut: 0,
    },
    Case {
        what: "truncated",
        window: None,
        steps: &[(40, 1), (1, 2), (1, 3), (30, 4), (1, 5)],
        gain: 1.0,
        cut: 7,
    },
    // Fixed at 21 positions, truncated below 18: the center is forgotten (pending again).
    Case {
        what: "center forgotten",
        window: None,
        steps: &[(20, 1), (1, 2)],
        gain: 1.0,
        cut: 6,
    },
    // 595 positions over a window of 100: dense block 0 released, device and code rows
    // reallocated from position 244 on.
    Case {
        what: "sliding window",
        window: Some(100),
        steps: &[
            (40, 1),
            (1, 2),
            (300, 3),
            (1, 4),
            (1, 5),
            (250, 6),
            (1, 7),
            (1, 8),
        ],
        gain: 1.0,
        cut: 0,
    },
    // Found sharp by the chunk's own queries; its codes go at the next append.
    Case {
        what: "sharp, just decided",
        window: None,
        steps: &[(40, 1)],
        gain: 6.0,
        cut: 0,
    },
    Case {
        what: "sharp",
        window: None,
        steps: &[(40, 1), (1, 2), (30, 3)],
        gain: 6.0,
        cut: 0,
    },
];

/// Checks that `state` is in the situation `case` names (a pending center, rolled rows, a
/// sharp layer with or without its codes).
fn covers(what: &str, case: &Case, state: &CacheState, mode: Mode) {
    let get = |name: &str| state.get(name).map(|_| count(state, name));
    if state.contains_key("k") {
        if case.what == "sliding window" {
            assert!(get("k.from") > Some(0), "{what}: rows released");
            if mode == Mode::Rolling {
                assert_eq!(get("spare"), Some(1), "{what}: a spare block");
            }
        }
        return;
    }
    let kind = get("center.kind");
    match case.what {
        "before the center" | "center forgotten" => assert_eq!(kind, Some(0), "{what}"),
        "after the center" | "truncated" => {
            assert_eq!((kind, get("center.exact")), (Some(2), Some(1)), "{what}");
            assert!(get("exact.first") > Some(0), "{what}: fp16 rows trimmed");
        }
        "sliding window" => assert!(get("codes.k.from") > Some(0), "{what}: codes rolled"),
        "sharp, just decided" => {
            assert_eq!(get("center.exact"), Some(2), "{what}");
            assert!(state.contains_key("codes.k"), "{what}: codes still held");
        }
        "sharp" => {
            assert_eq!(get("center.exact"), Some(2), "{what}");
            assert_eq!(get("codes.k.cap"), Some(0), "{what}: codes dropped");
        }
        _ => {}
    }
}

/// Every case for every method: save, restore into a fresh cache, compare, continue both,
/// truncate both within the rewind, continue again.
fn check(mode: Mode) {
    for case in &CASES {
        let g = geom(case.window);
        for (name, mut orig) in every_method(g, mode) {
            let what = format!("{name}, {}", case.what);
            orig.allow_rewind(REWIND);
            for &(t, s) in case.steps {
                step(orig.as_mut(), g, t, s, case.gain);
            }
            if case.cut > 0 {
                let n = orig.len() - case.cut;
                orig.truncate(n).expect("truncate within the rewind");
            }
            let state = orig.save_state().expect("save");
            covers(&what, case, &state, mode);
            let mut back = fresh(g, mode, &name);
            back.restore_state(&state, &Device::Cpu).expect("restore");
            assert_same(&what, orig.as_ref(), back.as_ref());
            let more: &[usize] = &[1, 1, 40, 1, 1, 1];
            continue_both(
                &what,
                orig.as_mut(),
                back.as_mut(),
                g,
                (more, 500, case.gain),
            );
            assert_same(&what, orig.as_ref(), back.as_ref());
            let n = orig.len() - 10;
            let can = orig.can_truncate(n);
            assert_eq!(can, back.can_truncate(n), "{what}");
            assert!(can || case.window.is_some(), "{what}: truncate to {n}");
            if can {
                orig.truncate(n).expect("truncate");
                back.truncate(n).expect("truncate");
                let after: &[usize] = &[1, 8, 1];
                continue_both(
                    &what,
                    orig.as_mut(),
                    back.as_mut(),
                    g,
                    (after, 600, case.gain),
                );
                assert_same(&what, orig.as_ref(), back.as_ref());
            }
        }
    }
}

#[test]
fn restored_caches_continue_exactly_on_the_cpu_path() {
    check(Mode::Rolling);
}

#[test]
fn restored_caches_continue_exactly_on_the_tensor_path() {
    check(Mode::Tensor);
}

/// Two layers (one under a sliding window) of every method through `LayerCaches::save_state`,
/// a safetensors file and `LayerCaches::restore`.
fn check_layers(mode: Mode, tag: &str) {
    let geoms = [geom(None), geom(Some(100))];
    let names: Vec<String> = every_method(geoms[0], mode)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let dir = std::env::temp_dir();
    for name in names {
        let f = ByName {
            name: name.clone(),
            mode,
        };
        let mut orig = LayerCaches::new(&f, &geoms).expect("caches");
        orig.allow_rewind(REWIND);
        let run = |c: &mut LayerCaches, steps: &[(usize, u64)]| -> Vec<Vec<u32>> {
            let mut out = Vec::new();
            for &(t, s) in steps {
                for (i, g) in geoms.iter().enumerate() {
                    out.push(bits(&step(c.layer(i), *g, t, s + 100 * i as u64, 1.0)));
                }
            }
            out
        };
        run(&mut orig, &[(40, 1), (1, 2), (150, 3), (1, 4), (1, 5)]);
        let state = orig.save_state().expect("save");
        let path = dir.join(format!(
            "kvq-state-test-{}-{tag}-{name}.safetensors",
            std::process::id()
        ));
        candle_core::safetensors::save(&state, &path).expect("write");
        let loaded = candle_core::safetensors::load(&path, &Device::Cpu).expect("read");
        std::fs::remove_file(&path).expect("remove");
        assert_same_state(&name, &state, &loaded);
        let mut back = LayerCaches::restore(&f, &geoms, loaded, &Device::Cpu).expect("restore");
        assert_eq!(back.len(), orig.len(), "{name}");
        assert_eq!(back.min_truncate(), orig.min_truncate(), "{name}");
        assert_eq!(back.resident_bytes(), orig.resident_bytes(), "{name}");
        assert_eq!(back.method(), orig.method(), "{name}");
        let more = [(1, 10), (30, 11), (1, 12), (1, 13)];
        assert!(run(&mut orig, &more) == run(&mut back, &more), "{name}");
        let n = orig.len() - 5;
        assert_eq!(orig.can_truncate(n), back.can_truncate(n), "{name}");
        if orig.can_truncate(n) {
            orig.truncate(n).expect("truncate");
            back.truncate(n).expect("truncate");
            let after = [(1, 20), (8, 21)];
            assert!(run(&mut orig, &after) == run(&mut back, &after), "{name}");
        }
        assert_eq!(back.min_truncate(), orig.min_truncate(), "{name}");
    }
}

#[test]
fn layer_caches_round_trip_through_a_safetensors_file_on_the_cpu_path() {
    check_layers(Mode::Rolling, "cpu");
}

#[test]
fn layer_caches_round_trip_through_a_safetensors_file_on_the_tensor_path() {
    check_layers(Mode::Tensor, "tensor");
}

#[test]
fn host_and_tensor_path_states_restore_into_each_other() {
    let g = geom(Some(100));
    let steps = [(40, 1), (1, 2), (300, 3), (1, 4)];
    for (from, to) in [(Mode::Rolling, Mode::Tensor), (Mode::Tensor, Mode::Rolling)] {
        for (name, mut orig) in every_method(g, from) {
            orig.allow_rewind(REWIND);
            for &(t, s) in &steps {
                step(orig.as_mut(), g, t, s, 1.0);
            }
            let state = orig.save_state().expect("save");
            let mut back = fresh(g, to, &name);
            back.restore_state(&state, &Device::Cpu).expect("restore");
            assert_eq!(back.len(), orig.len(), "{name}");
            // The same answers as a cache of the target path fed the same steps.
            let mut want = fresh(g, to, &name);
            want.allow_rewind(REWIND);
            for &(t, s) in &steps {
                step(want.as_mut(), g, t, s, 1.0);
            }
            continue_both(
                &name,
                back.as_mut(),
                want.as_mut(),
                g,
                (&[1, 20, 1], 700, 1.0),
            );
        }
    }
}

/// The count `name` of `state`.
pub(crate) fn count(state: &CacheState, name: &str) -> i64 {
    state[name].to_vec1::<i64>().expect("i64")[0]
}
