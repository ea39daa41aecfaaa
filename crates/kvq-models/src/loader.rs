//! Finds and loads a model: a GGUF file or a Hugging Face directory, into a `LoadedModel`.

use crate::model::{Family, GgufWeights, Model, ModelConfig, SafetensorsWeights, WeightSource};
use crate::{ChatTemplate, ModelError, Result, Tokenizer};
use candle_core::Device;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What the server and the engine need to know about a loaded model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The id clients use (`model` field): the file stem or directory name.
    pub id: String,
    /// Architecture name, e.g. `llama`.
    pub architecture: String,
    /// Maximum positions (prompt + generated).
    pub context_length: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    /// Where it was loaded from.
    pub source: PathBuf,
}

/// A model ready to run.
pub struct LoadedModel {
    pub model: Model,
    pub tokenizer: Arc<Tokenizer>,
    pub template: ChatTemplate,
    pub info: ModelInfo,
}

/// The default model: SmolLM2-135M-Instruct Q4_1 in `$KVQ_MODELS_DIR`, else `./models`.
pub fn default_model_path() -> PathBuf {
    let dir =
        std::env::var_os("KVQ_MODELS_DIR").map_or_else(|| PathBuf::from("models"), PathBuf::from);
    dir.join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// Loads a GGUF file (any part of a split one loads them all) or a Hugging Face directory
/// (config.json, *.safetensors, tokenizer.json) on the CPU. `progress(done, total)` reports
/// layers loaded. Hub ids are resolved to such paths first (the `kvq-hub` crate).
pub fn load(path: &Path, progress: &mut dyn FnMut(u64, u64)) -> Result<LoadedModel> {
    load_on(path, &Device::Cpu, progress)
}

/// [`load`] onto `device`: GGUF weights stay quantized in its memory (candle's quantized matmuls
/// for that device), safetensors weights are held in f16 on a GPU (f32 on the CPU).
pub fn load_on(
    path: &Path,
    device: &Device,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<LoadedModel> {
    let device = device.clone();
    let meta = std::fs::metadata(path).map_err(|e| ModelError::io(path, e))?;
    let loaded = if meta.is_dir() {
        load_hf_dir(path, &device, progress)
    } else {
        load_gguf(path, &device, progress)
    };
    // Every error names what the user gave (an io error names its own file already).
    loaded.map_err(|e| match e {
        e @ (ModelError::Io { .. } | ModelError::InFile { .. }) => e,
        e if e.to_string().contains(&path.display().to_string()) => e,
        e => ModelError::InFile {
            path: path.display().to_string(),
            source: Box::new(e),
        },
    })
}

/// The model id for a GGUF file stem: the stem without a trailing quantization tag
/// (`SmolLM2-135M-Instruct.Q4_1` -> `SmolLM2-135M-Instruct`).
pub fn model_id_from_stem(stem: &str) -> String {
    let is_quant = |tag: &str| {
        let t = tag.to_ascii_uppercase();
        let digit_after = |p: &str| {
            t.strip_prefix(p)
                .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
        };
        digit_after("Q") || digit_after("IQ") || matches!(t.as_str(), "F16" | "F32" | "BF16")
    };
    match stem.rfind(['.', '-']) {
        Some(i) if i > 0 && is_quant(&stem[i + 1..]) => stem[..i].to_string(),
        _ => stem.to_string(),
    }
}

fn info(cfg: &ModelConfig, id: String, source: &Path) -> ModelInfo {
    ModelInfo {
        id,
        architecture: cfg.architecture.clone(),
        context_length: cfg.context_length,
        n_layers: cfg.n_layers,
        n_heads: cfg.n_heads,
        n_kv_heads: cfg.n_kv_heads,
        head_dim: cfg.head_dim,
        vocab_size: cfg.vocab_size,
        source: source.to_path_buf(),
    }
}

/// The model's own chat template; without one, a format it can follow: Gemma's turns or ChatML
/// for a model whose names (`names`: GGUF `general.finetune` / `general.name`, file or directory
/// names) say it was instruction-tuned, else a question-and-answer transcript, which base models
/// continue with answers (they answer turns they never learned with noise).
fn template_or_fallback(
    source: Option<&str>,
    tok: &Tokenizer,
    names: &[&str],
) -> Result<ChatTemplate> {
    if let Some(src) = source {
        return ChatTemplate::new(src, tok.bos_token(), tok.eos_token());
    }
    if !names.iter().any(|n| names_instruction_tuning(n)) {
        tracing::warn!(
            "the model has no chat template and its names do not say it is instruction-tuned; \
             chat requests go through a Question/Answer transcript"
        );
        return Ok(ChatTemplate::transcript(tok.bos_token()));
    }
    // Gemma GGUFs may come without a template; their vocabulary names their turns.
    if tok.token_to_id("<start_of_turn>").is_some() {
        tracing::warn!("the model has no chat template; using Gemma's turns");
        Ok(ChatTemplate::gemma(tok.bos_token()))
    } else {
        tracing::warn!("the model has no chat template; using ChatML");
        Ok(ChatTemplate::chatml())
    }
}

/// Whether a model name carries one of the usual marks of instruction tuning as a word
/// (`SmolLM2-135M-Instruct`, `gemma-3-270m-it`, `Llama-2-7b-chat-hf`), case-insensitively.
fn names_instruction_tuning(name: &str) -> bool {
    const MARKS: [&str; 6] = ["instruct", "it", "chat", "sft", "dpo", "rlhf"];
    name.split(|c: char| !c.is_ascii_alphanumeric())
        .any(|word| MARKS.iter().any(|m| word.eq_ignore_ascii_case(m)))
}

fn load_gguf(
    path: &Path,
    device: &Device,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<LoadedModel> {
    let mut weights = GgufWeights::open(path, device)?;
    let mut cfg = ModelConfig::from_gguf(weights.content())?;
    let tokenizer = Tokenizer::from_gguf(weights.content())?;
    let template_src = weights
        .content()
        .metadata
        .get("tokenizer.chat_template")
        .and_then(|v| v.to_string().ok())
        .cloned();
    let meta = |key: &str| {
        weights
            .content()
            .metadata
            .get(key)
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default()
    };
    let (finetune, name) = (meta("general.finetune"), meta("general.name"));
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let template = template_or_fallback(
        template_src.as_deref(),
        &tokenizer,
        &[&finetune, &name, &stem],
    )?;
    if weights.contains("rope_freqs.weight") {
        // Llama 3.1+ rope scaling, as llama.cpp's converter stores it: a divisor per pair.
        let factors = weights
            .dense("rope_freqs.weight")?
            .flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1::<f32>()?;
        cfg.rope_freq_factors = Some(crate::model::rope::check_gguf_factors(
            factors,
            cfg.head_dim,
        )?);
    }
    let model = Model::load(cfg.clone(), &mut weights, device, progress)?;
    let id = path.file_stem().map_or_else(
        || "model".to_string(),
        |s| model_id_from_stem(&s.to_string_lossy()),
    );
    Ok(LoadedModel {
        model,
        tokenizer: Arc::new(tokenizer),
        template,
        info: info(&cfg, id, path),
    })
}

/// The chat template of a Hugging Face directory: `chat_template.jinja` when there (newer
/// checkpoints keep it beside the tokenizer, and transformers prefers it), else the
/// `chat_template` of tokenizer_config.json: a string, or a list of named templates of which
/// the `default` one is used.
fn chat_template_of(dir: &Path, tok_cfg: Option<&Path>) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        return std::fs::read_to_string(&jinja)
            .map(Some)
            .map_err(|e| ModelError::io(&jinja, e));
    }
    let Some(p) = tok_cfg else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(p).map_err(|e| ModelError::io(p, e))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| ModelError::Invalid(format!("{}: {e}", p.display())))?;
    Ok(match v.get("chat_template") {
        Some(serde_json::Value::String(t)) => Some(t.clone()),
        Some(serde_json::Value::Array(named)) => named
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(|t| t.as_str())
            .map(str::to_string),
        _ => None,
    })
}

