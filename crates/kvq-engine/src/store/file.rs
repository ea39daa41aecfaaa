//! One saved prefix on disk: `kvq-<id>.safetensors` (the caches' state, compressed methods as
//! their codes) and `kvq-<id>.json` (what it is: format version, kvq version, model hash, cache
//! configuration, prefill chunk, token ids, and the tensor file's length and SHA-256). The JSON
//! is written last and names the tensor file's exact bytes, so a file cut short, changed, or
//! left half written by a crash is recognized and never restored.

use kvq_cache::CacheState;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// The layout this kvq writes; files of any other are skipped.
pub(crate) const FORMAT: u32 = 1;

/// Largest metadata file read (a prefix of a million tokens is about 8 MB of JSON).
const MAX_META_BYTES: u64 = 64 << 20;

/// What a saved prefix is (the `.json` beside its tensors).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct StoredMeta {
    /// [`FORMAT`] when written.
    pub(crate) format: u32,
    /// The kvq version that wrote it (another build may compute other bits).
    pub(crate) kvq_version: String,
    /// The weights' SHA-256 (`kvq_server::calibration::model_hash`).
    pub(crate) model_hash: String,
    /// `ResolvedCache::key`: method or preset, bits, and the preset's parameters.
    pub(crate) cache_key: String,
    /// The prefill chunk its exact positions were counted for.
    pub(crate) prefill_chunk: usize,
    /// Layers saved.
    pub(crate) n_layers: usize,
    /// The token ids of the positions held.
    pub(crate) tokens: Vec<u32>,
    /// Positions prefilled (the rest decoded), and those a fresh prefill computes the same.
    pub(crate) prefilled: usize,
    pub(crate) exact: usize,
    /// The smallest position the caches can be continued from (`LayerCaches::min_truncate`).
    pub(crate) min_truncate: usize,
    /// The caches' resident bytes when saved.
    pub(crate) resident_bytes: usize,
    /// The tensor file's length and SHA-256 (hex).
    pub(crate) tensor_bytes: u64,
    pub(crate) sha256: String,
}

impl StoredMeta {
    /// Why this file does not belong to a server of `model_hash` with prefill chunk `chunk`
    /// and `n_layers` layers, or whose counts disagree; `None` when it does.
    pub(crate) fn mismatch(
        &self,
        model_hash: &str,
        chunk: usize,
        n_layers: usize,
    ) -> Option<String> {
        let n = self.tokens.len();
        if self.format != FORMAT {
            return Some(format!(
                "format version {}, this kvq reads {FORMAT}",
                self.format
            ));
        }
        if self.kvq_version != env!("CARGO_PKG_VERSION") {
            return Some(format!(
                "written by kvq {}, this is {}",
                self.kvq_version,
                env!("CARGO_PKG_VERSION")
            ));
        }
        if self.model_hash != model_hash {
            return Some(format!("made by another model ({})", self.model_hash));
        }
        if self.prefill_chunk != chunk {
            return Some(format!(
                "made with prefill chunk {}, this server uses {chunk}",
                self.prefill_chunk
            ));
        }
        if self.n_layers != n_layers {
            return Some(format!(
                "{} layers, the model has {n_layers}",
                self.n_layers
            ));
        }
        if self.prefilled > n || self.exact > n || self.min_truncate > n {
            return Some("counts past its tokens".into());
        }
        None
    }
}

/// The two paths of the prefix with file stem `stem`.
pub(crate) fn paths(dir: &Path, stem: &str) -> (PathBuf, PathBuf) {
    (
        dir.join(format!("{stem}.safetensors")),
        dir.join(format!("{stem}.json")),
    )
}

/// The file stem of a prefix: one per cache configuration and token sequence.
pub(crate) fn stem(cache_key: &str, tokens: &[u32]) -> String {
    let mut h = Sha256::new();
    h.update(cache_key.as_bytes());
    h.update([0]);
    tokens.iter().for_each(|t| h.update(t.to_le_bytes()));
    format!("kvq-{}", hex(&h.finalize()[..16]))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes `path` whole or not at all: a temporary file in the same directory, synced, then
/// renamed over it.
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)
}

/// Writes `state` and `meta` (its `tensor_bytes` and `sha256` filled in here) as `stem` in
/// `dir`; returns the bytes both files take.
pub(crate) fn write(
    dir: &Path,
    stem: &str,
    meta: &mut StoredMeta,
    state: &CacheState,
) -> Result<u64, String> {
    let tensors =
        safetensors::serialize(state.iter(), None).map_err(|e| format!("serializing: {e}"))?;
    meta.tensor_bytes = tensors.len() as u64;
    meta.sha256 = hex(&Sha256::digest(&tensors));
    let json = serde_json::to_vec(meta).map_err(|e| format!("metadata: {e}"))?;
    let (st, js) = paths(dir, stem);
    write_atomic(&st, &tensors).map_err(|e| format!("{}: {e}", st.display()))?;
    write_atomic(&js, &json).map_err(|e| format!("{}: {e}", js.display()))?;
    Ok((tensors.len() + json.len()) as u64)
}

/// Reads the metadata `path` (a `.json` of this store).
pub(crate) fn read_meta(path: &Path) -> Result<StoredMeta, String> {
    let len = std::fs::metadata(path).map_err(|e| e.to_string())?.len();
    if len > MAX_META_BYTES {
        return Err(format!("{len} bytes of metadata, more than any prefix has"));
    }
    let text = std::fs::read(path).map_err(|e| e.to_string())?;
    serde_json::from_slice(&text).map_err(|e| format!("unreadable metadata: {e}"))
}

/// Reads the tensors of `meta`'s prefix `stem`, checking their length and SHA-256 first.
pub(crate) fn read_state(dir: &Path, stem: &str, meta: &StoredMeta) -> Result<CacheState, String> {
    let (st, _) = paths(dir, stem);
    let bytes = std::fs::read(&st).map_err(|e| e.to_string())?;
    if bytes.len() as u64 != meta.tensor_bytes {
        return Err(format!(
            "truncated or grown: {} bytes, {} written",
            bytes.len(),
            meta.tensor_bytes
        ));
    }
    if hex(&Sha256::digest(&bytes)) != meta.sha256 {
        return Err("corrupted: its SHA-256 is not the one written".into());
    }
    candle_core::safetensors::load_buffer(&bytes, &candle_core::Device::Cpu)
        .map_err(|e| format!("unreadable tensors: {e}"))
}
