//! Text ⇄ token ids: a wrapper around `tokenizers::Tokenizer` built from GGUF metadata or Hugging Face files, with BOS/EOS bookkeeping, raw token bytes and a streaming decoder.

mod gguf;
mod hf;
mod incremental;
#[cfg(test)]
mod tests;

use std::collections::HashSet;
use std::sync::OnceLock;

pub use incremental::IncrementalDecoder;

use crate::{ModelError, Result};

/// Special tokens that end an assistant turn in common chat formats. When one of them is in the
/// vocabulary *and* registered as a special token, [`Tokenizer::eos_token_ids`] includes it:
/// ChatML (`<|im_end|>`), Llama 3 (`<|eot_id|>`), Gemma (`<end_of_turn>`) and GPT-2 style
/// end-of-document (`<|endoftext|>`).
pub const CHAT_END_TOKENS: [&str; 4] =
    ["<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>"];

/// How a token's string maps back to the bytes it stands for (see [`Tokenizer::token_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ByteMode {
    /// GPT-2 byte-level BPE: every char of a token is one byte through the GPT-2 byte table.
    ByteLevel,
    /// SentencePiece style: `▁` is a space and `<0xHH>` is a raw byte.
    SentencePiece,
    /// Anything else: the bytes of the token decoded on its own.
    Other,
}

/// Whether [`Tokenizer::encode`] must fix up the BOS token the inner post-processor adds (or not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BosFix {
    /// The inner tokenizer already does what the configuration asks.
    Keep,
    /// Prepend this id when special tokens are requested.
    Prepend(u32),
    /// The inner post-processor adds this id but the configuration says not to: drop it.
    Strip(u32),
}

/// What the tokenizer files say beside the tokenizer itself: special tokens and end-of-generation ids.
#[derive(Debug, Clone, Default)]
pub(crate) struct TokenizerSpec {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub pad_token: Option<String>,
    /// `None`: trust the inner post-processor; `Some(b)`: make `encode(.., true)` add BOS iff `b`.
    pub add_bos_token: Option<bool>,
    /// Further ids that end generation (generation_config.json, GGUF eot/eom ids).
    pub extra_eos_ids: Vec<u32>,
    pub chat_template: Option<String>,
}

/// A tokenizer plus the special-token facts the rest of kvq needs. `Send + Sync`; share it in an `Arc`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<(String, Option<u32>)>,
    eos: Option<(String, Option<u32>)>,
    pad: Option<(String, Option<u32>)>,
    eos_ids: Vec<u32>,
    bos_fix: BosFix,
    adds_bos: bool,
    specials: HashSet<u32>,
    vocab_size: usize,
    byte_mode: ByteMode,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("pad", &self.pad)
            .field("eos_ids", &self.eos_ids)
            .field("adds_bos", &self.adds_bos)
            .field("special_tokens", &self.specials.len())
            .field("byte_mode", &self.byte_mode)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

/// Maps a `tokenizers` error into ours.
pub(crate) fn tok_err(context: &str, err: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(format!("{context}: {err}"))
}

impl Tokenizer {
    /// Wraps an already built `tokenizers::Tokenizer`. `bos_token`/`eos_token` name the special
    /// tokens; `add_bos_token` = `None` keeps whatever the inner post-processor does, `Some(b)`
    /// makes `encode(text, true)` start with BOS exactly when `b` is true.
    pub fn from_tokenizer(
        inner: tokenizers::Tokenizer,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
        add_bos_token: Option<bool>,
    ) -> Result<Tokenizer> {
        let spec = TokenizerSpec {
            bos_token: bos_token.map(str::to_owned),
            eos_token: eos_token.map(str::to_owned),
            add_bos_token,
            ..TokenizerSpec::default()
        };
        Self::assemble(inner, spec)
    }

    /// Builds a tokenizer from GGUF metadata (`tokenizer.ggml.*`): GPT-2 style byte-level BPE
    /// (`tokenizer.ggml.model = "gpt2"`) with the pre-tokenizer named by `tokenizer.ggml.pre`,
    /// or SentencePiece BPE (`"llama"`) rebuilt as a byte-fallback BPE like Hugging Face does.
    pub fn from_gguf(content: &candle_core::quantized::gguf_file::Content) -> Result<Tokenizer> {
        let (inner, spec) = gguf::build(content)?;
        Self::assemble(inner, spec)
    }

