//! Which files make up a model: the shards of a split GGUF (`Name-00001-of-00003.gguf`, as
//! llama.cpp's gguf-split writes them) and the weight files of a Hugging Face checkpoint (its
//! `model.safetensors.index.json`, else the usual names). Shared by the loader, which reads a
//! directory, and the hub download, which reads a repository's file list.

use crate::{ModelError, Result};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The index of a sharded safetensors checkpoint.
pub const SAFETENSORS_INDEX: &str = "model.safetensors.index.json";

/// The parts of a split GGUF's file name: `Model-Q4_K_M-00002-of-00003.gguf` gives
/// `("Model-Q4_K_M", 2, 3)`. `None` for a file that is not a shard (or a malformed number).
pub fn gguf_split(name: &str) -> Option<(&str, u32, u32)> {
    let stem = strip_suffix_ignore_case(name, ".gguf")?;
    let (head, count) = stem.rsplit_once("-of-")?;
    let (prefix, index) = head.rsplit_once('-')?;
    let number = |s: &str| {
        (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse::<u32>().ok())
            .flatten()
    };
    let (index, count) = (number(index)?, number(count)?);
    (!prefix.is_empty() && index >= 1 && index <= count).then_some((prefix, index, count))
}

/// The name of shard `index` of `count` (llama.cpp's `%s-%05d-of-%05d.gguf`).
pub fn gguf_shard_name(prefix: &str, index: u32, count: u32) -> String {
    format!("{prefix}-{index:05}-of-{count:05}.gguf")
}

/// Every shard of the GGUF at `path`, in order (`[path]` when it is not split). Any shard of a
/// split model names them all; a missing one is an error that names it.
pub fn gguf_shards(path: &Path) -> Result<Vec<PathBuf>> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let Some((prefix, _, count)) = name.as_deref().and_then(gguf_split) else {
        return Ok(vec![path.to_path_buf()]);
    };
    let dir = path.parent().unwrap_or(Path::new(""));
    let shards: Vec<PathBuf> = (1..=count)
        .map(|i| dir.join(gguf_shard_name(prefix, i, count)))
        .collect();
    let missing: Vec<String> = shards
        .iter()
        .filter(|p| !p.is_file())
        .map(|p| p.display().to_string())
        .collect();
    if !missing.is_empty() {
        return Err(ModelError::Invalid(format!(
            "{} is one part of a {count}-part GGUF, but these parts are missing: {}",
            path.display(),
            missing.join(", ")
        )));
    }
    Ok(shards)
}

/// The weight files a `model.safetensors.index.json` names (its `weight_map` values), sorted
/// and without repeats.
pub fn safetensors_index_files(index_json: &str) -> Result<Vec<String>> {
    let v: serde_json::Value = serde_json::from_str(index_json)
        .map_err(|e| ModelError::Invalid(format!("{SAFETENSORS_INDEX}: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| ModelError::Invalid(format!("{SAFETENSORS_INDEX} has no weight_map")))?;
    let mut files = BTreeSet::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| {
            ModelError::Invalid(format!("{SAFETENSORS_INDEX}: '{tensor}' maps to {file}"))
        })?;
        // The index lives beside its shards; a path out of the checkpoint is not a shard.
        if file.is_empty() || file.contains("..") || file.starts_with('/') {
            return Err(ModelError::Invalid(format!(
                "{SAFETENSORS_INDEX}: '{tensor}' maps to the path '{file}'"
            )));
        }
        files.insert(file.to_string());
    }
    if files.is_empty() {
        return Err(ModelError::Invalid(format!(
            "{SAFETENSORS_INDEX} maps no tensors"
        )));
    }
    Ok(files.into_iter().collect())
}

/// The weight files of a checkpoint without an index, from the top-level file names:
/// `model.safetensors` when there, else every `*.safetensors` except Mistral's
/// `consolidated*.safetensors` (the same weights again under Mistral's own names). Sorted.
pub fn pick_safetensors<'a>(names: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let all: BTreeSet<&str> = names
        .into_iter()
        .filter(|n| !n.contains('/') && strip_suffix_ignore_case(n, ".safetensors").is_some())
        .collect();
    if all.contains("model.safetensors") {
        return vec!["model.safetensors".into()];
    }
    all.into_iter()
        .filter(|n| !n.starts_with("consolidated"))
        .map(str::to_string)
        .collect()
}

