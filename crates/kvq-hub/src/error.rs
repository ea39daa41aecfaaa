//! What can go wrong between `--model` and files on disk, each with the message a user acts on
//! (the README's "Models from the Hub" lists them).

use std::path::PathBuf;

/// Errors of kvq-hub.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// `--model` is neither an existing path nor a well-formed Hub id.
    #[error("{0}")]
    BadSpec(String),
    /// `--model` reads as a local path that does not exist.
    #[error("{}: no such file or directory", .0.display())]
    LocalMissing(PathBuf),
    /// The Hub has no such repository (or hides a private one from this token).
    #[error(
        "{repo}: no such model repository on {endpoint} (HTTP {status}); check the name, and \
         if the repository is private or gated, set HF_TOKEN to a token that can read it"
    )]
    RepoNotFound {
        repo: String,
        endpoint: String,
        status: u16,
    },
    /// The repository exists but has no such branch, tag or commit.
    #[error("{repo} has no revision '{revision}' (HTTP 404)")]
    RevisionNotFound { repo: String, revision: String },
    /// A 401 or 403: a gated or private repository.
    #[error(
        "{repo}: access denied (HTTP {status}{detail}): the repository is gated or private. {hint}"
    )]
    Unauthorized {
        repo: String,
        status: u16,
        /// `, "message"` from the Hub, or empty.
        detail: String,
        /// What to do, depending on whether a token was sent.
        hint: String,
    },
    /// A file the listing named is gone at that revision.
    #[error("{repo}: {file} not found at revision {revision} (HTTP 404)")]
    FileNotFound {
        repo: String,
        file: String,
        revision: String,
    },
    /// Any other HTTP failure status.
    #[error("{repo}: the Hub answered HTTP {status} for {what}{detail}")]
    Http {
        repo: String,
        status: u16,
        what: String,
        detail: String,
    },
    /// No connection to the Hub, and the cache cannot stand in.
    #[error(
        "could not reach {endpoint} for {repo} ({reason}), and {cache_state}; set HF_ENDPOINT \
         if you use a mirror, or HF_HUB_OFFLINE=1 to use only the cache"
    )]
    Unreachable {
        repo: String,
        endpoint: String,
        reason: String,
        cache_state: String,
    },
    /// `HF_HUB_OFFLINE` is set and the cache lacks what the id needs.
    #[error(
        "HF_HUB_OFFLINE is set and {id} is not in the hub cache {}: {why}; unset \
         HF_HUB_OFFLINE to download it",
        cache.display()
    )]
    NotCached {
        id: String,
        cache: PathBuf,
        why: String,
    },
    /// The repository holds nothing kvq can load, or `:QUANT` matches no file or several.
    #[error("{repo}: {why}")]
    Selection { repo: String, why: String },
    /// The model's config says kvq cannot run it (checked before the weights are downloaded).
    #[error("{repo}: {source}")]
    Model {
        repo: String,
        #[source]
        source: kvq_models::ModelError,
    },
    /// A download failed for good (after its retries, each of which resumed the last).
    #[error("{repo}: downloading {file} failed after {attempts} attempt(s): {reason}")]
    Download {
        repo: String,
        file: String,
        attempts: u32,
        reason: String,
    },
    /// A downloaded file is not what the Hub said it is; the file was deleted.
    #[error(
        "{repo}: {file} is corrupt: its {what} is {got}, the Hub says {expected}; the download \
         was deleted, run again to fetch it anew"
    )]
    Corrupt {
        repo: String,
        file: String,
        what: &'static str,
        expected: String,
        got: String,
    },
    /// Reading or writing the cache failed.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl HubError {
    /// Wraps an io error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> HubError {
        let path = path.into();
        move |source| HubError::Io { path, source }
    }
}
