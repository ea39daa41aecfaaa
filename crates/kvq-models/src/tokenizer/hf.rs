//! Reading and writing Hugging Face tokenizer files: tokenizer.json, tokenizer_config.json, generation_config.json, chat_template.jinja.

use std::path::Path;

use serde_json::Value as Json;

use super::{Tokenizer, TokenizerSpec, tok_err};
use crate::{ModelError, Result};

fn read_json(path: &Path) -> Result<Json> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| ModelError::Invalid(format!("{}: {e}", path.display())))
}

/// A special token in tokenizer_config.json: a plain string or an `{"content": ...}` object.
fn token_str(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_owned),
        _ => None,
    }
}

/// `chat_template` is a string, or a list of `{name, template}` of which "default" (else the first) is used.
fn template_str(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Array(list) => {
            let named = |want: Option<&str>| {
                list.iter()
                    .find(|t| want.is_none_or(|w| t.get("name").and_then(Json::as_str) == Some(w)))
            };
            named(Some("default"))
                .or_else(|| named(None))
                .and_then(|t| t.get("template"))
                .and_then(Json::as_str)
                .map(str::to_owned)
        }
        _ => None,
    }
}

/// `eos_token_id` / `bos_token_id` in generation_config.json or config.json: an int or a list of ints.
fn ids(v: Option<&Json>) -> Vec<u32> {
    match v {
        Some(Json::Number(n)) => n
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .into_iter()
            .collect(),
        Some(Json::Array(list)) => list
            .iter()
            .filter_map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect(),
        _ => Vec::new(),
    }
}

pub(super) fn load(
    tokenizer_json: &Path,
    tokenizer_config_json: Option<&Path>,
) -> Result<(tokenizers::Tokenizer, TokenizerSpec)> {
    let bytes = std::fs::read(tokenizer_json).map_err(|e| ModelError::io(tokenizer_json, e))?;
    let inner = crate::contain::contained(|| tokenizers::Tokenizer::from_bytes(&bytes))
        .map_err(|panic| {
            ModelError::Tokenizer(format!(
                "{}: the tokenizers library failed on this file: {panic}",
                tokenizer_json.display()
            ))
        })?
        .map_err(|e| tok_err(&tokenizer_json.display().to_string(), e))?;
    let dir = tokenizer_json.parent().unwrap_or_else(|| Path::new("."));

    let mut spec = TokenizerSpec::default();
    if let Some(path) = tokenizer_config_json {
        let config = read_json(path)?;
        spec.bos_token = token_str(config.get("bos_token"));
        spec.eos_token = token_str(config.get("eos_token"));
        spec.pad_token = token_str(config.get("pad_token"));
        spec.add_bos_token = config.get("add_bos_token").and_then(Json::as_bool);
        spec.chat_template = template_str(config.get("chat_template"));
    }
    if spec.chat_template.is_none() {
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            spec.chat_template =
                Some(std::fs::read_to_string(&jinja).map_err(|e| ModelError::io(&jinja, e))?);
        }
    }

    let generation = dir.join("generation_config.json");
    if generation.is_file() {
        let config = read_json(&generation)?;
        let eos = ids(config.get("eos_token_id"));
        let name = |id: Option<&u32>| id.and_then(|&id| inner.id_to_token(id));
        if spec.eos_token.is_none() {
            spec.eos_token = name(eos.first());
        }
        if spec.bos_token.is_none() {
            spec.bos_token = name(ids(config.get("bos_token_id")).first());
        }
        spec.extra_eos_ids = eos;
    }
    Ok((inner, spec))
}

pub(super) fn save(tok: &Tokenizer, dir: &Path, chat_template: Option<&str>) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let json = tok
        .inner
        .to_string(true)
        .map_err(|e| tok_err("serializing tokenizer.json", e))?;
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, json).map_err(|e| ModelError::io(&path, e))?;

    let mut config = serde_json::Map::new();
    let mut put = |key: &str, value: Json| {
        config.insert(key.to_owned(), value);
    };
    put("tokenizer_class", "PreTrainedTokenizerFast".into());
    put("add_bos_token", tok.adds_bos.into());
    put("add_eos_token", false.into());
    put("clean_up_tokenization_spaces", false.into());
    for (key, token) in [
        ("bos_token", &tok.bos),
        ("eos_token", &tok.eos),
        ("pad_token", &tok.pad),
    ] {
        if let Some((name, _)) = token {
            put(key, name.clone().into());
        }
    }
    if let Some(template) = chat_template.or(tok.chat_template.as_deref()) {
        put("chat_template", template.into());
    }
    let text = serde_json::to_string_pretty(&Json::Object(config))
        .map_err(|e| ModelError::Invalid(format!("serializing tokenizer_config.json: {e}")))?;
    let path = dir.join("tokenizer_config.json");
    std::fs::write(&path, text).map_err(|e| ModelError::io(&path, e))
}