    /// Loads `tokenizer.json`, plus `tokenizer_config.json` (bos/eos/pad tokens, `add_bos_token`,
    /// `chat_template`) when given, and `generation_config.json` / `chat_template.jinja` when they
    /// lie beside `tokenizer.json`.
    pub fn from_hf_files(
        tokenizer_json: &std::path::Path,
        tokenizer_config_json: Option<&std::path::Path>,
    ) -> Result<Tokenizer> {
        let (inner, spec) = hf::load(tokenizer_json, tokenizer_config_json)?;
        Self::assemble(inner, spec)
    }

    /// Writes `tokenizer.json` and `tokenizer_config.json` into `dir` (created if needed), so that
    /// [`Tokenizer::from_hf_files`] (or Hugging Face) loads the same tokenizer back. The chat
    /// template written is `chat_template`, else the one this tokenizer came with, if any.
    pub fn save_hf_files(&self, dir: &std::path::Path, chat_template: Option<&str>) -> Result<()> {
        hf::save(self, dir, chat_template)
    }

    pub(crate) fn assemble(
        mut inner: tokenizers::Tokenizer,
        spec: TokenizerSpec,
    ) -> Result<Tokenizer> {
        // Inference never wants padding or truncation applied behind its back.
        inner.with_padding(None);
        inner
            .with_truncation(None)
            .map_err(|e| tok_err("disabling truncation", e))?;

        let resolve = |t: Option<String>| {
            t.map(|t| {
                let id = inner.token_to_id(&t);
                if id.is_none() {
                    tracing::warn!(token = %t, "special token is not in the vocabulary");
                }
                (t, id)
            })
        };
        let bos = resolve(spec.bos_token);
        let eos = resolve(spec.eos_token);
        let pad = resolve(spec.pad_token);

        let specials: HashSet<u32> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, tok)| tok.special)
            .map(|(id, _)| id)
            .collect();

        let mut eos_ids = Vec::new();
        let mut push_eos = |id: u32| {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        };
        if let Some((_, Some(id))) = &eos {
            push_eos(*id);
        }
        spec.extra_eos_ids.iter().copied().for_each(&mut push_eos);
        for name in CHAT_END_TOKENS {
            if let Some(id) = inner.token_to_id(name).filter(|id| specials.contains(id)) {
                push_eos(id);
            }
        }

        let bos_id = bos.as_ref().and_then(|(_, id)| *id);
        let inner_adds_bos = match bos_id {
            Some(id) => {
                let enc = inner
                    .encode_fast("", true)
                    .map_err(|e| tok_err("probing the post-processor", e))?;
                enc.get_ids().first() == Some(&id)
            }
            None => false,
        };
        let bos_fix = match (spec.add_bos_token, bos_id) {
            (Some(true), Some(id)) if !inner_adds_bos => BosFix::Prepend(id),
            (Some(false), Some(id)) if inner_adds_bos => BosFix::Strip(id),
            (Some(true), None) => {
                tracing::warn!(
                    "add_bos_token is set but there is no usable BOS token; not adding one"
                );
                BosFix::Keep
            }
            _ => BosFix::Keep,
        };
        let adds_bos = match bos_fix {
            BosFix::Prepend(_) => true,
            BosFix::Strip(_) => false,
            BosFix::Keep => inner_adds_bos,
        };

        let vocab_size = inner
            .get_vocab(true)
            .values()
            .map(|&id| id as usize + 1)
            .max()
            .unwrap_or(0);
        let byte_mode = detect_byte_mode(&inner);

        Ok(Tokenizer {
            inner,
            bos,
            eos,
            pad,
            eos_ids,
            bos_fix,
            adds_bos,
            specials,
            vocab_size,
            byte_mode,
            chat_template: spec.chat_template,
        })
    }

    /// Encodes `text`. Special-token strings in `text` (e.g. `<|im_start|>`) always become their
    /// special ids; `add_special_tokens` additionally adds BOS if this tokenizer is configured to.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| tok_err("encode", e))?;
        let mut ids = enc.get_ids().to_vec();
        if add_special_tokens {
            match self.bos_fix {
                BosFix::Keep => {}
                BosFix::Prepend(id) => ids.insert(0, id),
                BosFix::Strip(id) => {
                    if ids.first() == Some(&id) {
                        ids.remove(0);
                    }
                }
            }
        }
        Ok(ids)
    }

    /// Decodes `ids` to text; unknown ids are ignored, special tokens dropped if `skip_special_tokens`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| tok_err("decode", e))
    }

    /// All ids that end generation: the EOS token, ids from generation_config.json or GGUF
    /// `eot`/`eom` ids, and any of [`CHAT_END_TOKENS`] that are special tokens of this vocabulary.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The BOS token string, if the model names one.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos.as_ref().map(|(t, _)| t.as_str())
    }

    /// The BOS token id, if the BOS token is in the vocabulary.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos.as_ref().and_then(|(_, id)| *id)
    }

    /// The EOS token string, if the model names one.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos.as_ref().map(|(t, _)| t.as_str())
    }

    /// The padding token id, if any.
    pub fn pad_token_id(&self) -> Option<u32> {
        self.pad.as_ref().and_then(|(_, id)| *id)
    }

    /// Whether `encode(text, true)` starts with BOS.
    pub fn adds_bos_token(&self) -> bool {
        self.adds_bos
    }

    /// The chat template shipped with the tokenizer (GGUF `tokenizer.chat_template`,
    /// tokenizer_config.json `chat_template` or `chat_template.jinja`), if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// One past the largest token id (model vocabulary and added tokens together).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The token string of `id` as stored in the vocabulary (byte-level form for GPT-2 BPE).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a token string, if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Whether `id` is a special (control) token, i.e. dropped by `decode(.., true)`.
    pub fn is_special(&self, id: u32) -> bool {
        self.specials.contains(&id)
    }

    /// The raw bytes token `id` stands for (may be part of a UTF-8 sequence); empty for an unknown id.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(token) = self.inner.id_to_token(id) else {
            return Vec::new();
        };
        match self.byte_mode {
            ByteMode::ByteLevel => byte_level_bytes(&token),
            ByteMode::SentencePiece => sentencepiece_bytes(&token),
            ByteMode::Other => self
                .inner
                .decode(&[id], false)
                .map(String::into_bytes)
                .unwrap_or_else(|_| token.into_bytes()),
        }
    }

    /// The wrapped `tokenizers::Tokenizer`.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

