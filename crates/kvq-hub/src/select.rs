//! Which of a repository's files make the model `org/repo[:QUANT]` names, from the file names
//! alone (the Hub's listing, or a cached snapshot): a Hugging Face checkpoint (config.json,
//! tokenizer files, safetensors) or one GGUF, possibly split, picked by its quantization the way
//! llama.cpp's `-hf` does: the tag matched case-insensitively against the file names.

use crate::HubError;
use kvq_models::files::{SAFETENSORS_INDEX, gguf_split, pick_safetensors};
use std::collections::{BTreeMap, BTreeSet};

/// The quantization llama.cpp's `-hf` takes from a repo of many when none is named.
pub const DEFAULT_QUANT: &str = "Q4_K_M";

/// The files to fetch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// One GGUF: its parts in order (one file unless split), and its quantization label.
    Gguf {
        files: Vec<String>,
        label: Option<String>,
    },
    /// A Hugging Face checkpoint: small files first (config.json, tokenizer files, the index
    /// when sharded), then the weights (named by the index, so empty until it is read).
    Safetensors {
        meta: Vec<String>,
        index: Option<String>,
        weights: Vec<String>,
    },
}

impl Plan {
    /// The files the plan names so far.
    pub fn files(&self) -> Vec<String> {
        match self {
            Plan::Gguf { files, .. } => files.clone(),
            Plan::Safetensors { meta, weights, .. } => {
                meta.iter().chain(weights).cloned().collect()
            }
        }
    }
}

/// A GGUF model in the listing: one file, or the parts of a split one.
#[derive(Debug)]
struct Group {
    /// The path without `.gguf` and without the part suffix.
    key: String,
    /// The parts, in order (`None` where a part is missing).
    parts: Vec<Option<String>>,
    label: Option<String>,
}

impl Group {
    fn display(&self) -> String {
        match self.parts.as_slice() {
            [Some(one)] => one.clone(),
            parts => format!("{} ({} parts)", self.key, parts.len()),
        }
    }
}

/// Whether `token` (a piece of a file name between `-` or `.`) is a quantization name:
/// `Q4_K_M`, `IQ3_XXS`, `TQ1_0`, `Q8_0`, `F16`, `BF16`, `MXFP4`, ...
fn is_quant(token: &str) -> bool {
    let t = token.to_ascii_uppercase();
    let digit_after = |p: &str| {
        t.strip_prefix(p)
            .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
    };
    digit_after("Q")
        || digit_after("IQ")
        || digit_after("TQ")
        || digit_after("MXFP")
        || matches!(t.as_str(), "F16" | "F32" | "BF16" | "FP16" | "FP32" | "F64")
}

/// The quantization label of a GGUF name (without `.gguf`): its last quantization-like piece.
fn label_of(key: &str) -> Option<String> {
    let base = key.rsplit('/').next().unwrap_or(key);
    base.split(['-', '.'])
        .rev()
        .find(|t| is_quant(t))
        .map(str::to_ascii_uppercase)
}

fn gguf_groups(names: &[&str]) -> Vec<Group> {
    let mut groups: BTreeMap<String, Group> = BTreeMap::new();
    for &name in names {
        let (dir, base) = match name.rsplit_once('/') {
            Some((d, b)) => (format!("{d}/"), b),
            None => (String::new(), name),
        };
        let lower = base.to_ascii_lowercase();
        // Vision projectors ride along in many repos; they are not language models.
        if !lower.ends_with(".gguf") || lower.contains("mmproj") {
            continue;
        }
        let (key, index, count) = match gguf_split(base) {
            Some((prefix, i, n)) => (format!("{dir}{prefix}"), i as usize, n as usize),
            None => (name[..name.len() - ".gguf".len()].to_string(), 1, 1),
        };
        let group = groups
            .entry(format!("{key}\0{count}"))
            .or_insert_with(|| Group {
                label: label_of(&key),
                key,
                parts: vec![None; count],
            });
        group.parts[index - 1] = Some(name.to_string());
    }
    groups.into_values().collect()
}

