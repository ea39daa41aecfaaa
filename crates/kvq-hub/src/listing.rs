//! The Hub's description of a repository at a revision (`GET
//! /api/models/{repo}/revision/{rev}?blobs=true`: its commit, and each file's size and sha256
//! or git blob id) through hf-hub's client, and the one mapping from the Hub's HTTP failures
//! (status and `x-error-code`) to [`HubError`].

use crate::{HubConfig, HubError, HubId};
use hf_hub::api::tokio::{Api, ApiBuilder};
use hf_hub::{Cache, Repo, RepoType};
use serde::Deserialize;

/// A repository at one commit.
#[derive(Debug, Clone, Deserialize)]
pub struct Listing {
    /// The commit the revision resolved to.
    pub sha: String,
    pub siblings: Vec<Sibling>,
}

/// One file of a [`Listing`].
#[derive(Debug, Clone, Deserialize)]
pub struct Sibling {
    /// The path inside the repository.
    pub rfilename: String,
    #[serde(default)]
    pub size: Option<u64>,
    /// The git blob id (the cache's blob name for files outside LFS).
    #[serde(rename = "blobId", default)]
    pub blob_id: Option<String>,
    /// Large files: their sha256 (the cache's blob name) and size.
    #[serde(default)]
    pub lfs: Option<Lfs>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Lfs {
    pub sha256: String,
    #[serde(default)]
    pub size: Option<u64>,
}

impl Sibling {
    /// The size the Hub gives, if any.
    pub fn size(&self) -> Option<u64> {
        self.lfs.as_ref().and_then(|l| l.size).or(self.size)
    }

    /// The name of this file's blob in the hub cache: the sha256 of an LFS file, else the git
    /// blob id, as the Hub's `x-linked-etag` / `ETag` give them to every client.
    pub fn blob_name(&self) -> Option<&str> {
        self.lfs
            .as_ref()
            .map(|l| l.sha256.as_str())
            .or(self.blob_id.as_deref())
            .filter(|e| !e.is_empty() && e.chars().all(|c| c.is_ascii_hexdigit()))
    }
}

/// hf-hub's client for `cfg`: endpoint, cache and token, without its own progress bars.
pub(crate) fn api(cfg: &HubConfig) -> Result<Api, HubError> {
    ApiBuilder::from_cache(Cache::new(cfg.cache_dir.clone()))
        .with_endpoint(cfg.endpoint.clone())
        .with_token(cfg.token.clone())
        .with_progress(false)
        .with_user_agent("kvq", env!("CARGO_PKG_VERSION"))
        .build()
        .map_err(|e| HubError::BadSpec(format!("could not set up the Hub client: {e}")))
}

/// A request that got no HTTP answer.
pub(crate) struct NoAnswer(pub String);

/// The listing of `id` at its revision: `Ok(Err(NoAnswer))` when the Hub could not be reached
/// (the caller may fall back on the cache), `Err` when it answered with a failure.
pub(crate) async fn fetch(
    cfg: &HubConfig,
    id: &HubId,
) -> Result<Result<Listing, NoAnswer>, HubError> {
    let api = api(cfg)?;
    let repo = Repo::with_revision(id.repo.clone(), RepoType::Model, id.revision().into());
    let response = match api
        .repo(repo)
        .info_request()
        .query(&[("blobs", "true")])
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) => return Ok(Err(NoAnswer(error_chain(&e)))),
    };
    let status = response.status().as_u16();
    if !response.status().is_success() {
        let header = |k: &str| {
            response
                .headers()
                .get(k)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let (code, message) = (header("x-error-code"), header("x-error-message"));
        return Err(status_error(
            cfg,
            id,
            None,
            status,
            code.as_deref(),
            message.as_deref(),
        ));
    }
    let body = match response.bytes().await {
        Ok(b) => b,
        Err(e) => return Ok(Err(NoAnswer(error_chain(&e)))),
    };
    serde_json::from_slice(&body)
        .map(Ok)
        .map_err(|e| HubError::Http {
            repo: id.repo.clone(),
            status,
            what: "the repository listing".into(),
            detail: format!(": not a listing ({e}); is HF_ENDPOINT a Hugging Face Hub?"),
        })
}

