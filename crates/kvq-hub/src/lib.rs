//! kvq-hub: from what `--model` says to files on disk. A local GGUF or Hugging Face directory
//! is used as it is; a Hub id (`org/repo`, `org/repo:QUANT`, `org/repo@revision`) is looked
//! up on the Hub (`HF_ENDPOINT`) and its files downloaded through hf-hub into the standard hub
//! cache (`HF_HUB_CACHE`, `HF_HOME`) that huggingface_hub and transformers share, or found in
//! that cache without a request when `HF_HUB_OFFLINE` is set or the Hub cannot be reached.

pub mod cache;
pub mod config;
mod download;
pub mod error;
pub mod listing;
pub mod select;
pub mod spec;

pub use config::HubConfig;
pub use error::HubError;
pub use spec::{HubId, ModelSpec, parse_model_spec};

use download::Fetcher;
use listing::{NoAnswer, Sibling};
use select::Plan;
use std::path::PathBuf;

/// A model made local.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// What the loader opens: the GGUF (the first part of a split one) or the snapshot
    /// directory of a Hugging Face checkpoint.
    pub path: PathBuf,
    /// The id clients see (`/v1/models`): the Hub id as the user gave it.
    pub id: String,
    /// The commit the files are from.
    pub commit: String,
    /// Bytes downloaded by this call.
    pub downloaded: u64,
    /// Whether the cache answered without the Hub (offline, or the Hub unreachable).
    pub from_cache: bool,
}

/// Makes the Hub id `id` local: the files its plan names, from the cache where they are
/// there (sizes checked against the Hub's listing) and downloaded where not.
pub async fn resolve(cfg: &HubConfig, id: &HubId) -> Result<Resolved, HubError> {
    if cfg.offline {
        return cache::resolve_cached(cfg, id).map_err(|why| HubError::NotCached {
            id: id.given.clone(),
            cache: cfg.cache_dir.clone(),
            why,
        });
    }
    let listing = match listing::fetch(cfg, id).await? {
        Ok(l) => l,
        Err(NoAnswer(reason)) => {
            return match cache::resolve_cached(cfg, id) {
                Ok(r) => {
                    tracing::warn!(
                        "could not reach {} ({reason}); using {} from the hub cache (commit {})",
                        cfg.endpoint,
                        id.given,
                        r.commit
                    );
                    Ok(r)
                }
                Err(why) => Err(HubError::Unreachable {
                    repo: id.repo.clone(),
                    endpoint: cfg.endpoint.clone(),
                    reason,
                    cache_state: format!(
                        "the hub cache {} cannot stand in ({why})",
                        cfg.cache_dir.display()
                    ),
                }),
            };
        }
    };
    let names: Vec<&str> = listing
        .siblings
        .iter()
        .map(|s| s.rfilename.as_str())
        .collect();
    let chosen = select::plan(&id.repo, &names, id.quant.as_deref())?;
    let sibling = |name: &str| -> Result<&Sibling, HubError> {
        listing
            .siblings
            .iter()
            .find(|s| s.rfilename == name)
            .ok_or_else(|| HubError::Selection {
                repo: id.repo.clone(),
                why: format!("{name} is named by the checkpoint but not in the repository"),
            })
    };
    let mut fetcher = Fetcher::new(cfg, id, &listing.sha);
    let path = match chosen {
        Plan::Gguf { files, label } => {
            if let Some(label) = label {
                tracing::info!(repo = %id.repo, quant = %label, parts = files.len(), "GGUF chosen: {}", files[0]);
            }
            for f in &files {
                fetcher.fetch(sibling(f)?).await?;
            }
            fetcher.pointer(&files[0])
        }
        Plan::Safetensors {
            meta,
            index,
            weights,
        } => {
            for f in &meta {
                fetcher.fetch(sibling(f)?).await?;
            }
            check_config(id, &fetcher.pointer("config.json"))?;
            let weights = match index {
                Some(index) => {
                    let p = fetcher.pointer(&index);
                    let text = std::fs::read_to_string(&p).map_err(HubError::io(&p))?;
                    kvq_models::files::safetensors_index_files(&text).map_err(|source| {
                        HubError::Model {
                            repo: id.repo.clone(),
                            source,
                        }
                    })?
                }
                None => weights,
            };
            for w in &weights {
                fetcher.fetch(sibling(w)?).await?;
            }
            fetcher.snapshot()
        }
    };
    write_ref(cfg, id, &listing.sha)?;
    Ok(Resolved {
        path,
        id: id.given.clone(),
        commit: listing.sha,
        downloaded: fetcher.downloaded,
        from_cache: false,
    })
}

/// Refuses, before any weights are downloaded, a checkpoint whose config.json kvq cannot run.
fn check_config(id: &HubId, config: &std::path::Path) -> Result<(), HubError> {
    let model = |source| HubError::Model {
        repo: id.repo.clone(),
        source,
    };
    let text = std::fs::read_to_string(config).map_err(HubError::io(config))?;
    let cfg = kvq_models::model::ModelConfig::from_hf_json(&text).map_err(model)?;
    kvq_models::model::Family::of(&cfg).map_err(model)?;
    Ok(())
}

/// Records `revision -> commit` in `refs/` as huggingface_hub does, and drops the ref hf-hub
/// writes under the commit's own name (downloads go by commit, so a moving branch cannot mix
/// two commits' files; huggingface_hub keeps no ref named by a commit).
fn write_ref(cfg: &HubConfig, id: &HubId, commit: &str) -> Result<(), HubError> {
    let refs = cache::repo_dir(cfg, id).join("refs");
    if id.revision() != commit {
        let _ = std::fs::remove_file(refs.join(commit));
        let repo = hf_hub::Repo::with_revision(
            id.repo.clone(),
            hf_hub::RepoType::Model,
            id.revision().into(),
        );
        hf_hub::Cache::new(cfg.cache_dir.clone())
            .repo(repo)
            .create_ref(commit)
            .map_err(HubError::io(refs.join(id.revision())))?;
    }
    Ok(())
}
