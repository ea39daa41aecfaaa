//! Resolving a Hub id from the hub cache alone, with no request at all (`HF_HUB_OFFLINE=1`, or
//! a Hub that cannot be reached): `refs/<revision>` (or a commit's own snapshot) gives the
//! snapshot, and the files in it go through the same selection as the Hub's listing.

use crate::select::{Plan, plan};
use crate::{HubConfig, HubId, Resolved};
use hf_hub::Repo;
use std::path::{Path, PathBuf};

/// The repository's folder in the cache (`models--org--repo`).
pub(crate) fn repo_dir(cfg: &HubConfig, id: &HubId) -> PathBuf {
    cfg.cache_dir
        .join(Repo::model(id.repo.clone()).folder_name())
}

/// `id` from the cache, or why it cannot be.
pub(crate) fn resolve_cached(cfg: &HubConfig, id: &HubId) -> Result<Resolved, String> {
    let dir = repo_dir(cfg, id);
    if !dir.is_dir() {
        return Err(format!("{} does not exist", dir.display()));
    }
    let rev = id.revision();
    let commit = match std::fs::read_to_string(dir.join("refs").join(rev)) {
        Ok(c) => c.trim().to_string(),
        // A commit has no ref; its snapshot is named by it.
        Err(_) if dir.join("snapshots").join(rev).is_dir() => rev.to_string(),
        Err(_) => {
            return Err(format!(
                "it has no refs/{rev}: revision '{rev}' was never fetched"
            ));
        }
    };
    let snapshot = dir.join("snapshots").join(&commit);
    let mut names = Vec::new();
    walk(&snapshot, "", &mut names);
    names.sort();
    let name_refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let chosen = plan(&id.repo, &name_refs, id.quant.as_deref()).map_err(|e| {
        let text = e.to_string();
        let why = text
            .strip_prefix(&format!("{}: ", id.repo))
            .unwrap_or(&text);
        format!("in snapshot {commit}, {why}")
    })?;
    let path = match &chosen {
        Plan::Gguf { files, .. } => snapshot.join(&files[0]),
        Plan::Safetensors {
            index: Some(index), ..
        } => {
            let text = std::fs::read_to_string(snapshot.join(index))
                .map_err(|e| format!("{index}: {e}"))?;
            let weights =
                kvq_models::files::safetensors_index_files(&text).map_err(|e| e.to_string())?;
            if let Some(missing) = weights.iter().find(|w| !names.contains(w)) {
                return Err(format!("{missing} (named by {index}) was never downloaded"));
            }
            snapshot.clone()
        }
        Plan::Safetensors { .. } => snapshot.clone(),
    };
    Ok(Resolved {
        path,
        id: id.given.clone(),
        commit,
        downloaded: 0,
        from_cache: true,
    })
}

/// The files under `dir` whose links resolve (a broken link is an unfinished download), as
/// `/`-separated paths relative to the snapshot.
fn walk(dir: &Path, prefix: &str, out: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        let rel = format!("{prefix}{name}");
        match std::fs::metadata(&path) {
            Ok(m) if m.is_dir() => walk(&path, &format!("{rel}/"), out),
            Ok(m) if m.is_file() => out.push(rel),
            _ => {}
        }
    }
}