fn detect_byte_mode(inner: &tokenizers::Tokenizer) -> ByteMode {
    let Some(decoder) = inner.get_decoder() else {
        return ByteMode::Other;
    };
    let json = serde_json::to_string(decoder).unwrap_or_default();
    if json.contains("\"ByteLevel\"") {
        ByteMode::ByteLevel
    } else if json.contains("\"ByteFallback\"") || json.contains("\"Metaspace\"") {
        ByteMode::SentencePiece
    } else {
        ByteMode::Other
    }
}

/// GPT-2's reversible byte ⇄ char table: printable Latin-1 bytes map to themselves, the other 68
/// bytes to U+0100.. in byte order. Returns the char-to-byte direction.
fn byte_level_table() -> &'static std::collections::HashMap<char, u8> {
    static TABLE: OnceLock<std::collections::HashMap<char, u8>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let mut next = 256u32;
        let mut map = std::collections::HashMap::with_capacity(256);
        for b in 0..=255u8 {
            let c = if printable(b) {
                char::from(b)
            } else {
                let c = char::from_u32(next).unwrap_or(char::REPLACEMENT_CHARACTER);
                next += 1;
                c
            };
            map.insert(c, b);
        }
        map
    })
}

/// Bytes of a byte-level token; tokens with chars outside the table (added tokens) are taken verbatim,
/// as the `ByteLevel` decoder does.
fn byte_level_bytes(token: &str) -> Vec<u8> {
    let table = byte_level_table();
    token
        .chars()
        .map(|c| table.get(&c).copied())
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| token.as_bytes().to_vec())
}

/// Bytes of a SentencePiece token: `<0xHH>` is one raw byte, `▁` a space.
fn sentencepiece_bytes(token: &str) -> Vec<u8> {
    if let Some(hex) = token.strip_prefix("<0x").and_then(|t| t.strip_suffix('>'))
        && hex.len() == 2
        && let Ok(b) = u8::from_str_radix(hex, 16)
    {
        return vec![b];
    }
    token.replace('\u{2581}', " ").into_bytes()
}
