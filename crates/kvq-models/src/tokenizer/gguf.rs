//! Rebuilds a Hugging Face style tokenizer from GGUF `tokenizer.ggml.*` metadata (GPT-2 byte-level BPE and SentencePiece BPE).

use std::collections::HashSet;

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Merges, Vocab};
use tokenizers::normalizers::{NFC, Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::sequence::Sequence as ProcessorSequence;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    SplitDelimiterBehavior,
};

use super::{TokenizerSpec, tok_err};
use crate::{ModelError, Result};

/// GGUF token types (llama.cpp `llama_token_type`).
const TOKEN_TYPE_UNKNOWN: i32 = 2;
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Llama 3's split regex (tokenizer.json `Split` pre-tokenizer), also used by Falcon 3, DBRX, Smaug.
const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's split regex: like Llama 3's but digits one at a time.
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenization families `tokenizer.ggml.pre` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PreKind {
    /// Plain GPT-2 regex inside the ByteLevel pre-tokenizer.
    Gpt2,
    /// `Digits(individual)` then GPT-2 ByteLevel: SmolLM, StarCoder, Refact, Command-R.
    DigitsThenGpt2,
    /// Llama 3 split regex, then ByteLevel without its own regex; merges ignored for whole-vocab words.
    Llama3,
    /// Qwen 2: NFC normalizer, Qwen split regex, ByteLevel without regex.
    Qwen2,
}

fn pre_kind(pre: Option<&str>) -> PreKind {
    match pre {
        None
        | Some(
            "default" | "gpt-2" | "gpt2" | "phi-2" | "olmo" | "roberta-bpe" | "jina-es" | "jina-de",
        ) => PreKind::Gpt2,
        Some(
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b",
        ) => PreKind::DigitsThenGpt2,
        Some(
            "llama3" | "llama-bpe" | "llama-v3" | "falcon3" | "dbrx" | "smaug-bpe" | "pixtral",
        ) => PreKind::Llama3,
        Some("qwen2" | "deepseek-r1-qwen" | "megrez") => PreKind::Qwen2,
        Some(other) => {
            tracing::warn!(
                pre = other,
                "unknown tokenizer.ggml.pre; using GPT-2 byte-level pre-tokenization"
            );
            PreKind::Gpt2
        }
    }
}

fn get<'a>(content: &'a Content, key: &str) -> Option<&'a Value> {
    content.metadata.get(key)
}

fn value_i64(v: &Value) -> Option<i64> {
    Some(match v {
        Value::U8(x) => i64::from(*x),
        Value::I8(x) => i64::from(*x),
        Value::U16(x) => i64::from(*x),
        Value::I16(x) => i64::from(*x),
        Value::U32(x) => i64::from(*x),
        Value::I32(x) => i64::from(*x),
        Value::U64(x) => i64::try_from(*x).ok()?,
        Value::I64(x) => *x,
        _ => return None,
    })
}

fn bad(key: &str, what: &str) -> ModelError {
    ModelError::Invalid(format!("GGUF metadata {key}: expected {what}"))
}

fn get_str<'a>(content: &'a Content, key: &str) -> Result<Option<&'a str>> {
    match get(content, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(bad(key, "a string")),
    }
}

fn get_u32(content: &Content, key: &str) -> Result<Option<u32>> {
    match get(content, key) {
        None => Ok(None),
        Some(v) => value_i64(v)
            .and_then(|x| u32::try_from(x).ok())
            .map(Some)
            .ok_or_else(|| bad(key, "a non-negative integer")),
    }
}

fn get_bool(content: &Content, key: &str) -> Result<Option<bool>> {
    match get(content, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(bad(key, "a bool")),
    }
}

fn get_array<'a>(content: &'a Content, key: &str) -> Result<Option<&'a [Value]>> {
    match get(content, key) {
        None => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a)),
        Some(_) => Err(bad(key, "an array")),
    }
}

