//! The KV store against real caches: a restart restores what was saved, bit for bit; files of
//! another model, format or configuration, cut short or corrupted are skipped; the bytes on
//! disk stay within the limit, least recently used removed first.

use super::*;
use candle_core::{Device, Tensor};
use kvq_cache::{CacheRegistry, CacheSpec, ResolvedCache};

const CHUNK: usize = 512;

fn geoms() -> Vec<CacheGeometry> {
    vec![
        CacheGeometry {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 64,
            sliding_window: None,
            max_tokens: 4096,
        };
        2
    ]
}

fn resolve(method: &str) -> ResolvedCache {
    CacheRegistry::builtin()
        .resolve(&CacheSpec {
            method: Some(method.into()),
            bits: None,
        })
        .expect("method")
}

/// Random rows, different per `seed`.
fn rows(heads: usize, t: usize, d: usize, seed: u64) -> Tensor {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let v: Vec<f32> = (0..heads * t * d)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(v, (heads, t, d), &Device::Cpu).expect("rows")
}

/// Caches of `method` holding `n` positions (appended in chunks of 40, attended after each).
fn filled(r: &ResolvedCache, n: usize, seed: u64) -> LayerCaches {
    let g = geoms();
    let mut c = LayerCaches::new(r.factory.as_ref(), &g).expect("caches");
    c.allow_rewind(crate::prefix::REWIND);
    let mut at = 0;
    while at < n {
        let t = (n - at).min(40);
        for (l, g) in g.iter().enumerate() {
            let (h, d) = (g.n_kv_heads, g.head_dim);
            let s = seed + (at * 7 + l) as u64;
            c.layer(l)
                .append(&rows(h, t, d, s), &rows(h, t, d, s + 1))
                .expect("append");
            c.layer(l)
                .attend(&rows(g.n_heads, t, d, s + 2), 0.25)
                .expect("attend");
        }
        at += t;
    }
    c
}

/// One more position appended and attended in every layer: the outputs' bits.
fn step(c: &mut LayerCaches, seed: u64) -> Vec<u32> {
    let g = geoms();
    let mut bits = Vec::new();
    for (l, g) in g.iter().enumerate() {
        let (h, d) = (g.n_kv_heads, g.head_dim);
        c.layer(l)
            .append(&rows(h, 1, d, seed), &rows(h, 1, d, seed + 1))
            .expect("append");
        let out = c
            .layer(l)
            .attend(&rows(g.n_heads, 1, d, seed + 2), 0.25)
            .expect("attend");
        let v = out
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .expect("out");
        bits.extend(v.iter().map(|x| x.to_bits()));
    }
    bits
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvq-store-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn open(d: &Path, hash: &str, max: u64) -> KvStore {
    let config = KvStoreConfig {
        dir: d.to_path_buf(),
        max_bytes: max,
        model_hash: hash.into(),
    };
    KvStore::open(config, CHUNK, geoms().len()).expect("open")
}

fn toks(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 5 + salt).collect()
}

/// The prompt of a next turn: `held` and a few more tokens.
fn next_turn(held: &[u32]) -> Vec<u32> {
    let mut p = held.to_vec();
    p.extend([9001, 9002, 9003]);
    p
}

fn restore(s: &KvStore, r: &ResolvedCache, prompt: &[u32]) -> Option<(LayerCaches, usize)> {
    let (stem, n) = s.best(&r.key, prompt, CHUNK)?;
    let (c, _, _) = s.load(&stem, r.factory.as_ref(), &geoms(), &Device::Cpu)?;
    Some((c, n))
}

