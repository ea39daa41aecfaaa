//! `KvCache::restore_state` refuses what does not fit, for every method on the CPU path and on
//! the tensor path: another method, geometry, fp16 window, sinks, codecs or key centering; a
//! missing tensor, one of another dtype or shape, an unknown one, counts that disagree; a cache
//! that is not fresh. Each is a `CacheError::State`, never a panic, and leaves the cache fresh
//! (the good state then restores into it). Layers' states must fit their layers; a capturing
//! cache cannot be saved.

use crate::CacheError;
use crate::methods::turboquant_mse::TurboQuantMseFactory;
use crate::methods::vecinfer::capture::CaptureFactory;
use crate::rolling_tests::{Mode, every_method};
use crate::state_tests::{ByName, REWIND, count, fresh, geom, step};
use crate::traits::{CacheFactory, CacheGeometry, CacheState, KvCache, LayerCaches};
use candle_core::{DType, Device, Tensor};

fn scalar(v: i64) -> Tensor {
    Tensor::new(&[v], &Device::Cpu).expect("scalar")
}

/// Restoring `state` into `cache` (fresh) fails with a state error and leaves it fresh: the
/// good state then restores into it.
fn refuse(what: &str, mut cache: Box<dyn KvCache>, state: &CacheState, good: Option<&CacheState>) {
    match cache.restore_state(state, &Device::Cpu) {
        Err(CacheError::State(_)) => {}
        Err(e) => panic!("{what}: not a state error: {e}"),
        Ok(()) => panic!("{what}: restored"),
    }
    assert_eq!(cache.len(), 0, "{what}: half restored");
    if let Some(good) = good {
        cache
            .restore_state(good, &Device::Cpu)
            .unwrap_or_else(|e| panic!("{what}: the good state after a bad one: {e}"));
    }
}

/// The states of every method after a prefix that fixes the key center.
fn states(g: CacheGeometry, mode: Mode) -> Vec<(String, CacheState)> {
    every_method(g, mode)
        .into_iter()
        .map(|(name, mut c)| {
            c.allow_rewind(REWIND);
            for (t, s) in [(40, 1), (1, 2), (1, 3)] {
                step(c.as_mut(), g, t, s, 1.0);
            }
            (name, c.save_state().expect("save"))
        })
        .collect()
}