/// The error for a failure status of the Hub, for the repository (`file` None) or one file.
/// `code` is the Hub's `x-error-code` (RepoNotFound, RevisionNotFound, EntryNotFound,
/// GatedRepo) when the answer carried one.
pub(crate) fn status_error(
    cfg: &HubConfig,
    id: &HubId,
    file: Option<&str>,
    status: u16,
    code: Option<&str>,
    message: Option<&str>,
) -> HubError {
    let repo = id.repo.clone();
    let detail = message.map(|m| format!(", \"{m}\"")).unwrap_or_default();
    match (code, status, file) {
        (Some("RevisionNotFound"), ..) => HubError::RevisionNotFound {
            repo,
            revision: id.revision().into(),
        },
        (Some("EntryNotFound"), _, Some(f)) | (None, 404, Some(f)) => HubError::FileNotFound {
            repo,
            file: f.into(),
            revision: id.revision().into(),
        },
        (Some("RepoNotFound"), ..) | (None, 404, None) => HubError::RepoNotFound {
            repo,
            endpoint: cfg.endpoint.clone(),
            status,
        },
        (Some("GatedRepo"), ..) | (_, 401 | 403, _) => HubError::Unauthorized {
            repo: repo.clone(),
            status,
            detail,
            hint: match cfg.token {
                None => format!(
                    "If it is gated, accept its terms at {}/{repo} while logged in; then set \
                     HF_TOKEN to an access token of that account (or run `huggingface-cli \
                     login`)",
                    cfg.endpoint
                ),
                Some(_) => "HF_TOKEN was sent but cannot read it: accept the repository's \
                            terms with the token's account, or use a token with read access"
                    .into(),
            },
        },
        _ => HubError::Http {
            repo,
            status,
            what: file.map_or_else(|| "the repository listing".into(), |f| f.to_string()),
            detail,
        },
    }
}

/// An error and its sources, `: `-joined (reqwest's own message omits the cause).
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn cfg(token: Option<&str>) -> HubConfig {
        HubConfig {
            endpoint: "http://hub".into(),
            cache_dir: PathBuf::from("/c"),
            token: token.map(String::from),
            offline: false,
            progress: false,
            attempts: 1,
        }
    }

    #[test]
    fn the_hubs_failures_map_to_errors_that_say_what_to_do() {
        let id = HubId::parse("o/r@v1").unwrap();
        let e = |token, file, status, code| {
            status_error(&cfg(token), &id, file, status, code, Some("msg")).to_string()
        };
        let missing = e(None, None, 401, Some("RepoNotFound"));
        assert!(
            missing.contains("o/r: no such model repository on http://hub"),
            "{missing}"
        );
        assert!(e(None, None, 404, None).contains("no such model repository"));
        let gated = e(None, Some("model.gguf"), 401, Some("GatedRepo"));
        assert!(
            gated.contains("access denied (HTTP 401, \"msg\")"),
            "{gated}"
        );
        assert!(gated.contains("set HF_TOKEN"), "{gated}");
        assert!(gated.contains("http://hub/o/r"), "{gated}");
        let refused = e(Some("hf_x"), Some("model.gguf"), 403, None);
        assert!(
            refused.contains("HF_TOKEN was sent but cannot read it"),
            "{refused}"
        );
        let rev = e(None, None, 404, Some("RevisionNotFound"));
        assert_eq!(rev, "o/r has no revision 'v1' (HTTP 404)");
        let file = e(None, Some("a.gguf"), 404, None);
        assert_eq!(file, "o/r: a.gguf not found at revision v1 (HTTP 404)");
        let other = e(None, Some("a.gguf"), 500, None);
        assert_eq!(other, "o/r: the Hub answered HTTP 500 for a.gguf, \"msg\"");
    }

    #[test]
    fn listings_parse_the_hubs_fields() {
        let text = r#"{"id": "o/r", "sha": "abc", "private": false, "gated": "manual",
            "siblings": [{"rfilename": "config.json", "blobId": "0a1b", "size": 10},
                         {"rfilename": "m.gguf", "blobId": "ff", "size": 130,
                          "lfs": {"sha256": "9f", "size": 99, "pointerSize": 130}},
                         {"rfilename": "bare"}]}"#;
        let l: Listing = serde_json::from_str(text).unwrap();
        assert_eq!(l.sha, "abc");
        let [cfg, gguf, bare] = l.siblings.as_slice() else {
            panic!("three files")
        };
        assert_eq!((cfg.size(), cfg.blob_name()), (Some(10), Some("0a1b")));
        assert_eq!((gguf.size(), gguf.blob_name()), (Some(99), Some("9f")));
        assert_eq!((bare.size(), bare.blob_name()), (None, None));
    }
}
