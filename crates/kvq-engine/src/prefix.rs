//! The prefix cache: finished sequences' KV caches, held (compressed methods as their codes)
//! so that a later prompt starting with the same tokens under the same cache configuration
//! continues from them and prefills only the rest. Least recently used entries go first, and
//! the worker evicts them before it would make a request wait for KV memory.
//!
//! Invariant: an entry's `tokens` are exactly the positions its caches hold
//! (`caches.len() == tokens.len()`), and its first `exact` positions hold what a fresh prefill
//! of any prompt starting with them computes, bit for bit (fp16 and compressed alike).
//!
//! Exactness: a row's bits depend on its prefill chunk in two ways, never on the other rows
//! of the batch. A chunk of at least `DEQUANT_MIN_ROWS` rows takes the Q4_1 weights'
//! dequantized GEMM, a shorter one the q8-activation kernel; and attention works in tiles of
//! `TILE_POSITIONS` positions from the chunk's start, whose row grouping sets the order of the
//! score kernel's sums. A fresh prompt is prefilled in chunks `[k * chunk, (k + 1) * chunk)`.
//! So a continuation starts on a tile boundary, its chunks end where a fresh prefill's do
//! ([`chunk_end`]), and its first chunk takes the same GEMM as the fresh chunk around it
//! ([`exact_start`]). Decoded positions (a reply) went through the one-row path and are never
//! what a prefill of the same text computes; a prompt reusing them continues that sequence
//! exactly as it would have gone on, which is the point of a chat's next turn.

use crate::store::KvStore;
use kvq_cache::{CacheFactory, CacheGeometry, LayerCaches, TILE_POSITIONS};
use kvq_models::model::DEQUANT_MIN_ROWS;
use std::sync::Arc;

/// Reusing fewer tokens than this is not worth a copy of the caches.
pub(crate) const MIN_REUSE: usize = 16;

/// Positions a sequence's compressed caches keep in fp16 beyond their window, so that a prefix
/// ending up to this many tokens before the end of what they hold can still be continued from
/// (`KvCache::allow_rewind`): a client's next turn re-tokenizes the reply, drops a stop string,
/// or regenerates the last answer.
pub(crate) const REWIND: usize = 16;

/// One held prefix.
pub(crate) struct Entry {
    /// The cache configuration (`ResolvedCache::key`).
    key: String,
    /// The token ids of the positions the caches hold.
    tokens: Vec<u32>,
    /// Positions a fresh prefill computes the same (see the module docs).
    exact: usize,
    /// Positions that were prefilled (the rest were decoded).
    prefilled: usize,
    caches: LayerCaches,
    /// Resident bytes when stored.
    bytes: usize,
    /// Logical time of the last store or use (larger: more recent).
    used: u64,
    /// Whether the KV store holds exactly this (it was restored from there, or saved).
    saved: bool,
}

/// The held prefixes, least recently used evicted first.
pub(crate) struct PrefixCache {
    entries: Vec<Entry>,
    /// Most bytes held at once.
    limit: usize,
    clock: u64,
    /// Requests that continued from a held prefix or a running sequence, and their reused tokens.
    pub(crate) hits: u64,
    pub(crate) reused_tokens: u64,
    /// Where evicted entries go, and held ones at shutdown (`--kv-store`).
    store: Option<Arc<KvStore>>,
}

/// Where a prompt can start: `n` positions of a candidate's caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Match {
    /// The entry's index.
    pub(crate) index: usize,
    /// Positions to reuse.
    pub(crate) n: usize,
    /// Of the reused positions, those a fresh prefill computes the same: `n` when the
    /// continuation is exact.
    pub(crate) exact: usize,
}

/// End of the prefill chunk that starts at `from` in a prompt of `p` tokens: where a fresh
/// prefill's chunk around `from` ends.
pub(crate) fn chunk_end(from: usize, p: usize, chunk: usize) -> usize {
    p.min((from / chunk + 1) * chunk)
}

/// Positions of a prompt of `p` tokens prefilled from 0 (chunks of `chunk`) that a fresh
/// prefill of any longer prompt computes the same: every full tile, unless the last chunk was
/// short (another GEMM than a longer prompt's chunk there takes).
pub(crate) fn exact_prefix(p: usize, chunk: usize) -> usize {
    if p == 0 || !chunk.is_multiple_of(TILE_POSITIONS) || chunk < DEQUANT_MIN_ROWS {
        return 0;
    }
    let last = (p - 1) / chunk * chunk;
    match p - last >= DEQUANT_MIN_ROWS {
        true => p / TILE_POSITIONS * TILE_POSITIONS,
        false => last,
    }
}