fn get_strings<'a>(content: &'a Content, key: &str) -> Result<Option<Vec<&'a str>>> {
    let Some(arr) = get_array(content, key)? else {
        return Ok(None);
    };
    arr.iter()
        .map(|v| match v {
            Value::String(s) => Ok(s.as_str()),
            _ => Err(bad(key, "an array of strings")),
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// Builds the inner tokenizer and what [`super::Tokenizer::assemble`] needs from GGUF metadata.
pub(super) fn build(content: &Content) -> Result<(tokenizers::Tokenizer, TokenizerSpec)> {
    let model = get_str(content, "tokenizer.ggml.model")?
        .ok_or_else(|| ModelError::Invalid("GGUF has no tokenizer.ggml.model".into()))?;
    let tokens = get_strings(content, "tokenizer.ggml.tokens")?
        .ok_or_else(|| ModelError::Invalid("GGUF has no tokenizer.ggml.tokens".into()))?;
    let types: Vec<i32> = match get_array(content, "tokenizer.ggml.token_type")? {
        Some(arr) => arr
            .iter()
            .map(|v| value_i64(v).and_then(|x| i32::try_from(x).ok()))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("tokenizer.ggml.token_type", "an array of integers"))?,
        None => Vec::new(),
    };
    if !types.is_empty() && types.len() != tokens.len() {
        return Err(ModelError::Invalid(format!(
            "GGUF tokenizer.ggml.token_type has {} entries for {} tokens",
            types.len(),
            tokens.len()
        )));
    }

    let (mut inner, default_add_bos) = match model {
        "gpt2" => (build_gpt2(content, &tokens)?, false),
        "llama" => (build_llama_spm(content, &tokens)?, true),
        other => {
            return Err(ModelError::Unsupported(format!(
                "tokenizer model '{other}' (tokenizer.ggml.model); kvq supports 'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE)"
            )));
        }
    };

    // Control (and unknown) tokens are special (skipped by decode(.., true)); user-defined ones are matched
    // verbatim in text but decode as ordinary text.
    let mut special = Vec::new();
    let mut user = Vec::new();
    for (tok, ty) in tokens.iter().zip(types.iter()) {
        match *ty {
            TOKEN_TYPE_CONTROL | TOKEN_TYPE_UNKNOWN => {
                special.push(AddedToken::from(*tok, true).normalized(false))
            }
            TOKEN_TYPE_USER_DEFINED => user.push(AddedToken::from(*tok, false).normalized(false)),
            _ => {}
        }
    }
    inner
        .add_special_tokens(special)
        .map_err(|e| tok_err("adding control tokens", e))?;
    inner
        .add_tokens(user)
        .map_err(|e| tok_err("adding user-defined tokens", e))?;

    let token_name = |key: &str| -> Result<Option<String>> {
        Ok(match get_u32(content, key)? {
            Some(id) => {
                let name = tokens.get(id as usize).map(|t| (*t).to_owned());
                if name.is_none() {
                    tracing::warn!(key, id, "GGUF special token id is out of the vocabulary");
                }
                name
            }
            None => None,
        })
    };
    let bos_token = token_name("tokenizer.ggml.bos_token_id")?;
    let eos_token = token_name("tokenizer.ggml.eos_token_id")?;
    let pad_token = token_name("tokenizer.ggml.padding_token_id")?;
    let add_bos = get_bool(content, "tokenizer.ggml.add_bos_token")?.unwrap_or(default_add_bos);

    // Make the saved tokenizer.json self-contained: BOS comes from the post-processor, like HF.
    if add_bos && let Some(bos) = &bos_token {
        let id = get_u32(content, "tokenizer.ggml.bos_token_id")?.unwrap_or_default();
        match bos_template(bos, id) {
            Ok(tp) => {
                let post: PostProcessorWrapper = match inner.get_post_processor() {
                    Some(existing) => {
                        ProcessorSequence::new(vec![existing.clone(), tp.into()]).into()
                    }
                    None => tp.into(),
                };
                inner.with_post_processor(Some(post));
            }
            // assemble() falls back to prepending BOS by hand.
            Err(e) => tracing::warn!(error = %e, "cannot express BOS as a template post-processor"),
        }
    }

    let mut extra_eos_ids = Vec::new();
    for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        if let Some(id) = get_u32(content, key)?
            && (id as usize) < tokens.len()
        {
            extra_eos_ids.push(id);
        }
    }

    let spec = TokenizerSpec {
        bos_token,
        eos_token,
        pad_token,
        add_bos_token: Some(add_bos),
        extra_eos_ids,
        chat_template: get_str(content, "tokenizer.chat_template")?.map(str::to_owned),
    };
    Ok((inner, spec))
}

fn bos_template(bos: &str, id: u32) -> Result<TemplateProcessing> {
    TemplateProcessing::builder()
        .try_single(format!("{bos}:0 $A:0"))
        .map_err(|e| tok_err("BOS template", e))?
        .try_pair(format!("{bos}:0 $A:0 {bos}:1 $B:1"))
        .map_err(|e| tok_err("BOS template", e))?
        .special_tokens(vec![(bos.to_owned(), id)])
        .build()
        .map_err(|e| tok_err("BOS template", e))
}

/// Token string → id; on duplicates the first id wins (later ones stay reachable by id only).
fn vocab_of(tokens: &[&str]) -> Result<Vocab> {
    let mut vocab = Vocab::with_capacity(tokens.len());
    let mut duplicates = 0usize;
    for (id, tok) in tokens.iter().enumerate() {
        let id =
            u32::try_from(id).map_err(|_| ModelError::Invalid("vocabulary too large".into()))?;
        if vocab.contains_key(*tok) {
            duplicates += 1;
        } else {
            vocab.insert((*tok).to_owned(), id);
        }
    }
    if duplicates > 0 {
        tracing::warn!(duplicates, "GGUF vocabulary has duplicate token strings");
    }
    Ok(vocab)
}

