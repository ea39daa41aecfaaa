//! The KV store (`kvq serve --kv-store DIR`): held prefixes saved to disk in their compressed
//! form when the prefix cache evicts them and at shutdown, and restored when a later prompt
//! (after a restart, too) starts with their tokens under the same model and cache
//! configuration, so a conversation stays warm across restarts.
//!
//! Opening the store reads only the metadata (`file.rs`): a file of another format, kvq
//! version, model, prefill chunk or layer count is skipped with a log line, and so is one whose
//! tensor file is missing or of the wrong length (that pair is removed). A prefix is read when
//! a request can use it, and its tensors are restored only after their length and SHA-256
//! matched and the caches accepted the state (`KvCache::restore_state` checks every shape and
//! count); a file that fails is removed with a log line and the request prefills as usual.
//! Files are written on a thread of their own, so an eviction waits for the disk only when
//! [`QUEUED`] states are already waiting; the bytes on disk stay within `max_bytes`, least
//! recently saved or used removed first.
//!
//! Invariant: every index entry has had its metadata read and checked against this server,
//! and its tensor file had the length the metadata names when the entry was made.

mod file;
#[cfg(test)]
mod tests;

use crate::prefix::{self, Held, MIN_REUSE};
use file::StoredMeta;
use kvq_cache::{CacheFactory, CacheGeometry, CacheState, LayerCaches};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::time::SystemTime;

/// Where the store lives and how much it may take.
#[derive(Debug, Clone)]
pub struct KvStoreConfig {
    pub dir: PathBuf,
    /// Most bytes its files may take together.
    pub max_bytes: u64,
    /// The weights' identity (SHA-256); files of other weights are skipped.
    pub model_hash: String,
}

/// The store could not be opened.
#[derive(Debug, thiserror::Error)]
#[error("kv store {dir}: {message}")]
pub struct StoreError {
    dir: String,
    message: String,
}

/// What the store holds and has done, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    pub files: usize,
    pub bytes: u64,
    /// Prefixes restored from disk, written to disk, and files skipped or removed as unusable.
    pub loads: u64,
    pub saves: u64,
    pub skipped: u64,
}

/// Prefix states copied to the host and waiting to be written, at most.
const QUEUED: usize = 2;

/// One saved prefix.
struct Stored {
    stem: String,
    meta: StoredMeta,
    /// Bytes both files take.
    bytes: u64,
    /// When it was saved or last restored (its metadata file's modification time).
    used: SystemTime,
}

#[derive(Default)]
struct Index {
    entries: Vec<Stored>,
    stats: StoreStats,
}

impl Index {
    fn refresh(&mut self) {
        self.stats.files = self.entries.len();
        self.stats.bytes = self.entries.iter().map(|e| e.bytes).sum();
    }
}

enum Msg {
    Save(Box<(StoredMeta, CacheState)>),
    Flush(mpsc::Sender<()>),
}

/// See the module docs. Shared by the engine's worker and the writer thread.
pub struct KvStore {
    dir: PathBuf,
    max_bytes: u64,
    model_hash: String,
    chunk: usize,
    n_layers: usize,
    index: Arc<Mutex<Index>>,
    /// At most [`QUEUED`] states wait for the writer: past that an eviction waits for the
    /// disk rather than hold more host copies than the KV budget counts.
    writer: Mutex<mpsc::SyncSender<Msg>>,
}

impl std::fmt::Debug for KvStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvStore")
            .field("dir", &self.dir)
            .field("max_bytes", &self.max_bytes)
            .finish()
    }
}

fn lock(index: &Mutex<Index>) -> std::sync::MutexGuard<'_, Index> {
    index.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Removes both files of `stem`; one already gone is fine.
fn remove_files(dir: &Path, stem: &str) {
    let (st, js) = file::paths(dir, stem);
    for p in [js, st] {
        if let Err(e) = std::fs::remove_file(&p)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!("kv store: could not remove {}: {e}", p.display());
        }
    }
}

/// Removes least recently used entries (and their files) until they take at most `max` bytes.
fn evict_to(dir: &Path, index: &mut Index, max: u64) {
    while index.entries.iter().map(|e| e.bytes).sum::<u64>() > max {
        let Some(i) = (0..index.entries.len()).min_by_key(|&i| index.entries[i].used) else {
            break;
        };
        let e = index.entries.swap_remove(i);
        tracing::info!(
            "kv store: removed {} ({} tokens) to stay within its limit",
            e.stem,
            e.meta.tokens.len()
        );
        remove_files(dir, &e.stem);
    }
    index.refresh();
}

