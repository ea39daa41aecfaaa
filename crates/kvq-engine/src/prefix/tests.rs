//! The prefix cache's planning (exact continuation starts, snapshot points) and its entries
//! (longest match, partial copies, branches, LRU eviction).

use super::*;
use candle_core::{Device, Tensor};
use kvq_cache::{CacheGeometry, CacheRegistry, CacheSpec};

fn geoms() -> Vec<CacheGeometry> {
    vec![
        CacheGeometry {
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 64,
            sliding_window: None,
            max_tokens: 1024,
        };
        2
    ]
}

/// fp16 caches holding `n` positions.
fn caches(n: usize) -> LayerCaches {
    caches_of("fp16", n)
}

/// Caches of `method` holding `n` positions (random rows), with the engine's rewind.
fn caches_of(method: &str, n: usize) -> LayerCaches {
    let reg = CacheRegistry::builtin();
    let r = reg
        .resolve(&CacheSpec {
            method: Some(method.into()),
            bits: None,
        })
        .expect("method");
    let mut c = LayerCaches::new(r.factory.as_ref(), &geoms()).expect("caches");
    c.allow_rewind(REWIND);
    let k = Tensor::randn(0f32, 1.0, (1, n, 64), &Device::Cpu).expect("k");
    let q = Tensor::randn(0f32, 1.0, (2, n, 64), &Device::Cpu).expect("q");
    for l in 0..c.n_layers() {
        c.layer(l).append(&k, &k).expect("append");
        c.layer(l).attend(&q, 0.125).expect("attend");
    }
    c
}

fn toks(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 3 + salt).collect()
}

#[test]
fn continuations_start_where_a_fresh_prefill_computes_the_same() {
    // A tile boundary; the GEMM of the fresh chunk around it.
    assert_eq!(exact_start(200, 240, 512), 192);
    assert_eq!(
        exact_start(208, 230, 512),
        192,
        "first chunk of 22 rows would be q8"
    );
    assert_eq!(
        exact_start(515, 530, 512),
        512,
        "a short fresh chunk is taken whole"
    );
    assert_eq!(exact_start(600, 2000, 512), 592);
    assert_eq!(exact_start(1020, 2000, 512), 992);
    for (m, p) in [(200, 240), (208, 230), (515, 530), (1020, 2000), (40, 41)] {
        let n = exact_start(m, p, 512);
        assert!(n <= m && n.is_multiple_of(TILE_POSITIONS));
        let (j, e) = (n / 512 * 512, chunk_end(n, p, 512));
        assert_eq!(
            e - n >= DEQUANT_MIN_ROWS,
            e - j >= DEQUANT_MIN_ROWS,
            "{m} {p}"
        );
    }
    // Held prompts: full tiles, not a short last chunk.
    assert_eq!(exact_prefix(200, 512), 192);
    assert_eq!(exact_prefix(520, 512), 512);
    assert_eq!(exact_prefix(560, 512), 560);
    assert_eq!(exact_prefix(100, 20), 0);
    // Past the exact positions (a reply): everything reusable.
    let held: Vec<u32> = (0..300).collect();
    let c = caches(300);
    let mut prompt = held.clone();
    prompt.extend([7, 7, 7]);
    let can = |n: usize| c.can_truncate(n);
    let h = |prefilled, exact| Held {
        tokens: &held,
        prefilled,
        exact,
        can_truncate: &can,
    };
    assert_eq!(plan(&h(200, 192), &prompt, 512), (300, 192));
    assert_eq!(plan(&h(240, 240), &prompt, 512), (240, 240), "60 given up");
    assert_eq!(plan(&h(300, 300), &prompt, 512), (256, 256));
    // A short prompt (a q8 chunk, nothing exact) and its reply: the reply continues.
    assert_eq!(plan(&h(28, 0), &prompt, 512), (300, 0));
    assert_eq!(chunk_end(0, 2000, 512), 512);
    assert_eq!(chunk_end(700, 2000, 512), 1024);
    assert_eq!(chunk_end(1900, 2000, 512), 2000);
}