#[test]
fn states_that_do_not_fit_are_errors() {
    let g = geom(None);
    for mode in [Mode::Rolling, Mode::Tensor] {
        let all = states(g, mode);
        for (name, state) in &all {
            let make = || fresh(g, mode, name);
            // Another method.
            for (other, _) in all.iter().filter(|(o, _)| o != name) {
                refuse(
                    &format!("{name} into {other}"),
                    fresh(g, mode, other),
                    state,
                    None,
                );
            }
            // Another geometry.
            for g2 in [
                geom(Some(100)),
                CacheGeometry { n_heads: 4, ..g },
                CacheGeometry { n_kv_heads: 1, ..g },
                CacheGeometry { head_dim: 32, ..g },
                CacheGeometry {
                    max_tokens: 30,
                    ..g
                },
            ] {
                refuse(
                    &format!("{name} at {g2:?}"),
                    fresh(g2, mode, name),
                    state,
                    None,
                );
            }
            // A cache that holds positions already.
            let mut used = make();
            step(used.as_mut(), g, 3, 9, 1.0);
            assert!(used.restore_state(state, &Device::Cpu).is_err(), "{name}");
            assert_eq!(used.len(), 3, "{name}");
            for key in state.keys() {
                let what = |how: &str| format!("{name}: {key} {how}");
                let mut s = state.clone();
                s.remove(key);
                refuse(&what("missing"), make(), &s, Some(state));
                let t = &state[key];
                let other = match t.dtype() {
                    DType::F32 => DType::F64,
                    _ => DType::F32,
                };
                let mut s = state.clone();
                s.insert(key.clone(), t.to_dtype(other).expect("dtype"));
                refuse(&what("of another dtype"), make(), &s, Some(state));
                let longer = Tensor::cat(
                    &[
                        t.flatten_all().expect("flat"),
                        Tensor::zeros(1, t.dtype(), &Device::Cpu).expect("zero"),
                    ],
                    0,
                )
                .expect("cat");
                let mut s = state.clone();
                s.insert(key.clone(), longer);
                refuse(&what("of another shape"), make(), &s, Some(state));
            }
            let mut s = state.clone();
            s.insert("bogus".into(), scalar(1));
            refuse(
                &format!("{name}: an unknown tensor"),
                make(),
                &s,
                Some(state),
            );
            // Counts that disagree.
            let len = count(state, "len");
            let mut bad: Vec<(&str, i64)> =
                vec![("len", len - 1), ("len", len + 1), ("len", -1), ("roll", 2)];
            if name.starts_with('f') {
                let from = count(state, "k.from");
                bad.extend([("k.from", from + 1), ("k.cap", 1), ("spare", 2)]);
            } else {
                let first = count(state, "exact.first");
                let from = count(state, "codes.k.from");
                bad.extend([
                    ("exact.first", len + 1),
                    ("exact.window", 8),
                    ("exact.sinks", 3),
                    ("exact.recent_k.cap", 1),
                    ("exact.recent_k.from", first + 1),
                    ("codes.k.from", from + 1),
                    ("codes.v.cap", 1),
                    ("center.kind", 3),
                    ("center.exact", 3),
                ]);
                // Host rows start at `first` (device rows may start before it).
                if first > 0 && count(state, "exact.recent_k.from") == first {
                    bad.push(("exact.first", first - 1));
                }
                // A pending center needs every fp16 row.
                let mut s = state.clone();
                s.insert("center.kind".into(), scalar(0));
                s.remove("center.mu");
                s.remove("center.spread");
                s.remove("center.exact");
                if first > 0 {
                    refuse(
                        &format!("{name}: pending, rows gone"),
                        make(),
                        &s,
                        Some(state),
                    );
                }
            }
            for (key, v) in bad {
                let mut s = state.clone();
                s.insert(key.into(), scalar(v));
                refuse(&format!("{name}: {key} = {v}"), make(), &s, Some(state));
            }
        }
        // Another fp16 window, seed or bits than the state's turboquant-mse (window 16, 2
        // sinks, 3 bits).
        let (_, mse) = all
            .iter()
            .find(|(n, _)| n == "turboquant-mse")
            .expect("mse");
        let base = TurboQuantMseFactory {
            window: 16,
            sinks: 2,
            ..TurboQuantMseFactory::new(3)
        };
        let ok = base.create(0, &g).expect("cache");
        let mut ok = ok;
        ok.restore_state(mse, &Device::Cpu)
            .expect("the same factory");
        for (what, f) in [
            ("window 8", TurboQuantMseFactory { window: 8, ..base }),
            ("sinks 4", TurboQuantMseFactory { sinks: 4, ..base }),
            ("another seed", TurboQuantMseFactory { seed: 99, ..base }),
            (
                "4 bits",
                TurboQuantMseFactory {
                    window: 16,
                    sinks: 2,
                    ..TurboQuantMseFactory::new(4)
                },
            ),
            (
                "no centering",
                TurboQuantMseFactory {
                    center_keys: false,
                    ..base
                },
            ),
        ] {
            refuse(what, f.create(0, &g).expect("cache"), mse, None);
        }
    }
}

#[test]
fn layer_states_must_fit_their_layers_and_capture_caches_cannot_be_saved() {
    let geoms = [geom(None), geom(None)];
    let f = ByName {
        name: "turboquant-mse".into(),
        mode: Mode::Rolling,
    };
    let mut caches = LayerCaches::new(&f, &geoms).expect("caches");
    for (i, g) in geoms.iter().enumerate() {
        step(caches.layer(i), *g, 20, i as u64, 1.0);
    }
    let state = caches.save_state().expect("save");
    let mut stray = state.clone();
    stray.insert("layer.2.len".into(), scalar(20));
    assert!(LayerCaches::restore(&f, &geoms, stray, &Device::Cpu).is_err());
    assert!(LayerCaches::restore(&f, &geoms[..1], state.clone(), &Device::Cpu).is_err());
    let mut short = state.clone();
    short.retain(|k, _| k.starts_with("layer.0."));
    assert!(LayerCaches::restore(&f, &geoms, short, &Device::Cpu).is_err());
    let back = LayerCaches::restore(&f, &geoms, state, &Device::Cpu).expect("restore");
    assert_eq!(back.len(), 20);

    let capture = CaptureFactory::new(false);
    let mut c = capture.create(0, &geoms[0]).expect("capture");
    step(c.as_mut(), geoms[0], 4, 1, 1.0);
    assert!(matches!(c.save_state(), Err(CacheError::State(_))));
    let mut c = capture.create(0, &geoms[0]).expect("capture");
    let dense = fresh(geoms[0], Mode::Rolling, "fp16")
        .save_state()
        .expect("save");
    assert!(matches!(
        c.restore_state(&dense, &Device::Cpu),
        Err(CacheError::State(_))
    ));
}