impl KvStore {
    /// Opens (creating) `config.dir` for a model of `n_layers` layers prefilled in chunks of
    /// `chunk`, reading every prefix's metadata; starts the writer thread.
    pub fn open(config: KvStoreConfig, chunk: usize, n_layers: usize) -> Result<Self, StoreError> {
        let dir = config.dir;
        let err = |message: String| StoreError {
            dir: dir.display().to_string(),
            message,
        };
        std::fs::create_dir_all(&dir).map_err(|e| err(e.to_string()))?;
        let listing = std::fs::read_dir(&dir).map_err(|e| err(e.to_string()))?;
        let mut index = Index::default();
        let mut tensor_files = Vec::new();
        for item in listing.flatten() {
            let path = item.path();
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if !name.starts_with("kvq-") {
                continue;
            }
            if name.ends_with(".tmp") {
                // A write a crash cut short.
                let _ = std::fs::remove_file(&path);
            } else if let Some(stem) = name.strip_suffix(".safetensors") {
                tensor_files.push(stem.to_string());
            } else if let Some(stem) = name.strip_suffix(".json") {
                match Self::check(&dir, stem, &config.model_hash, chunk, n_layers) {
                    Ok(e) => index.entries.push(e),
                    Err(why) => {
                        index.stats.skipped += 1;
                        tracing::warn!("kv store: skipped {}: {why}", path.display());
                    }
                }
            }
        }
        // A tensor file without metadata: its write never finished.
        for stem in tensor_files {
            if !file::paths(&dir, &stem).1.exists() {
                remove_files(&dir, &stem);
            }
        }
        evict_to(&dir, &mut index, config.max_bytes);
        let index = Arc::new(Mutex::new(index));
        let (tx, rx) = mpsc::sync_channel(QUEUED);
        let (wdir, windex, max) = (dir.clone(), index.clone(), config.max_bytes);
        std::thread::Builder::new()
            .name("kvq-store".into())
            .spawn(move || writer(&wdir, &windex, max, &rx))
            .map_err(|e| err(format!("could not start its writer: {e}")))?;
        Ok(Self {
            dir,
            max_bytes: config.max_bytes,
            model_hash: config.model_hash,
            chunk,
            n_layers,
            index,
            writer: Mutex::new(tx),
        })
    }

