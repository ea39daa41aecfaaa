//! What `--model` names, decided without the network: an existing local file or directory, or a
//! Hugging Face Hub id `org/repo`, optionally with `:QUANT` (a GGUF quantization in the repo)
//! and `@revision` (a branch, tag or commit), in either order.

use crate::HubError;
use std::fmt;
use std::path::{Path, PathBuf};

/// A parsed `--model`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSpec {
    /// A file or directory that exists.
    Local(PathBuf),
    /// A repository on the Hub.
    Hub(HubId),
}

/// `org/repo[:QUANT][@revision]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubId {
    /// `org/repo`.
    pub repo: String,
    /// The GGUF quantization asked for (`Q4_K_M`), matched case-insensitively.
    pub quant: Option<String>,
    /// A branch, tag or commit; `main` when absent.
    pub revision: Option<String>,
    /// The text the user gave, trimmed: the id `/v1/models` lists.
    pub given: String,
}

impl HubId {
    /// The revision to resolve (`main` by default).
    pub fn revision(&self) -> &str {
        self.revision.as_deref().unwrap_or("main")
    }

    /// Parses `org/repo[:QUANT][@revision]` (also `org/repo@revision:QUANT`).
    pub fn parse(text: &str) -> Result<HubId, String> {
        let given = text.trim();
        let end = given.find([':', '@']).unwrap_or(given.len());
        let repo = &given[..end];
        check_repo(repo)?;
        let (mut quant, mut revision) = (None, None);
        let mut rest = &given[end..];
        while let Some(mark) = rest.chars().next() {
            let body = &rest[1..];
            // A revision may hold '/' (refs/pr/1) but never ':'; a quant holds neither mark.
            let stop = match mark {
                ':' => body.find('@'),
                _ => body.find(':'),
            }
            .unwrap_or(body.len());
            let value = &body[..stop];
            rest = &body[stop..];
            let slot = match mark {
                ':' => &mut quant,
                _ => &mut revision,
            };
            if slot.is_some() {
                return Err(format!("'{given}' gives '{mark}' twice"));
            }
            *slot = Some(value.to_string());
        }
        if let Some(q) = &quant {
            let ok = !q.is_empty()
                && q.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c));
            if !ok {
                return Err(format!(
                    "'{q}' is not a quantization name (such as Q4_K_M) after ':' in '{given}'"
                ));
            }
        }
        if let Some(r) = &revision {
            let ok = !r.is_empty()
                && !r.contains("..")
                && !r.starts_with('/')
                && !r.ends_with('/')
                && r.chars()
                    .all(|c| c.is_ascii_graphic() && !"\\@".contains(c));
            if !ok {
                return Err(format!(
                    "'{r}' is not a branch, tag or commit after '@' in '{given}'"
                ));
            }
        }
        Ok(HubId {
            repo: repo.to_string(),
            quant,
            revision,
            given: given.to_string(),
        })
    }
}

impl fmt::Display for HubId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.given)
    }
}

/// The Hub's rule for `org/name`: each part 1-96 characters of letters, digits, `-`, `_` and
/// `.`, neither starting nor ending with `-` or `.`, and no `--` or `..`.
fn check_repo(repo: &str) -> Result<(), String> {
    let Some((org, name)) = repo.split_once('/') else {
        return Err(format!(
            "'{repo}' is not a Hugging Face id: one is written org/repo"
        ));
    };
    for part in [org, name] {
        let ok = (1..=96).contains(&part.len())
            && part
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            && !part.starts_with(['-', '.'])
            && !part.ends_with(['-', '.'])
            && !part.contains("--")
            && !part.contains("..");
        if !ok {
            return Err(format!(
                "'{repo}' is not a Hugging Face id (org/repo; letters, digits, '-', '_', '.')"
            ));
        }
    }
    Ok(())
}