/// The labels (or, for files without one, the names) of `groups`, for error messages.
fn available(groups: &[&Group]) -> String {
    let names: BTreeSet<String> = groups
        .iter()
        .map(|g| g.label.clone().unwrap_or_else(|| g.display()))
        .collect();
    names.into_iter().collect::<Vec<_>>().join(", ")
}

fn gguf_plan(repo: &str, group: &Group) -> Result<Plan, HubError> {
    let files: Option<Vec<String>> = group.parts.iter().cloned().collect();
    match files {
        Some(files) => Ok(Plan::Gguf {
            files,
            label: group.label.clone(),
        }),
        None => Err(HubError::Selection {
            repo: repo.into(),
            why: format!(
                "the split GGUF {} lacks parts {}",
                group.key,
                (1..=group.parts.len())
                    .filter(|i| group.parts[i - 1].is_none())
                    .map(|i| i.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }),
    }
}

/// The plan for `names` (every file of the repository at one revision, `/`-separated paths)
/// and the `:QUANT` tag, if any.
pub fn plan(repo: &str, names: &[&str], quant: Option<&str>) -> Result<Plan, HubError> {
    let fail = |why: String| HubError::Selection {
        repo: repo.into(),
        why,
    };
    let groups = gguf_groups(names);
    let all: Vec<&Group> = groups.iter().collect();
    if let Some(tag) = quant {
        if groups.is_empty() {
            return Err(fail(format!(
                "it has no GGUF files, so ':{tag}' names nothing; drop ':{tag}' to load what it has"
            )));
        }
        let exact: Vec<&Group> = all
            .iter()
            .copied()
            .filter(|g| {
                g.label
                    .as_deref()
                    .is_some_and(|l| l.eq_ignore_ascii_case(tag))
            })
            .collect();
        let chosen = if exact.len() == 1 {
            exact
        } else {
            let lower = tag.to_ascii_lowercase();
            let base = |g: &Group| {
                g.key
                    .rsplit('/')
                    .next()
                    .unwrap_or(&g.key)
                    .to_ascii_lowercase()
            };
            all.iter()
                .copied()
                .filter(|g| base(g).contains(&lower))
                .collect()
        };
        return match chosen.as_slice() {
            [one] => gguf_plan(repo, one),
            [] => Err(fail(format!(
                "no GGUF file matches ':{tag}'; its quantizations are: {}",
                available(&all)
            ))),
            several => Err(fail(format!(
                "':{tag}' matches several GGUF files: {}; name one by more of its file name",
                several
                    .iter()
                    .map(|g| g.display())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
        };
    }
    if let Some(plan) = safetensors_plan(repo, names)? {
        return Ok(plan);
    }
    match all.as_slice() {
        [one] => gguf_plan(repo, one),
        [] => Err(fail(nothing_loadable(names))),
        several => {
            let default: Vec<&&Group> = several
                .iter()
                .filter(|g| g.label.as_deref() == Some(DEFAULT_QUANT))
                .collect();
            match default.as_slice() {
                [one] => {
                    tracing::info!(
                        repo,
                        quant = DEFAULT_QUANT,
                        "no :QUANT given; taking llama.cpp's default"
                    );
                    gguf_plan(repo, one)
                }
                _ => Err(fail(format!(
                    "it holds {} GGUF models; pick one with {repo}:QUANT, one of: {}",
                    several.len(),
                    available(several)
                ))),
            }
        }
    }
}

/// A Hugging Face checkpoint's plan when `names` hold one (config.json and safetensors at the
/// top level); a checkpoint without tokenizer.json is an error, since kvq needs it.
fn safetensors_plan(repo: &str, names: &[&str]) -> Result<Option<Plan>, HubError> {
    let has = |n: &str| names.contains(&n);
    let index = has(SAFETENSORS_INDEX).then(|| SAFETENSORS_INDEX.to_string());
    let weights = pick_safetensors(names.iter().copied());
    if !has("config.json") || (index.is_none() && weights.is_empty()) {
        return Ok(None);
    }
    if !has("tokenizer.json") {
        return Err(HubError::Selection {
            repo: repo.into(),
            why: "it has config.json and safetensors but no tokenizer.json, which kvq needs \
                  (a tokenizer.model alone is not read)"
                .into(),
        });
    }
    let mut meta: Vec<String> = ["config.json", "tokenizer.json"].map(String::from).to_vec();
    for optional in ["tokenizer_config.json", "chat_template.jinja"] {
        if has(optional) {
            meta.push(optional.into());
        }
    }
    let weights = match &index {
        Some(i) => {
            meta.push(i.clone());
            Vec::new()
        }
        None => weights,
    };
    Ok(Some(Plan::Safetensors {
        meta,
        index,
        weights,
    }))
}

/// Why `names` hold nothing kvq loads, as specific as the names allow.
fn nothing_loadable(names: &[&str]) -> String {
    let any = |exts: &[&str]| {
        names
            .iter()
            .any(|n| exts.iter().any(|e| n.to_ascii_lowercase().ends_with(e)))
    };
    if any(&[".bin", ".pt", ".pth"]) {
        "it holds PyTorch weights (.bin/.pt), which kvq does not read; kvq loads safetensors \
         (with config.json and tokenizer.json) or GGUF"
            .into()
    } else if any(&[".safetensors"]) {
        "it has safetensors but no config.json beside them".into()
    } else {
        format!(
            "it has no GGUF file and no config.json with safetensors (files: {})",
            names.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MANY: [&str; 9] = [
        "README.md",
        "Llama-3.2-1B-Instruct-Q4_K_M.gguf",
        "Llama-3.2-1B-Instruct-Q4_K_S.gguf",
        "Llama-3.2-1B-Instruct-IQ4_XS.gguf",
        "Llama-3.2-1B-Instruct-f16.gguf",
        "Q8_0/Llama-3.2-1B-Instruct-Q8_0-00001-of-00002.gguf",
        "Q8_0/Llama-3.2-1B-Instruct-Q8_0-00002-of-00002.gguf",
        "mmproj-Llama-3.2-1B-Instruct-f16.gguf",
        "Llama-3.2-1B-Instruct.imatrix",
    ];

    fn gguf(files: &[&str]) -> Plan {
        Plan::Gguf {
            files: files.iter().map(|f| f.to_string()).collect(),
            label: label_of(files[0].trim_end_matches(".gguf")),
        }
    }

    #[test]
    fn a_quant_tag_picks_its_file_case_insensitively() {
        let p = plan("o/r", &MANY, Some("q4_k_m")).unwrap();
        assert_eq!(p, gguf(&["Llama-3.2-1B-Instruct-Q4_K_M.gguf"]));
        let p = plan("o/r", &MANY, Some("Q8_0")).unwrap();
        let Plan::Gguf { files, label } = p else {
            panic!("gguf")
        };
        assert_eq!(label.as_deref(), Some("Q8_0"));
        assert_eq!(files.len(), 2);
        assert!(files[0].ends_with("00001-of-00002.gguf"));
        let p = plan("o/r", &MANY, Some("F16")).unwrap();
        assert_eq!(p, gguf(&["Llama-3.2-1B-Instruct-f16.gguf"]));
        // A piece of a name that is no whole label still matches when only one file has it.
        let p = plan("o/r", &MANY, Some("iq4")).unwrap();
        assert_eq!(p, gguf(&["Llama-3.2-1B-Instruct-IQ4_XS.gguf"]));
    }

    #[test]
    fn no_match_or_several_list_the_quantizations() {
        let err = plan("o/r", &MANY, Some("Q2_K")).unwrap_err().to_string();
        assert!(err.contains("no GGUF file matches ':Q2_K'"), "{err}");
        assert!(err.contains("F16, IQ4_XS, Q4_K_M, Q4_K_S, Q8_0"), "{err}");
        let err = plan("o/r", &MANY, Some("Q4_K")).unwrap_err().to_string();
        assert!(err.contains("matches several"), "{err}");
        assert!(
            err.contains("Q4_K_M.gguf") && err.contains("Q4_K_S.gguf"),
            "{err}"
        );
        assert!(!err.contains("IQ4_XS"), "{err}");
    }

    #[test]
    fn without_a_tag_one_gguf_is_taken_and_many_default_to_q4_k_m() {
        let p = plan("o/r", &MANY, None).unwrap();
        assert_eq!(p, gguf(&["Llama-3.2-1B-Instruct-Q4_K_M.gguf"]));
        let two = ["m-Q8_0.gguf", "m-Q6_K.gguf"];
        let err = plan("o/r", &two, None).unwrap_err().to_string();
        assert!(
            err.contains("pick one with o/r:QUANT, one of: Q6_K, Q8_0"),
            "{err}"
        );
        let one = ["m.Q4_1.gguf", "mmproj-f16.gguf", "README.md"];
        assert_eq!(plan("o/r", &one, None).unwrap(), gguf(&["m.Q4_1.gguf"]));
        let split = ["m-00002-of-00002.gguf", "m-00001-of-00002.gguf"];
        let Plan::Gguf { files, .. } = plan("o/r", &split, None).unwrap() else {
            panic!("gguf")
        };
        assert_eq!(files, ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]);
        let gap = ["m-00001-of-00003.gguf", "m-00003-of-00003.gguf"];
        let err = plan("o/r", &gap, None).unwrap_err().to_string();
        assert!(err.contains("lacks parts 2"), "{err}");
    }

    #[test]
    fn checkpoints_fetch_small_files_then_weights() {
        let names = [
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "model.safetensors",
            "onnx/model.onnx",
        ];
        let p = plan("o/r", &names, None).unwrap();
        assert_eq!(
            p.files(),
            [
                "config.json",
                "tokenizer.json",
                "tokenizer_config.json",
                "model.safetensors"
            ]
        );
        let sharded = [
            "config.json",
            "tokenizer.json",
            "chat_template.jinja",
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "consolidated.safetensors",
        ];
        let p = plan("o/r", &sharded, None).unwrap();
        assert_eq!(
            p,
            Plan::Safetensors {
                meta: [
                    "config.json",
                    "tokenizer.json",
                    "chat_template.jinja",
                    SAFETENSORS_INDEX
                ]
                .map(String::from)
                .to_vec(),
                index: Some(SAFETENSORS_INDEX.into()),
                weights: Vec::new(),
            }
        );
        let err = plan("o/r", &sharded, Some("Q4_0")).unwrap_err().to_string();
        assert!(err.contains("no GGUF files"), "{err}");
    }

    #[test]
    fn repos_without_loadable_weights_say_why() {
        let cases: [(&[&str], &str); 4] = [
            (&["config.json", "pytorch_model.bin"], "PyTorch"),
            (&["model.safetensors"], "no config.json"),
            (&["config.json", "model.safetensors"], "no tokenizer.json"),
            (&["README.md"], "files: README.md"),
        ];
        for (names, why) in cases {
            let err = plan("o/r", names, None).unwrap_err().to_string();
            assert!(err.contains(why), "{names:?}: {err}");
        }
    }

    #[test]
    fn labels_are_the_last_quantization_piece() {
        assert_eq!(
            label_of("Qwen2.5-7B-Instruct-Q4_K_M").as_deref(),
            Some("Q4_K_M")
        );
        assert_eq!(
            label_of("SmolLM2-135M-Instruct.Q4_1").as_deref(),
            Some("Q4_1")
        );
        assert_eq!(label_of("gpt-oss-20b-mxfp4").as_deref(), Some("MXFP4"));
        assert_eq!(
            label_of("dir/Qwen3-8B-UD-Q4_K_XL").as_deref(),
            Some("Q4_K_XL")
        );
        assert_eq!(label_of("Qwen2-plain"), None);
    }
}