    /// The index entry of metadata file `stem`, checked against this server (module docs).
    fn check(
        dir: &Path,
        stem: &str,
        model_hash: &str,
        chunk: usize,
        n_layers: usize,
    ) -> Result<Stored, String> {
        let (st, js) = file::paths(dir, stem);
        let meta = file::read_meta(&js)?;
        if let Some(why) = meta.mismatch(model_hash, chunk, n_layers) {
            return Err(why);
        }
        if file::stem(&meta.cache_key, &meta.tokens) != stem {
            return Err("its name does not match its contents".into());
        }
        let tensors = std::fs::metadata(&st).map(|m| m.len()).unwrap_or(0);
        if tensors != meta.tensor_bytes {
            remove_files(dir, stem);
            return Err(format!(
                "truncated or missing tensors ({tensors} bytes of {}): removed",
                meta.tensor_bytes
            ));
        }
        let json = std::fs::metadata(&js).map_err(|e| e.to_string())?;
        Ok(Stored {
            stem: stem.to_string(),
            bytes: tensors + json.len(),
            used: json.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            meta,
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The byte limit.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Files held and what was done.
    pub fn stats(&self) -> StoreStats {
        lock(&self.index).stats
    }

    /// The saved prefix under `key` that serves most of `prompt` (at least [`MIN_REUSE`]
    /// positions, planned as a held one is, `prefix::plan`): its stem and the positions.
    pub(crate) fn best(&self, key: &str, prompt: &[u32], chunk: usize) -> Option<(String, usize)> {
        let index = lock(&self.index);
        index
            .entries
            .iter()
            .filter(|e| e.meta.cache_key == key)
            .map(|e| {
                let min = e.meta.min_truncate;
                let can = |n: usize| n >= min;
                let held = Held {
                    tokens: &e.meta.tokens,
                    prefilled: e.meta.prefilled,
                    exact: e.meta.exact,
                    can_truncate: &can,
                };
                (e, prefix::plan(&held, prompt, chunk).0)
            })
            .filter(|&(_, n)| n >= MIN_REUSE)
            .max_by_key(|&(_, n)| n)
            .map(|(e, n)| (e.stem.clone(), n))
    }

    /// Restores saved prefix `stem` into caches from `factory` (layers `geoms`, on
    /// `device`): the caches, their tokens, and (prefilled, exact) positions. A prefix that
    /// cannot be read or restored is removed with a log line, and `None` returned.
    pub(crate) fn load(
        &self,
        stem: &str,
        factory: &dyn CacheFactory,
        geoms: &[CacheGeometry],
        device: &candle_core::Device,
    ) -> Option<(LayerCaches, Vec<u32>, (usize, usize))> {
        let meta = {
            let index = lock(&self.index);
            index.entries.iter().find(|e| e.stem == stem)?.meta.clone()
        };
        let started = std::time::Instant::now();
        let mut read_s = 0.0;
        let restored = file::read_state(&self.dir, stem, &meta).and_then(|state| {
            read_s = started.elapsed().as_secs_f64();
            LayerCaches::restore(factory, geoms, state, device).map_err(|e| e.to_string())
        });
        let mut index = lock(&self.index);
        let at = index.entries.iter().position(|e| e.stem == stem);
        let caches = match restored {
            Ok(c) if c.len() == meta.tokens.len() => c,
            failed => {
                let why = match failed {
                    Err(e) => e,
                    Ok(c) => format!("holds {} positions, not {}", c.len(), meta.tokens.len()),
                };
                tracing::warn!("kv store: skipped {stem} (removed): {why}");
                if let Some(i) = at {
                    index.entries.swap_remove(i);
                }
                remove_files(&self.dir, stem);
                index.stats.skipped += 1;
                index.refresh();
                return None;
            }
        };
        let now = SystemTime::now();
        if let Some(i) = at {
            index.entries[i].used = now;
        }
        index.stats.loads += 1;
        drop(index);
        // The order of use outlives a restart.
        let js = file::paths(&self.dir, stem).1;
        if let Err(e) = std::fs::File::options()
            .write(true)
            .open(&js)
            .and_then(|f| f.set_modified(now))
        {
            tracing::debug!("kv store: could not mark {} used: {e}", js.display());
        }
        tracing::info!(
            "kv store: restored {stem}: {} tokens, {} in {:.0} ms (read and checked {:.0} ms)",
            meta.tokens.len(),
            crate::error::human_bytes(meta.tensor_bytes as usize),
            started.elapsed().as_secs_f64() * 1e3,
            read_s * 1e3
        );
        Some((caches, meta.tokens, (meta.prefilled, meta.exact)))
    }

    /// Queues `caches` (holding `tokens` under cache configuration `key`) to be written; the
    /// state is copied to the host now, the files written by the writer thread.
    pub(crate) fn save(
        &self,
        key: &str,
        tokens: &[u32],
        (prefilled, exact): (usize, usize),
        caches: &LayerCaches,
    ) {
        let state = match caches.save_state() {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!("kv store: a {key} prefix cannot be saved: {e}");
                return;
            }
        };
        let meta = StoredMeta {
            format: file::FORMAT,
            kvq_version: env!("CARGO_PKG_VERSION").into(),
            model_hash: self.model_hash.clone(),
            cache_key: key.into(),
            prefill_chunk: self.chunk,
            n_layers: self.n_layers,
            tokens: tokens.to_vec(),
            prefilled,
            exact,
            min_truncate: caches.min_truncate(),
            resident_bytes: caches.resident_bytes(),
            tensor_bytes: 0,
            sha256: String::new(),
        };
        let tx = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        if tx.send(Msg::Save(Box::new((meta, state)))).is_err() {
            tracing::warn!("kv store: its writer has stopped; a prefix was not saved");
        }
    }

    /// Waits until every queued prefix is written.
    pub(crate) fn flush(&self) {
        let (tx, rx) = mpsc::channel();
        let sent = self
            .writer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(Msg::Flush(tx));
        if sent.is_ok() {
            let _ = rx.recv();
        }
    }
}

/// The writer thread: writes queued prefixes, replacing those they extend, and keeps the
/// store within `max` bytes.
fn writer(dir: &Path, index: &Mutex<Index>, max: u64, rx: &mpsc::Receiver<Msg>) {
    while let Ok(msg) = rx.recv() {
        let (mut meta, state) = match msg {
            Msg::Flush(done) => {
                let _ = done.send(());
                continue;
            }
            Msg::Save(b) => *b,
        };
        let stem = file::stem(&meta.cache_key, &meta.tokens);
        let bytes = match file::write(dir, &stem, &mut meta, &state) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!("kv store: could not save a prefix: {e}");
                remove_files(dir, &stem);
                let mut index = lock(index);
                index.entries.retain(|e| e.stem != stem);
                index.refresh();
                continue;
            }
        };
        if bytes > max {
            tracing::info!(
                "kv store: a {}-token prefix takes {bytes} bytes, more than --kv-store-max: not kept",
                meta.tokens.len()
            );
            remove_files(dir, &stem);
            let mut index = lock(index);
            index.entries.retain(|e| e.stem != stem);
            index.refresh();
            continue;
        }
        let mut index = lock(index);
        // An entry this one extends could only serve what this one serves.
        let (key, tokens) = (&meta.cache_key, &meta.tokens);
        let replaced: Vec<String> = index
            .entries
            .iter()
            .filter(|e| {
                e.stem == stem || (&e.meta.cache_key == key && tokens.starts_with(&e.meta.tokens))
            })
            .map(|e| e.stem.clone())
            .collect();
        index.entries.retain(|e| !replaced.contains(&e.stem));
        for old in replaced.iter().filter(|s| **s != stem) {
            remove_files(dir, old);
        }
        tracing::debug!("kv store: saved {stem} ({} tokens)", meta.tokens.len());
        index.entries.push(Stored {
            stem,
            meta,
            bytes,
            used: SystemTime::now(),
        });
        index.stats.saves += 1;
        evict_to(dir, &mut index, max);
    }
}