#[test]
fn reuse_leaves_the_last_prompt_token() {
    assert_eq!(reusable(&[1, 2, 3], &[1, 2, 3]), 2);
    assert_eq!(reusable(&[1, 2, 3], &[1, 2, 3, 4]), 3);
    assert_eq!(reusable(&[1, 2, 3, 4], &[1, 2, 9, 4]), 2);
    assert_eq!(reusable(&[], &[1]), 0);
}

#[test]
fn longest_match_under_the_same_key_wins() {
    let mut p = PrefixCache::new(usize::MAX);
    // Held as if decoded, none exact: every reusable position is taken (see `plan`).
    p.insert("a".into(), toks(100, 0), (0, 0), caches(100));
    let mut longer = toks(100, 0);
    longer.extend(1000..1020);
    // A continuation replaces the entry it extends.
    p.insert("a".into(), longer.clone(), (0, 0), caches(120));
    assert_eq!(p.len(), 1);
    p.insert("b".into(), longer.clone(), (0, 0), caches(120));
    let mut prompt = longer.clone();
    prompt.push(7);
    let m = p.best("a", &prompt, 512).expect("match");
    assert_eq!(m.n, 120);
    assert_eq!(p.best("c", &prompt, 512), None);
    // Too short a common prefix is no match.
    assert_eq!(p.best("a", &toks(MIN_REUSE - 1, 0), 512), None);
    // Used whole: taken out.
    let c = p.take(m).expect("caches");
    assert_eq!(c.len(), 120);
    assert_eq!(p.len(), 1);
}

#[test]
fn a_partial_match_copies_and_keeps_the_entry() {
    let mut p = PrefixCache::new(usize::MAX);
    p.insert("a".into(), toks(150, 0), (0, 0), caches(150));
    let mut prompt = toks(90, 0);
    prompt.extend([999, 998]);
    let m = p.best("a", &prompt, 512).expect("match");
    assert_eq!(m.n, 90);
    let c = p.take(m).expect("caches");
    assert_eq!(c.len(), 90);
    assert_eq!(p.len(), 1);
    assert_eq!(p.entries[0].caches.len(), 150);
    // With its first 150 exact, the copy starts on a tile boundary whose first chunk takes
    // the fresh chunk's GEMM instead.
    p.entries[0].exact = 150;
    let m = p.best("a", &prompt, 512).expect("match");
    assert_eq!((m.n, m.exact), (48, 48));
}

#[test]
fn least_recently_used_goes_first() {
    let one = caches(80).resident_bytes();
    let mut p = PrefixCache::new(2 * one);
    p.insert("a".into(), toks(80, 0), (0, 0), caches(80));
    p.insert("a".into(), toks(80, 1), (0, 0), caches(80));
    // Touch the first: the second is now the oldest.
    let mut prompt = toks(80, 0);
    prompt.push(5);
    let m = p.best("a", &prompt, 512).expect("match");
    assert_eq!(m.n, 80);
    p.entries[m.index].used = p.tick();
    p.insert("a".into(), toks(80, 2), (0, 0), caches(80));
    assert_eq!(p.len(), 2);
    let mut prompt1 = toks(80, 1);
    prompt1.push(5);
    assert_eq!(
        p.best("a", &prompt1, 512),
        None,
        "the LRU entry was evicted"
    );
    assert!(p.best("a", &prompt, 512).is_some());
    assert_eq!(p.evict_to(0), 2 * one);
    assert_eq!((p.len(), p.bytes()), (0, 0));
}

#[test]
fn an_entry_larger_than_the_limit_is_not_held() {
    let mut p = PrefixCache::new(1);
    p.insert("a".into(), toks(20, 0), (0, 0), caches(20));
    assert_eq!(p.len(), 0);
}