#[test]
fn a_restart_restores_the_saved_caches_bit_for_bit() {
    for method in ["fp16", "turboquant-mse", "qjl"] {
        let d = dir(&format!("restart-{method}"));
        let r = resolve(method);
        let tokens = toks(150, 1);
        let mut original = filled(&r, 150, 7);
        {
            let s = open(&d, "model-a", 1 << 30);
            s.save(&r.key, &tokens, (0, 0), &original);
            s.flush();
            assert_eq!(s.stats().files, 1);
            assert_eq!(s.stats().saves, 1);
        }
        let s = open(&d, "model-a", 1 << 30);
        assert_eq!(s.stats().files, 1, "{method}");
        let (mut back, n) = restore(&s, &r, &next_turn(&tokens)).expect("restored");
        // Held as decoded (none exact): the whole prefix continues (`prefix::plan`).
        assert_eq!((n, back.len()), (150, 150), "{method}");
        assert_eq!(back.resident_bytes(), original.resident_bytes(), "{method}");
        assert_eq!(s.stats().loads, 1);
        for i in 0..3 {
            assert_eq!(
                step(&mut back, 100 + i),
                step(&mut original, 100 + i),
                "{method} {i}"
            );
        }
        // Another cache configuration finds nothing.
        let other = resolve(if method == "fp16" { "qjl" } else { "fp16" });
        assert!(s.best(&other.key, &next_turn(&tokens), CHUNK).is_none());
        let _ = std::fs::remove_dir_all(&d);
    }
}

/// The one prefix file pair in `d`: (tensors, metadata).
fn only_files(d: &Path) -> (PathBuf, PathBuf) {
    let mut st = None;
    let mut js = None;
    for e in std::fs::read_dir(d).expect("dir").flatten() {
        let p = e.path();
        match p.extension().and_then(|x| x.to_str()) {
            Some("safetensors") => st = Some(p),
            Some("json") => js = Some(p),
            _ => {}
        }
    }
    (st.expect("tensors"), js.expect("metadata"))
}

/// A store in `d` holding one saved fp16 prefix of `tokens`.
fn saved_one(d: &Path, tokens: &[u32]) -> ResolvedCache {
    let r = resolve("fp16");
    let s = open(d, "model-a", 1 << 30);
    s.save(&r.key, tokens, (0, 0), &filled(&r, tokens.len(), 3));
    s.flush();
    r
}

fn edit_meta(js: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(js).expect("read")).expect("json");
    f(&mut v);
    std::fs::write(js, serde_json::to_vec(&v).expect("json")).expect("write");
}

