//! API keys: with any configured, every `/v1` route (and `/metrics` when asked) needs
//! `Authorization: Bearer <key>`. Keys are held as SHA-256 digests and a presented key is
//! compared with every one of them in constant time, so neither a key's bytes nor which key
//! matched shows in the timing; keys never reach a log or a response.

use crate::error::ApiError;
use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use std::path::Path;
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// Why a key set could not be made.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("could not read the API key file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
}

/// A key as typed on the command line or in `KVQ_API_KEY`: its `Debug` never shows it.
#[derive(Clone)]
pub struct SecretKey(pub String);

impl std::fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretKey(..)")
    }
}

impl std::str::FromStr for SecretKey {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_string()))
    }
}

/// The accepted keys (digests only).
pub struct ApiKeys {
    digests: Vec<[u8; 32]>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} key(s))", self.digests.len())
    }
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

impl ApiKeys {
    /// The keys given; empty ones are refused, as are keys with whitespace or control
    /// characters (they could not be sent in a header as typed).
    pub fn new<S: AsRef<str>>(keys: impl IntoIterator<Item = S>) -> Result<Self, KeyError> {
        let mut digests = Vec::new();
        for (i, k) in keys.into_iter().enumerate() {
            let k = k.as_ref();
            if k.is_empty() {
                return Err(KeyError::Invalid(format!("API key {} is empty", i + 1)));
            }
            if k.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(KeyError::Invalid(format!(
                    "API key {} contains whitespace or a control character",
                    i + 1
                )));
            }
            digests.push(digest(k));
        }
        if digests.is_empty() {
            return Err(KeyError::Invalid("no API key given".into()));
        }
        Ok(Self { digests })
    }

    /// The keys of the server's flags: `key` (--api-key or KVQ_API_KEY) and the lines of
    /// `file` (--api-key-file: one key per line, blank lines and `#` comments skipped). None
    /// when neither is given; a file without a key is an error.
    pub fn from_flags(key: Option<&str>, file: Option<&Path>) -> Result<Option<Self>, KeyError> {
        let mut keys: Vec<String> = key.into_iter().map(str::to_string).collect();
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|source| KeyError::Read {
                path: path.display().to_string(),
                source,
            })?;
            let before = keys.len();
            keys.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(str::to_string),
            );
            if keys.len() == before {
                return Err(KeyError::Invalid(format!(
                    "{}: no API key in it",
                    path.display()
                )));
            }
        }
        match keys.is_empty() {
            true => Ok(None),
            false => Self::new(keys).map(Some),
        }
    }

    /// Whether `presented` is one of the keys. Every key is compared, whatever matched.
    pub fn accepts(&self, presented: &str) -> bool {
        let d = digest(presented);
        self.digests
            .iter()
            .fold(subtle::Choice::from(0), |acc, k| acc | k.ct_eq(&d))
            .into()
    }

    /// How many keys there are.
    pub fn len(&self) -> usize {
        self.digests.len()
    }

    /// Never true (a key set has at least one key); for clippy's `len` convention.
    pub fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }
}

/// The bearer token of a request, if it sent one (`Authorization: Bearer <token>`, the scheme
/// case-insensitive).
fn bearer(req: &Request) -> Option<&str> {
    let value = req.headers().get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// Middleware: passes requests that carry an accepted key, answers the rest 401.
pub async fn require_key(State(keys): State<Arc<ApiKeys>>, req: Request, next: Next) -> Response {
    match bearer(&req) {
        Some(token) if keys.accepts(token) => next.run(req).await,
        Some(_) => ApiError::Unauthorized(
            "Incorrect API key provided. The server was started with --api-key; send one of its \
             keys as `Authorization: Bearer <key>`."
                .into(),
        )
        .into_response(),
        None => ApiError::Unauthorized(
            "You didn't provide an API key. You need to provide your API key in an \
             Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
                .into(),
        )
        .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_exactly_its_keys() {
        let k = ApiKeys::new(["sk-one", "sk-two"]).unwrap();
        assert_eq!(k.len(), 2);
        assert!(k.accepts("sk-one") && k.accepts("sk-two"));
        for bad in ["", "sk-on", "sk-one ", "SK-ONE", "sk-onex", "sk-three"] {
            assert!(!k.accepts(bad), "{bad:?}");
        }
        assert!(format!("{k:?}").contains("2 key(s)") && !format!("{k:?}").contains("sk-"));
    }

    #[test]
    fn refuses_unusable_keys() {
        assert!(ApiKeys::new(Vec::<String>::new()).is_err());
        assert!(ApiKeys::new([""]).is_err());
        assert!(ApiKeys::new(["a b"]).is_err());
        assert!(ApiKeys::new(["a\u{7}"]).is_err());
    }

    #[test]
    fn keys_come_from_the_flag_and_the_file() {
        let dir = std::env::temp_dir().join(format!("kvq-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("keys.txt");
        std::fs::write(&p, "# team keys\nsk-a\n\n  sk-b  \n").unwrap();
        assert!(ApiKeys::from_flags(None, None).unwrap().is_none());
        let k = ApiKeys::from_flags(Some("sk-c"), Some(&p))
            .unwrap()
            .unwrap();
        assert!(k.len() == 3 && k.accepts("sk-a") && k.accepts("sk-b") && k.accepts("sk-c"));
        assert!(!k.accepts("# team keys"));
        std::fs::write(&p, "# nothing\n").unwrap();
        let err = ApiKeys::from_flags(Some("sk-c"), Some(&p))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("keys.txt") && err.contains("no API key"),
            "{err}"
        );
        let err = ApiKeys::from_flags(None, Some(&dir.join("missing")))
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing"), "{err}");
        assert!(ApiKeys::from_flags(Some(""), None).is_err());
        std::fs::remove_dir_all(&dir).ok();
    }
}
