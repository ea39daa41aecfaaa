//! Where the Hub is and how to talk to it, read from the environment variables huggingface_hub
//! and transformers read, so kvq shares their cache and their token: `HF_ENDPOINT`,
//! `HF_HUB_CACHE` (`HUGGINGFACE_HUB_CACHE`), `HF_HOME`, `XDG_CACHE_HOME`, `HF_TOKEN`
//! (`HUGGING_FACE_HUB_TOKEN`, `HF_TOKEN_PATH`, `$HF_HOME/token`), `HF_HUB_OFFLINE` and
//! `HF_HUB_DISABLE_PROGRESS_BARS`.

use crate::HubError;
use std::path::PathBuf;

/// The public Hub.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// How kvq reaches the Hub and where it keeps what it downloads.
#[derive(Clone)]
pub struct HubConfig {
    /// Base URL without a trailing `/` (`HF_ENDPOINT`, default the public Hub).
    pub endpoint: String,
    /// The hub cache: `models--org--repo/{blobs,snapshots,refs}` below it.
    pub cache_dir: PathBuf,
    /// Sent as `Authorization: Bearer` when set.
    pub token: Option<String>,
    /// Never make a request: resolve from the cache only (`HF_HUB_OFFLINE=1`).
    pub offline: bool,
    /// Draw a progress bar per file (on a terminal).
    pub progress: bool,
    /// Tries per file before a download is given up (each one resumes the last).
    pub attempts: u32,
}

impl std::fmt::Debug for HubConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubConfig")
            .field("endpoint", &self.endpoint)
            .field("cache_dir", &self.cache_dir)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("offline", &self.offline)
            .field("progress", &self.progress)
            .field("attempts", &self.attempts)
            .finish()
    }
}

impl HubConfig {
    /// The configuration the process environment gives.
    pub fn from_env() -> Result<Self, HubError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// The configuration `var` gives (`var(name)` is the variable's value, if set).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, HubError> {
        let set = |k: &str| var(k).filter(|v| !v.trim().is_empty());
        let home = || set("HOME").map(PathBuf::from);
        let hf_home = set("HF_HOME").map(PathBuf::from).or_else(|| {
            set("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| home().map(|h| h.join(".cache")))
                .map(|c| c.join("huggingface"))
        });
        let cache_dir = set("HF_HUB_CACHE")
            .or_else(|| set("HUGGINGFACE_HUB_CACHE"))
            .map(PathBuf::from)
            .or_else(|| hf_home.as_ref().map(|h| h.join("hub")))
            .ok_or_else(|| {
                HubError::BadSpec(
                    "no hub cache: set HF_HUB_CACHE or HF_HOME (HOME is not set either)".into(),
                )
            })?;
        let token_file = set("HF_TOKEN_PATH")
            .map(PathBuf::from)
            .or_else(|| hf_home.as_ref().map(|h| h.join("token")));
        let token = set("HF_TOKEN")
            .or_else(|| set("HUGGING_FACE_HUB_TOKEN"))
            .or_else(|| {
                let text = std::fs::read_to_string(token_file?).ok()?;
                Some(text.trim().to_string()).filter(|t| !t.is_empty())
            })
            .map(|t| t.trim().to_string());
        let truthy = |k: &str| {
            set(k).is_some_and(|v| {
                ["1", "on", "yes", "true"]
                    .iter()
                    .any(|t| v.trim().eq_ignore_ascii_case(t))
            })
        };
        let endpoint = set("HF_ENDPOINT")
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
            .trim()
            .trim_end_matches('/')
            .to_string();
        Ok(Self {
            endpoint,
            cache_dir,
            token,
            offline: truthy("HF_HUB_OFFLINE"),
            progress: !truthy("HF_HUB_DISABLE_PROGRESS_BARS"),
            attempts: 5,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn config(vars: &[(&str, &str)]) -> HubConfig {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        HubConfig::from_vars(|k| map.get(k).cloned()).unwrap()
    }

    #[test]
    fn the_cache_follows_huggingface_hub_precedence() {
        let c = config(&[("HOME", "/h")]);
        assert_eq!(c.cache_dir, PathBuf::from("/h/.cache/huggingface/hub"));
        assert_eq!(c.endpoint, DEFAULT_ENDPOINT);
        assert!(!c.offline && c.progress && c.token.is_none());
        let c = config(&[("HOME", "/h"), ("XDG_CACHE_HOME", "/x")]);
        assert_eq!(c.cache_dir, PathBuf::from("/x/huggingface/hub"));
        let c = config(&[("HOME", "/h"), ("HF_HOME", "/hf")]);
        assert_eq!(c.cache_dir, PathBuf::from("/hf/hub"));
        let c = config(&[("HF_HOME", "/hf"), ("HUGGINGFACE_HUB_CACHE", "/old")]);
        assert_eq!(c.cache_dir, PathBuf::from("/old"));
        let c = config(&[("HUGGINGFACE_HUB_CACHE", "/old"), ("HF_HUB_CACHE", "/new")]);
        assert_eq!(c.cache_dir, PathBuf::from("/new"));
        assert!(HubConfig::from_vars(|_| None).is_err());
    }

    #[test]
    fn endpoint_offline_and_progress_switches() {
        let c = config(&[
            ("HF_HUB_CACHE", "/c"),
            ("HF_ENDPOINT", "http://127.0.0.1:9/ "),
            ("HF_HUB_OFFLINE", "ON"),
            ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
        ]);
        assert_eq!(c.endpoint, "http://127.0.0.1:9");
        assert!(c.offline && !c.progress);
        for off in ["0", "false", "", "no"] {
            assert!(!config(&[("HF_HUB_CACHE", "/c"), ("HF_HUB_OFFLINE", off)]).offline);
        }
    }

    #[test]
    fn the_token_comes_from_the_variable_then_the_token_file() {
        let home = std::env::temp_dir().join(format!("kvq-token-{}", std::process::id()));
        std::fs::create_dir_all(&home).unwrap();
        std::fs::write(home.join("token"), "hf_file\n").unwrap();
        let h = home.to_str().unwrap();
        assert_eq!(config(&[("HF_HOME", h)]).token.as_deref(), Some("hf_file"));
        let c = config(&[("HF_HOME", h), ("HUGGING_FACE_HUB_TOKEN", "hf_old")]);
        assert_eq!(c.token.as_deref(), Some("hf_old"));
        let c = config(&[("HF_HOME", h), ("HF_TOKEN", " hf_env ")]);
        assert_eq!(c.token.as_deref(), Some("hf_env"));
        assert!(!format!("{c:?}").contains("hf_env"));
        std::fs::write(home.join("other"), "hf_path").unwrap();
        let other = home.join("other");
        let c = config(&[("HF_HOME", h), ("HF_TOKEN_PATH", other.to_str().unwrap())]);
        assert_eq!(c.token.as_deref(), Some("hf_path"));
        std::fs::remove_dir_all(&home).unwrap();
    }
}
