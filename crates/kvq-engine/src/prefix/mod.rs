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
//!
//! Branches: a compressed cache can go back only [`REWIND`] positions past its window (older
//! rows are codes, and a continuation needs them in fp16), so two conversations sharing a
//! system prompt would never share its caches. When a prompt's longest common prefix with a
//! held or running sequence is longer than what it can reuse, its own prefill stops at that
//! prefix's [`snapshot_point`] once and holds a copy of its caches there (a branch entry, never
//! taken whole): the next prompt with that prefix continues from the copy.

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
    /// A copy made at a shared prefix (see the module docs): used whole, it is copied again
    /// and stays, and a longer entry replaces it only if that one can go back to it.
    branch: bool,
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

/// Where a sequence whose prefill starts at `from` (0, or a reused prefix's end) should hold
/// a copy of its caches for a prompt prefix of `m` common positions (prompt of `p` tokens,
/// chunks of `chunk`), or `None`. Its chunk around the point is cut there, so the point is a
/// continuation start ([`exact_start`]) whose cut-off first part is empty or takes the same
/// GEMM as the fresh chunk (at least `DEQUANT_MIN_ROWS` rows): every row stays what a fresh
/// prefill computes, the copy's and the sequence's own.
pub(crate) fn snapshot_point(m: usize, from: usize, p: usize, chunk: usize) -> Option<usize> {
    if m >= p {
        return None;
    }
    let mut n = exact_start(m, p, chunk);
    let start = from.max(n / chunk * chunk);
    if n > start && n - start < DEQUANT_MIN_ROWS {
        n = start;
    }
    (n > from && n >= MIN_REUSE).then_some(n)
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
            self.hold(key.to_string(), tokens, counts, caches, (true, false));
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
        self.hold(key, tokens, counts, caches, (false, false));
    }

    /// Holds a copy of a running sequence's caches at a shared prefix (`tokens`, every one
    /// exact): a branch entry (see the module docs).
    pub(crate) fn insert_branch(&mut self, key: String, tokens: Vec<u32>, caches: LayerCaches) {
        let n = tokens.len();
        self.hold(key, tokens, (n, n), caches, (false, true));
    }

    /// The longest common prefix of `prompt` with an entry under `key`.
    pub(crate) fn longest_common(&self, key: &str, prompt: &[u32]) -> usize {
        self.entries
            .iter()
            .filter(|e| e.key == key)
            .map(|e| reusable(&e.tokens, prompt))
            .max()
            .unwrap_or(0)
    }

    /// [`PrefixCache::insert`]; `saved`: the store holds exactly this already; `branch`: see
    /// [`Entry::branch`].
    fn hold(
        &mut self,
        key: String,
        tokens: Vec<u32>,
        (prefilled, exact): (usize, usize),
        caches: LayerCaches,
        (saved, branch): (bool, bool),
    ) {
        if tokens.len() < MIN_REUSE || caches.len() != tokens.len() {
            return;
        }
        // What this entry serves too goes; a branch only if this can go back to it.
        self.entries.retain(|e| {
            let covered = e.key == key && tokens.starts_with(&e.tokens);
            !(covered && (!e.branch || caches.can_truncate(e.tokens.len())))
        });
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
            branch,
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
    /// it); one used in part, or a branch, is copied and stays (it still serves its own
    /// continuation, or the next prompt sharing it). `None` when the copy fails.
    pub(crate) fn take(&mut self, m: Match) -> Option<LayerCaches> {
        let used = self.tick();
        let e = self.entries.get(m.index)?;
        let whole = m.n == e.tokens.len() && !e.branch;
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
mod tests;