/// The start at or below `m` from which prefilling the rest of a prompt of `p > m` tokens
/// computes every row as a fresh prefill does: a tile boundary, with a first chunk in the same
/// GEMM as the fresh chunk around it.
pub(crate) fn exact_start(m: usize, p: usize, chunk: usize) -> usize {
    let mut n = m / TILE_POSITIONS * TILE_POSITIONS;
    let j = n / chunk * chunk;
    let e = chunk_end(n, p, chunk);
    if e - j < DEQUANT_MIN_ROWS {
        // A short fresh chunk: the continuation's first chunk must be all of it.
        n = j;
    } else if e - n < DEQUANT_MIN_ROWS {
        n = (e - DEQUANT_MIN_ROWS) / TILE_POSITIONS * TILE_POSITIONS;
    }
    n
}

/// Reusable positions past the exact ones that are given up (prefilled again) to keep a
/// continuation exact; past this many (a long reply) all are reused.
pub(crate) const EXACT_SLACK: usize = 64;

/// What a candidate for reuse holds: its positions' tokens, how many of them were prefilled
/// (the rest decoded), how many of those are exact, and whether its caches can go back to a
/// position (`LayerCaches::can_truncate`; a saved prefix answers from its metadata).
pub(crate) struct Held<'a> {
    pub(crate) tokens: &'a [u32],
    pub(crate) prefilled: usize,
    pub(crate) exact: usize,
    pub(crate) can_truncate: &'a dyn Fn(usize) -> bool,
}

/// The reuse of `held` for `prompt`: `(n, exact)`, `(0, 0)` for none. It starts where the
/// continuation stays exact ([`exact_start`]) unless that gives up more than [`EXACT_SLACK`]
/// reusable positions (a long reply's decoded ones) or the caches can no longer go back there
/// (a compressed cache keeps only [`REWIND`] positions' fp16 rows past its window). Then it
/// continues from all the common positions if they reach into the decoded ones (the next turn
/// of a chat: that sequence going on, never a fresh prefill's bits anyway), and otherwise
/// reuses nothing: a prompt that only shares prefilled positions gets exactly a fresh
/// prefill's output, so the same prompt twice gives the same answer.
pub(crate) fn plan(held: &Held<'_>, prompt: &[u32], chunk: usize) -> (usize, usize) {
    let m = reusable(held.tokens, prompt);
    if m <= held.exact + EXACT_SLACK {
        let n = exact_start(m.min(held.exact), prompt.len(), chunk);
        if n >= MIN_REUSE && (held.can_truncate)(n) {
            return (n, n);
        }
    }
    match m > held.prefilled && (held.can_truncate)(m) {
        true => (m, held.exact.min(m)),
        false => (0, 0),
    }
}

/// Positions of `prompt` that `held` can serve: their longest common prefix, leaving at least
/// the prompt's last token to be prefilled (its logits pick the first generated token).
pub(crate) fn reusable(held: &[u32], prompt: &[u32]) -> usize {
    let common = held.iter().zip(prompt).take_while(|(a, b)| a == b).count();
    common.min(prompt.len().saturating_sub(1))
}