#[test]
fn snapshots_cut_a_chunk_only_where_both_parts_stay_exact() {
    // A system prompt of 300 shared tokens in a 340-token prompt: the tile boundary 288.
    assert_eq!(snapshot_point(300, 0, 340, 512), Some(288));
    // Past the reused positions only, and never the whole prompt.
    assert_eq!(snapshot_point(300, 288, 340, 512), None);
    assert_eq!(snapshot_point(340, 0, 340, 512), None);
    // The continuation's first chunk needs the GEMM of the fresh chunk: 16 rows would not.
    assert_eq!(exact_start(300, 310, 512), 272);
    assert_eq!(snapshot_point(300, 0, 310, 512), Some(272));
    // A cut 16 rows into a chunk would prefill those 16 in the other GEMM: the chunk start.
    assert_eq!(snapshot_point(530, 0, 2000, 512), Some(512));
    assert_eq!(snapshot_point(600, 0, 2000, 512), Some(592));
    // From a reused prefix inside the chunk, the same rule from there.
    assert_eq!(snapshot_point(530, 520, 2000, 512), None);
    assert_eq!(snapshot_point(600, 520, 2000, 512), Some(592));
    // Too short to be worth a copy.
    assert_eq!(snapshot_point(20, 0, 340, 512), None);
    for m in (0..1100).step_by(7) {
        for from in [0, 16, 100, 512, 530] {
            let p = 1100;
            let Some(n) = snapshot_point(m, from, p, 512) else {
                continue;
            };
            assert!(n > from && n <= m && n >= MIN_REUSE, "{m} {from}");
            assert!(n.is_multiple_of(TILE_POSITIONS), "{m} {from}");
            let start = from.max(n / 512 * 512);
            assert!(n == start || n - start >= DEQUANT_MIN_ROWS, "{m} {from}");
            let (j, e) = (n / 512 * 512, chunk_end(n, p, 512));
            assert!(
                e - n >= DEQUANT_MIN_ROWS || e - j < DEQUANT_MIN_ROWS,
                "{m} {from}"
            );
        }
    }
}

#[test]
fn a_branch_serves_prompts_a_compressed_entry_cannot_go_back_for() {
    let method = "turboquant-mse";
    let mut p = PrefixCache::new(usize::MAX);
    let system = toks(96, 0);
    // A conversation of 300 positions holds its last 16 + window in fp16 only.
    let mut conv = system.clone();
    conv.extend(toks(204, 9));
    let long = caches_of(method, 300);
    assert!(!long.can_truncate(96), "the premise: no way back to 96");
    p.insert("a".into(), conv.clone(), (300, 288), long);
    let mut prompt = system.clone();
    prompt.extend(toks(40, 5));
    assert_eq!(p.best("a", &prompt, 512), None);
    assert_eq!(p.longest_common("a", &prompt), 96);
    // The copy at the shared prefix serves it, and stays when used whole.
    p.insert_branch("a".into(), system.clone(), caches_of(method, 96));
    // Not a tail of under DEQUANT_MIN_ROWS tokens: its first chunk would take the other GEMM
    // than the fresh one, and the copy cannot go back 32 positions.
    let mut short = system.clone();
    short.extend([5, 6, 7]);
    assert_eq!(p.best("a", &short, 512), None);
    for _ in 0..2 {
        let m = p.best("a", &prompt, 512).expect("the branch");
        assert_eq!((m.n, m.exact), (96, 96));
        assert_eq!(p.take(m).expect("copy").len(), 96);
        assert_eq!(p.len(), 2);
    }
    // A longer compressed entry does not replace it; an fp16 one (which can go back) does.
    p.insert("a".into(), conv.clone(), (300, 288), caches_of(method, 300));
    assert_eq!(p.len(), 2);
    p.insert("a".into(), conv, (300, 288), caches(300));
    assert_eq!(p.len(), 1);
    assert_eq!(p.best("a", &prompt, 512).map(|m| m.n), Some(96));
}