/// What `text` names: the local path when it exists (a local directory `org/repo` wins over the
/// Hub, as in mistral.rs), else a Hub id. Text that reads as a path (absolute, `./`, `~`, a
/// `.gguf` or `.safetensors` name, more than one `/` before any `:` or `@`) and does not exist
/// is a missing file, not a repository.
pub fn parse_model_spec(text: &str) -> Result<ModelSpec, HubError> {
    let path = Path::new(text);
    if path.exists() {
        return Ok(ModelSpec::Local(path.to_path_buf()));
    }
    let trimmed = text.trim();
    let head = &trimmed[..trimmed.find([':', '@']).unwrap_or(trimmed.len())];
    let lower = trimmed.to_ascii_lowercase();
    let reads_as_path = trimmed.starts_with(['/', '.', '~'])
        || trimmed.contains('\\')
        || head.matches('/').count() > 1
        || [".gguf", ".safetensors", ".json", ".bin"]
            .iter()
            .any(|ext| lower.ends_with(ext));
    if reads_as_path {
        return Err(HubError::LocalMissing(path.to_path_buf()));
    }
    HubId::parse(trimmed).map(ModelSpec::Hub).map_err(|why| {
        HubError::BadSpec(format!(
            "{} is not a file or directory, and {why}",
            path.display()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(text: &str) -> HubId {
        HubId::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    #[test]
    fn ids_take_a_quant_and_a_revision_in_either_order() {
        let plain = id("HuggingFaceTB/SmolLM2-360M-Instruct");
        assert_eq!(plain.repo, "HuggingFaceTB/SmolLM2-360M-Instruct");
        assert_eq!((plain.quant.as_deref(), plain.revision()), (None, "main"));
        let q = id("bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M");
        assert_eq!(q.repo, "bartowski/Llama-3.2-1B-Instruct-GGUF");
        assert_eq!(q.quant.as_deref(), Some("Q4_K_M"));
        assert_eq!(q.to_string(), "bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M");
        for text in ["o/r:q4_0@refs/pr/1", "o/r@refs/pr/1:q4_0"] {
            let both = id(text);
            assert_eq!(both.repo, "o/r");
            assert_eq!(both.quant.as_deref(), Some("q4_0"));
            assert_eq!(both.revision(), "refs/pr/1");
            assert_eq!(both.given, text);
        }
        let commit = id(" o/r@0123456789abcdef0123456789abcdef01234567 ");
        assert_eq!(
            commit.revision(),
            "0123456789abcdef0123456789abcdef01234567"
        );
        assert_eq!(commit.given, "o/r@0123456789abcdef0123456789abcdef01234567");
    }

    #[test]
    fn malformed_ids_say_what_is_wrong() {
        for bad in [
            "norepo",
            "o/",
            "/r",
            "o/r/x",
            "o/-r",
            "o/r.",
            "o/r--x",
            "o/r..x",
            "o/r:",
            "o/r@",
            "o/r:Q4:Q5",
            "o/r@a@b",
            "o/r:Q 4",
            "o/r@../x",
            "o/r@a b",
            "ö/r",
        ] {
            assert!(HubId::parse(bad).is_err(), "{bad}");
        }
        let long = format!("o/{}", "x".repeat(97));
        assert!(HubId::parse(&long).is_err());
    }

    #[test]
    fn existing_paths_win_and_path_like_text_is_a_missing_file() {
        let dir = std::env::temp_dir().join(format!("kvq-spec-{}", std::process::id()));
        let local = dir.join("org/repo");
        std::fs::create_dir_all(&local).unwrap();
        let text = local.to_str().unwrap();
        assert_eq!(
            parse_model_spec(text).unwrap(),
            ModelSpec::Local(local.clone())
        );
        for missing in [
            "/no/such/model.gguf",
            "./org/repo",
            "models/SmolLM2.gguf",
            "a/b/c",
            "~/model",
        ] {
            let err = parse_model_spec(missing).unwrap_err();
            assert!(matches!(err, HubError::LocalMissing(_)), "{missing}: {err}");
        }
        assert!(matches!(
            parse_model_spec("o/r:Q8_0").unwrap(),
            ModelSpec::Hub(HubId { .. })
        ));
        let err = parse_model_spec("just-a-name").unwrap_err().to_string();
        assert!(err.contains("org/repo"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