/// The weight files of a Hugging Face directory: those its `model.safetensors.index.json`
/// names when it has one (each must be there), else [`crate::files::pick_safetensors`].
pub fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join(crate::files::SAFETENSORS_INDEX);
    let names = if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
        let names = crate::files::safetensors_index_files(&text)?;
        if let Some(missing) = names.iter().find(|n| !dir.join(n).is_file()) {
            return Err(ModelError::Invalid(format!(
                "{} names {missing}, which is not in {}",
                index.display(),
                dir.display()
            )));
        }
        names
    } else {
        let entries: Vec<String> = std::fs::read_dir(dir)
            .map_err(|e| ModelError::io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect();
        crate::files::pick_safetensors(entries.iter().map(String::as_str))
    };
    if names.is_empty() {
        return Err(ModelError::Invalid(format!(
            "{} has no *.safetensors files",
            dir.display()
        )));
    }
    Ok(names.into_iter().map(|n| dir.join(n)).collect())
}

fn load_hf_dir(
    dir: &Path,
    device: &Device,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<LoadedModel> {
    let read = |name: &str| -> Result<String> {
        let p = dir.join(name);
        std::fs::read_to_string(&p).map_err(|e| ModelError::io(&p, e))
    };
    let cfg = ModelConfig::from_hf_json(&read("config.json")?)?;
    let tok_cfg = dir.join("tokenizer_config.json");
    let tok_cfg = tok_cfg.exists().then_some(tok_cfg);
    let tokenizer = Tokenizer::from_hf_files(&dir.join("tokenizer.json"), tok_cfg.as_deref())?;
    let template_src = chat_template_of(dir, tok_cfg.as_deref())?;
    // A Hugging Face cache snapshot is named by its hash; the repository is a folder above it.
    let names: Vec<String> = dir
        .ancestors()
        .filter_map(|p| p.file_name().map(|s| s.to_string_lossy().into_owned()))
        .take(3)
        .collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let template = template_or_fallback(template_src.as_deref(), &tokenizer, &names)?;
    let files = safetensors_files(dir)?;
    let mut weights = SafetensorsWeights::open(&files, device, Family::of(&cfg)?)?;
    let model = Model::load(cfg.clone(), &mut weights, device, progress)?;
    let id = dir
        .file_name()
        .map_or_else(|| "model".to_string(), |s| s.to_string_lossy().into_owned());
    Ok(LoadedModel {
        model,
        tokenizer: Arc::new(tokenizer),
        template,
        info: info(&cfg, id, dir),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_drop_the_quantization_tag() {
        assert_eq!(
            model_id_from_stem("SmolLM2-135M-Instruct.Q4_1"),
            "SmolLM2-135M-Instruct"
        );
        assert_eq!(model_id_from_stem("gemma-3-270m-Q4_K_M"), "gemma-3-270m");
        assert_eq!(model_id_from_stem("model.bf16"), "model");
        assert_eq!(model_id_from_stem("Qwen2.5-Coder"), "Qwen2.5-Coder");
        assert_eq!(model_id_from_stem("plain"), "plain");
    }

    #[test]
    fn instruction_tuning_is_read_from_names() {
        for tuned in [
            "SmolLM2-135M-Instruct.Q4_1",
            "gemma-3-270m-it-Q4_K_M",
            "Llama-2-7b-chat-hf",
            "models--tiiuae--falcon-7b-instruct",
            "it",
            "Zephyr-7B-DPO",
        ] {
            assert!(names_instruction_tuning(tuned), "{tuned}");
        }
        for base in [
            "gemma-3-270m-Q4_K_M",
            "Gemma 3 270m",
            "Meta-Llama-3-8B",
            "kit",
            "",
        ] {
            assert!(!names_instruction_tuning(base), "{base}");
        }
    }

    #[test]
    fn directories_read_the_jinja_template_first_and_the_default_of_a_list() {
        let dir = std::env::temp_dir().join(format!("kvq-template-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("tokenizer_config.json");
        std::fs::write(
            &cfg,
            r#"{"chat_template": [{"name": "tool_use", "template": "T"},
                                  {"name": "default", "template": "D"}]}"#,
        )
        .unwrap();
        assert_eq!(
            chat_template_of(&dir, Some(&cfg)).unwrap().as_deref(),
            Some("D")
        );
        std::fs::write(&cfg, r#"{"chat_template": "S"}"#).unwrap();
        assert_eq!(
            chat_template_of(&dir, Some(&cfg)).unwrap().as_deref(),
            Some("S")
        );
        std::fs::write(dir.join("chat_template.jinja"), "J").unwrap();
        assert_eq!(
            chat_template_of(&dir, Some(&cfg)).unwrap().as_deref(),
            Some("J")
        );
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(chat_template_of(&dir, None).unwrap(), None);
    }

    #[test]
    fn an_index_decides_the_weight_files_and_must_be_complete() {
        let dir = std::env::temp_dir().join(format!("kvq-index-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for f in [
            "consolidated.safetensors",
            "model-00001-of-00002.safetensors",
        ] {
            std::fs::write(dir.join(f), b"").unwrap();
        }
        assert_eq!(
            safetensors_files(&dir).unwrap(),
            [dir.join("model-00001-of-00002.safetensors")]
        );
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            r#"{"weight_map": {"a": "model-00001-of-00002.safetensors",
                               "b": "model-00002-of-00002.safetensors"}}"#,
        )
        .unwrap();
        let err = safetensors_files(&dir).unwrap_err().to_string();
        assert!(err.contains("model-00002-of-00002.safetensors"), "{err}");
        std::fs::write(dir.join("model-00002-of-00002.safetensors"), b"").unwrap();
        assert_eq!(safetensors_files(&dir).unwrap().len(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