impl PrefixCache {
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            entries: Vec::new(),
            limit,
            clock: 0,
            hits: 0,
            reused_tokens: 0,
            store: None,
        }
    }

    /// Saves evicted entries to `store` and restores from it (`--kv-store`).
    pub(crate) fn with_store(mut self, store: Option<Arc<KvStore>>) -> Self {
        self.store = store;
        self
    }

    /// The KV store, if any.
    pub(crate) fn store(&self) -> Option<&KvStore> {
        self.store.as_deref()
    }

    /// An entry leaves memory: the store keeps it, unless it already does.
    fn release(&self, e: Entry) {
        if let (Some(store), false) = (&self.store, e.saved) {
            store.save(&e.key, &e.tokens, (e.prefilled, e.exact), &e.caches);
        }
    }

    /// Saves every held entry the store does not hold yet and waits for the writes (at
    /// shutdown); returns how many were saved.
    pub(crate) fn persist(&mut self) -> usize {
        let Some(store) = &self.store else {
            return 0;
        };
        let mut n = 0;
        for e in self.entries.iter_mut().filter(|e| !e.saved) {
            store.save(&e.key, &e.tokens, (e.prefilled, e.exact), &e.caches);
            e.saved = true;
            n += 1;
        }
        store.flush();
        n
    }

    /// When the store has a prefix under `key` serving more of `prompt` than `held` positions
    /// (what memory offers), restores it (caches from `factory` for layers `geoms` on
    /// `device`) and holds it, so that [`PrefixCache::best`] finds it.
    pub(crate) fn restore(
        &mut self,
        key: &str,
        prompt: &[u32],
        chunk: usize,
        held: usize,
        (factory, geoms, device): (&dyn CacheFactory, &[CacheGeometry], &candle_core::Device),
    ) {
        let Some(store) = self.store.clone() else {
            return;
        };
        let Some((stem, n)) = store.best(key, prompt, chunk).filter(|&(_, n)| n > held) else {
            return;
        };
        if let Some((caches, tokens, counts)) = store.load(&stem, factory, geoms, device) {
            tracing::debug!(
                "restored a {}-token prefix for {n} prompt positions",
                tokens.len()
            );
            self.hold(key.to_string(), tokens, counts, caches, true);
        }
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    /// Prefixes held.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Holds `caches` (whose positions are `tokens`) under `key`, then evicts the least
    /// recently used entries past the limit (this one too if it alone exceeds it). An entry
    /// whose tokens it extends or equals is replaced: it could only serve what this one serves.
    pub(crate) fn insert(
        &mut self,
        key: String,
        tokens: Vec<u32>,
        counts: (usize, usize),
        caches: LayerCaches,
    ) {
        self.hold(key, tokens, counts, caches, false);
    }

    /// [`PrefixCache::insert`]; `saved`: the store holds exactly this already.
    fn hold(
        &mut self,
        key: String,
        tokens: Vec<u32>,
        (prefilled, exact): (usize, usize),
        caches: LayerCaches,
        saved: bool,
    ) {
        if tokens.len() < MIN_REUSE || caches.len() != tokens.len() {
            return;
        }
        self.entries
            .retain(|e| !(e.key == key && tokens.starts_with(&e.tokens)));
        let bytes = caches.resident_bytes();
        let used = self.tick();
        self.entries.push(Entry {
            key,
            tokens,
            exact,
            prefilled,
            caches,
            bytes,
            used,
            saved,
        });
        self.evict_to(self.limit);
    }

    /// Evicts least recently used entries (to the store, if any) until at most `bytes` are
    /// held; returns how many bytes it freed.
    pub(crate) fn evict_to(&mut self, bytes: usize) -> usize {
        let mut freed = 0;
        while self.bytes() > bytes {
            let Some(lru) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].used) else {
                break;
            };
            let e = self.entries.swap_remove(lru);
            freed += e.bytes;
            self.release(e);
        }
        freed
    }

    /// The entry under `key` that serves most of `prompt` (at least [`MIN_REUSE`] positions),
    /// planned with [`plan`] for prefill chunks of `chunk`.
    pub(crate) fn best(&self, key: &str, prompt: &[u32], chunk: usize) -> Option<Match> {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.key == key)
            .map(|(index, e)| {
                let can = |n: usize| e.caches.can_truncate(n);
                let held = Held {
                    tokens: &e.tokens,
                    prefilled: e.prefilled,
                    exact: e.exact,
                    can_truncate: &can,
                };
                let (n, exact) = plan(&held, prompt, chunk);
                Match { index, n, exact }
            })
            .filter(|m| m.n >= MIN_REUSE)
            .max_by_key(|m| m.n)
    }

    /// Caches holding the first `m.n` positions of entry `m.index` (which [`PrefixCache::best`]
    /// found they can go back to). An entry used whole is taken out (the new sequence continues
    /// it); one used in part is copied and stays (it still serves its own continuation). `None`
    /// when the copy fails.
    pub(crate) fn take(&mut self, m: Match) -> Option<LayerCaches> {
        let used = self.tick();
        let whole = m.n == self.entries.get(m.index)?.tokens.len();
        let caches = if whole {
            self.entries.swap_remove(m.index).caches
        } else {
            let entry = &mut self.entries[m.index];
            entry.used = used;
            match entry.caches.fork() {
                Ok(c) => c,
                Err(e) => {
                    tracing::debug!("could not copy a held prefix: {e}");
                    return None;
                }
            }
        };
        continue_from(caches, m.n)
    }

    /// Counts a request that continued from `n` reused positions.
    pub(crate) fn count_hit(&mut self, n: usize) {
        self.hits += 1;
        self.reused_tokens += n as u64;
    }
}

/// `caches` truncated to `n` positions, or `None` (with a debug line) where a layer cannot
/// go back that far (a compressed window's fp16 rows, a sliding window's rows are gone;
/// nothing is truncated then).
pub(crate) fn continue_from(mut caches: LayerCaches, n: usize) -> Option<LayerCaches> {
    match caches.truncate(n) {
        Ok(()) => Some(caches),
        Err(e) => {
            tracing::debug!("a held prefix cannot be continued from position {n}: {e}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};
    use kvq_cache::{CacheGeometry, CacheRegistry, CacheSpec};

    fn geoms() -> Vec<CacheGeometry> {
        vec![
            CacheGeometry {
                n_heads: 2,
                n_kv_heads: 1,
                head_dim: 8,
                sliding_window: None,
                max_tokens: 1024,
            };
            2
        ]
    }

    /// fp16 caches holding `n` positions.
    fn caches(n: usize) -> LayerCaches {
        let reg = CacheRegistry::builtin();
        let r = reg
            .resolve(&CacheSpec {
                method: Some("fp16".into()),
                bits: None,
            })
            .expect("fp16");
        let mut c = LayerCaches::new(r.factory.as_ref(), &geoms()).expect("caches");
        let k = Tensor::ones((1, n, 8), candle_core::DType::F32, &Device::Cpu).expect("k");
        for l in 0..c.n_layers() {
            c.layer(l).append(&k, &k).expect("append");
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
}