fn strip_suffix_ignore_case<'a>(name: &'a str, suffix: &str) -> Option<&'a str> {
    let cut = name.len().checked_sub(suffix.len())?;
    (name.is_char_boundary(cut) && name[cut..].eq_ignore_ascii_case(suffix)).then(|| &name[..cut])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_gguf_names_parse_and_round_trip() {
        assert_eq!(
            gguf_split("Llama-3.1-70B-Q4_K_M-00002-of-00003.gguf"),
            Some(("Llama-3.1-70B-Q4_K_M", 2, 3))
        );
        assert_eq!(
            gguf_shard_name("Llama-3.1-70B-Q4_K_M", 2, 3),
            "Llama-3.1-70B-Q4_K_M-00002-of-00003.gguf"
        );
        assert_eq!(gguf_split("x-1-of-2.GGUF"), Some(("x", 1, 2)));
        for not_a_shard in [
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "model-00001-of-00002.safetensors",
            "-00001-of-00002.gguf",
            "m-00003-of-00002.gguf",
            "m-00000-of-00002.gguf",
            "m-0x001-of-00002.gguf",
            "m-of-2.gguf",
            "ü-of-ß.gguf",
            "",
        ] {
            assert_eq!(gguf_split(not_a_shard), None, "{not_a_shard}");
        }
    }

    #[test]
    fn shards_are_found_beside_any_one_of_them_and_a_gap_is_named() {
        let dir = std::env::temp_dir().join(format!("kvq-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for i in [1, 3] {
            std::fs::write(dir.join(gguf_shard_name("m", i, 3)), b"x").unwrap();
        }
        let err = gguf_shards(&dir.join(gguf_shard_name("m", 3, 3)))
            .unwrap_err()
            .to_string();
        assert!(err.contains("m-00002-of-00003.gguf"), "{err}");
        std::fs::write(dir.join(gguf_shard_name("m", 2, 3)), b"x").unwrap();
        let got = gguf_shards(&dir.join(gguf_shard_name("m", 2, 3))).unwrap();
        let want: Vec<PathBuf> = (1..=3)
            .map(|i| dir.join(gguf_shard_name("m", i, 3)))
            .collect();
        assert_eq!(got, want);
        let single = dir.join("single.gguf");
        assert_eq!(gguf_shards(&single).unwrap(), vec![single]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_index_names_its_shards_once_each() {
        let index = r#"{"metadata": {"total_size": 10}, "weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": "model-00002-of-00002.safetensors",
            "model.norm.weight": "model-00002-of-00002.safetensors"}}"#;
        assert_eq!(
            safetensors_index_files(index).unwrap(),
            [
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors"
            ]
        );
        for bad in [
            "{}",
            r#"{"weight_map": {}}"#,
            r#"{"weight_map": {"a": 3}}"#,
            r#"{"weight_map": {"a": "../../etc/passwd"}}"#,
            "not json",
        ] {
            assert!(safetensors_index_files(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn without_an_index_the_usual_weight_names_are_picked() {
        let names = [
            "config.json",
            "consolidated.safetensors",
            "model.safetensors",
            "sub/model.safetensors",
        ];
        assert_eq!(pick_safetensors(names), ["model.safetensors"]);
        let names = ["consolidated.safetensors", "b.safetensors", "a.SAFETENSORS"];
        assert_eq!(pick_safetensors(names), ["a.SAFETENSORS", "b.safetensors"]);
        assert!(pick_safetensors(["pytorch_model.bin"]).is_empty());
    }
}