#[test]
fn files_of_another_model_format_or_version_are_skipped() {
    let tokens = toks(64, 2);
    let d = dir("foreign");
    let r = saved_one(&d, &tokens);
    let s = open(&d, "model-b", 1 << 30);
    assert_eq!(
        (s.stats().files, s.stats().skipped),
        (0, 1),
        "another model"
    );
    assert!(s.best(&r.key, &next_turn(&tokens), CHUNK).is_none());
    drop(s);
    // Kept for the model it belongs to.
    assert_eq!(open(&d, "model-a", 1 << 30).stats().files, 1);
    let (_, js) = only_files(&d);
    for (field, value) in [
        ("format", serde_json::json!(99)),
        ("kvq_version", serde_json::json!("0.0.0")),
        ("prefill_chunk", serde_json::json!(64)),
        ("n_layers", serde_json::json!(3)),
        ("exact", serde_json::json!(1000)),
    ] {
        let before = std::fs::read(&js).expect("read");
        edit_meta(&js, |v| v[field] = value);
        let s = open(&d, "model-a", 1 << 30);
        assert_eq!((s.stats().files, s.stats().skipped), (0, 1), "{field}");
        drop(s);
        std::fs::write(&js, before).expect("restore");
    }
    // Metadata naming another configuration than the file name says: skipped.
    edit_meta(&js, |v| v["cache_key"] = serde_json::json!("qjl/3/false/0"));
    assert_eq!(open(&d, "model-a", 1 << 30).stats().files, 0);
    std::fs::write(&js, b"{ not json").expect("write");
    assert_eq!(open(&d, "model-a", 1 << 30).stats().skipped, 1);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn truncated_or_corrupted_tensors_are_never_restored() {
    let tokens = toks(64, 3);
    // Cut short: skipped (and removed) when the store opens.
    let d = dir("truncated");
    let r = saved_one(&d, &tokens);
    let (st, _) = only_files(&d);
    let len = std::fs::metadata(&st).expect("len").len();
    std::fs::File::options()
        .write(true)
        .open(&st)
        .and_then(|f| f.set_len(len / 2))
        .expect("truncate");
    let s = open(&d, "model-a", 1 << 30);
    assert_eq!((s.stats().files, s.stats().skipped), (0, 1));
    assert!(!st.exists(), "removed");
    drop(s);
    // One byte changed: found, but its SHA-256 fails when read, so nothing is restored.
    let r2 = saved_one(&d, &tokens);
    assert_eq!(r.key, r2.key);
    let (st, js) = only_files(&d);
    let mut bytes = std::fs::read(&st).expect("read");
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&st, &bytes).expect("write");
    let s = open(&d, "model-a", 1 << 30);
    assert_eq!(s.stats().files, 1);
    assert!(restore(&s, &r, &next_turn(&tokens)).is_none());
    assert_eq!(
        (s.stats().files, s.stats().skipped, s.stats().loads),
        (0, 1, 0)
    );
    assert!(!st.exists() && !js.exists(), "removed");
    drop(s);
    // Intact, but restored into caches of another method: refused by the caches.
    saved_one(&d, &tokens);
    let s = open(&d, "model-a", 1 << 30);
    let (stem, _) = s.best(&r.key, &next_turn(&tokens), CHUNK).expect("found");
    let mse = resolve("turboquant-mse");
    assert!(
        s.load(&stem, mse.factory.as_ref(), &geoms(), &Device::Cpu)
            .is_none()
    );
    assert_eq!(s.stats().files, 0);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn disk_use_stays_within_the_limit_least_recently_used_first() {
    let d = dir("limit");
    let r = resolve("fp16");
    let one = {
        let s = open(&d, "m", 1 << 30);
        s.save(&r.key, &toks(64, 0), (0, 0), &filled(&r, 64, 1));
        s.flush();
        s.stats().bytes
    };
    let s = open(&d, "m", 2 * one + one / 2);
    s.save(&r.key, &toks(64, 1), (0, 0), &filled(&r, 64, 2));
    s.flush();
    // Use the first: the second is now the oldest.
    assert!(restore(&s, &r, &next_turn(&toks(64, 0))).is_some());
    std::thread::sleep(std::time::Duration::from_millis(20));
    s.save(&r.key, &toks(64, 2), (0, 0), &filled(&r, 64, 3));
    s.flush();
    assert_eq!(s.stats().files, 2);
    assert!(s.stats().bytes <= 2 * one + one / 2);
    assert!(
        s.best(&r.key, &next_turn(&toks(64, 1)), CHUNK).is_none(),
        "oldest removed"
    );
    assert!(s.best(&r.key, &next_turn(&toks(64, 0)), CHUNK).is_some());
    assert!(s.best(&r.key, &next_turn(&toks(64, 2)), CHUNK).is_some());
    drop(s);
    // The order outlives a restart, and a smaller limit removes the oldest at once.
    let s = open(&d, "m", one + one / 2);
    assert_eq!(s.stats().files, 1);
    assert!(s.best(&r.key, &next_turn(&toks(64, 2)), CHUNK).is_some());
    // A prefix extended (the next turn) replaces the one it extends.
    let mut longer = toks(64, 2);
    longer.extend(500..540);
    s.save(&r.key, &longer, (0, 0), &filled(&r, longer.len(), 4));
    s.flush();
    assert_eq!(
        s.stats().files,
        1,
        "alone larger than the limit: not kept, and the one it extends stays"
    );
    assert!(s.best(&r.key, &next_turn(&toks(64, 2)), CHUNK).is_some());
    let s = open(&d, "m", 1 << 30);
    s.save(&r.key, &toks(64, 2), (0, 0), &filled(&r, 64, 3));
    s.save(&r.key, &longer, (0, 0), &filled(&r, longer.len(), 4));
    s.flush();
    assert_eq!(s.stats().files, 1);
    let _ = std::fs::remove_dir_all(&d);
}