fn build_gpt2(content: &Content, tokens: &[&str]) -> Result<tokenizers::Tokenizer> {
    let merges: Merges = get_strings(content, "tokenizer.ggml.merges")?
        .ok_or_else(|| {
            ModelError::Invalid("GGUF gpt2 tokenizer has no tokenizer.ggml.merges".into())
        })?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| ModelError::Invalid(format!("GGUF merge '{m}' is not 'left right'")))
        })
        .collect::<Result<_>>()?;
    let kind = pre_kind(get_str(content, "tokenizer.ggml.pre")?);
    let bpe = BPE::builder()
        .vocab_and_merges(vocab_of(tokens)?, merges)
        .ignore_merges(kind == PreKind::Llama3)
        .build()
        .map_err(|e| tok_err("building BPE from GGUF", e))?;

    let byte_level = |use_regex: bool| ByteLevel::new(false, true, use_regex);
    let split = |re: &str| {
        Split::new(
            SplitPattern::Regex(re.to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| tok_err("pre-tokenizer regex", e))
    };
    let pre: PreTokenizerWrapper = match kind {
        PreKind::Gpt2 => byte_level(true).into(),
        PreKind::DigitsThenGpt2 => {
            PreSequence::new(vec![Digits::new(true).into(), byte_level(true).into()]).into()
        }
        PreKind::Llama3 => {
            PreSequence::new(vec![split(LLAMA3_REGEX)?.into(), byte_level(false).into()]).into()
        }
        PreKind::Qwen2 => {
            PreSequence::new(vec![split(QWEN2_REGEX)?.into(), byte_level(false).into()]).into()
        }
    };

    let mut tok = tokenizers::Tokenizer::new(bpe);
    if kind == PreKind::Qwen2 {
        tok.with_normalizer(Some(NormalizerWrapper::from(NFC)))
            .map_err(|e| tok_err("normalizer", e))?;
    }
    tok.with_pre_tokenizer(Some(pre));
    tok.with_decoder(Some(DecoderWrapper::from(byte_level(true))));
    tok.with_post_processor(Some(PostProcessorWrapper::from(byte_level(true))));
    Ok(tok)
}

/// SentencePiece BPE (`tokenizer.ggml.model = "llama"`), converted the way Hugging Face's
/// `LlamaConverter` does: merges recovered from the scored vocabulary, byte fallback, `▁` for spaces.
fn build_llama_spm(content: &Content, tokens: &[&str]) -> Result<tokenizers::Tokenizer> {
    let scores: Vec<f32> = match get_array(content, "tokenizer.ggml.scores")? {
        Some(arr) => arr
            .iter()
            .map(|v| match v {
                Value::F32(x) => Some(*x),
                Value::F64(x) => Some(*x as f32),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("tokenizer.ggml.scores", "an array of floats"))?,
        None => Vec::new(),
    };
    let vocab = vocab_of(tokens)?;
    let merges = merges_from_scores(tokens, &scores, &vocab);
    let unk = get_u32(content, "tokenizer.ggml.unknown_token_id")?
        .and_then(|id| tokens.get(id as usize))
        .map_or_else(|| "<unk>".to_owned(), |t| (*t).to_owned());
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if tokens.contains(&unk.as_str()) {
        builder = builder.unk_token(unk);
    }
    let bpe = builder
        .build()
        .map_err(|e| tok_err("building SentencePiece BPE from GGUF", e))?;

    let add_space = get_bool(content, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
    let replace = || Replace::new(" ", "\u{2581}").map_err(|e| tok_err("normalizer", e));
    let mut normalizers: Vec<NormalizerWrapper> = Vec::new();
    if add_space {
        normalizers.push(Prepend::new("\u{2581}".to_owned()).into());
    }
    normalizers.push(replace()?.into());
    let unreplace = Replace::new("\u{2581}", " ").map_err(|e| tok_err("decoder", e))?;
    let mut decoders: Vec<DecoderWrapper> = vec![
        unreplace.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_space {
        decoders.push(Strip::new(' ', 1, 0).into());
    }

    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_normalizer(Some(NormalizerSequence::new(normalizers)))
        .map_err(|e| tok_err("normalizer", e))?;
    tok.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(tok)
}

/// Every split of a vocabulary piece into two vocabulary pieces is a merge, ranked by the merged
/// piece's score (higher first), then by its id.
fn merges_from_scores(tokens: &[&str], scores: &[f32], vocab: &Vocab) -> Merges {
    let score = |id: usize| scores.get(id).copied().unwrap_or(-(id as f32));
    let mut ranked: Vec<(f32, usize, u32, u32, String, String)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if piece.chars().count() < 2 {
            continue;
        }
        for (split, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(split);
            if let (Some(&li), Some(&ri)) = (vocab.get(l), vocab.get(r)) {
                ranked.push((score(id), id, li, ri, l.to_owned(), r.to_owned()));
            }
        }
    }
    ranked.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then(a.1.cmp(&b.1))
            .then(a.2.cmp(&b.2))
            .then(a.3.cmp(&b.3))
    });
    let mut seen = HashSet::new();
    ranked
        .into_iter()
        .map(|(_, _, _, _, l, r)| (l, r))
        .filter(|pair| seen.insert(pair.clone()))
        .collect()
}
