//! Request validation as plain functions: a parsed request (`crate::openai`) in, a checked
//! `ValidatedChat` / `ValidatedCompletion` or the `ApiError` naming the bad field out. No engine
//! is needed, so every bad-input case is unit-tested here.

pub mod fields;
pub mod format;
#[cfg(test)]
mod tests;
pub mod tools;
pub mod unsupported;

use crate::error::ApiError;
use crate::openai::{ChatCompletionRequest, CompletionRequest, StreamOptions};
use crate::state::ServerLimits;
use fields::SamplingInput;
use kvq_cache::CacheSpec;
use kvq_engine::SamplingParams;
use serde_json::Value;

/// OpenAI's default `max_tokens` for the legacy completions API.
pub const DEFAULT_COMPLETION_MAX_TOKENS: usize = 16;

/// A chat role, after mapping `developer` to `System`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
    /// A function's result (`tool_call_id` says which call).
    Tool,
}

impl Role {
    /// The name chat templates expect.
    pub fn as_str(&self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }

    /// Parses a request role (case-insensitive; `developer` is `system`).
    pub fn parse(s: &str) -> Option<Role> {
        match s.to_ascii_lowercase().as_str() {
            "system" | "developer" => Some(Role::System),
            "user" => Some(Role::User),
            "assistant" => Some(Role::Assistant),
            "tool" => Some(Role::Tool),
            _ => None,
        }
    }
}

/// One checked chat message.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub role: Role,
    pub content: String,
    /// An assistant turn's calls, as templates read them (`tools::message_tool_calls`).
    pub tool_calls: Option<Value>,
    /// A tool turn's call id.
    pub tool_call_id: Option<String>,
}

impl Message {
    /// A message with text only.
    pub fn text(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

/// What both endpoints share once checked.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedParams {
    /// `None` lets the engine fill the rest of the context.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// `Some(k)`: report logprobs with `k` alternatives.
    pub logprobs: Option<usize>,
    /// Choices to generate.
    pub n: usize,
    pub stream: bool,
    /// `stream_options.include_usage` (only meaningful when streaming).
    pub include_usage: bool,
    /// The body's `kv_cache`, if given (headers win over it).
    pub kv_cache: Option<CacheSpec>,
    /// Generate past the EOS token, up to `max_tokens` (vLLM's and llama.cpp's `ignore_eos`).
    pub ignore_eos: bool,
    /// `response_format`'s grammar (chat only); `None`: free text.
    pub response_format: Option<kvq_engine::GrammarSpec>,
}

/// A checked `/v1/chat/completions` request.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedChat {
    /// The served model's id (echoed in responses).
    pub model: String,
    pub messages: Vec<Message>,
    pub params: ValidatedParams,
    /// `tools` and how they may be called; `None` without tools.
    pub tools: Option<tools::ToolPlan>,
}

/// What `/v1/completions` was asked to continue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// A checked `/v1/completions` request.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedCompletion {
    pub model: String,
    pub prompt: Prompt,
    /// Prepend the prompt to the completion.
    pub echo: bool,
    pub params: ValidatedParams,
}

/// Checks the `model` field against the served model's id, case-insensitively. Also accepted:
/// an `org/name` form whose last part matches, the id without a file-style suffix (`X` for a
/// served `X.Q4_1`), and for a model served under a Hub id (`org/repo:QUANT@rev`) the repo
/// with or without its org, tag and revision. A missing model means the served one.
pub fn check_model(requested: Option<&str>, served: &str) -> Result<String, ApiError> {
    let Some(requested) = requested.map(str::trim).filter(|m| !m.is_empty()) else {
        return Ok(served.to_string());
    };
    let untagged = |s: &str| -> String {
        match s.contains('/') {
            true => s[..s.find([':', '@']).unwrap_or(s.len())].to_string(),
            false => s.to_string(),
        }
    };
    let tail = |s: &str| s.rsplit('/').next().unwrap_or(s).to_string();
    let forms = |s: &str| {
        let u = untagged(s);
        [s.to_string(), tail(s), tail(&u), u]
    };
    let served_forms = forms(served);
    let matches = |name: &str| {
        served_forms.iter().any(|served| {
            if name.eq_ignore_ascii_case(served) {
                return true;
            }
            match (served.get(..name.len()), served.get(name.len()..)) {
                (Some(head), Some(tail)) => {
                    head.eq_ignore_ascii_case(name) && tail.starts_with('.')
                }
                _ => false,
            }
        })
    };
    if forms(requested).iter().any(|r| matches(r)) {
        Ok(served.to_string())
    } else {
        Err(ApiError::ModelNotFound {
            model: requested.to_string(),
        })
    }
}

fn include_usage(stream: bool, opts: Option<&StreamOptions>) -> bool {
    stream && opts.and_then(|o| o.include_usage).unwrap_or(false)
}

/// Checks a chat request against the served model id and the server's limits.
pub fn validate_chat(
    req: &ChatCompletionRequest,
    served_model: &str,
    limits: &ServerLimits,
) -> Result<ValidatedChat, ApiError> {
    let model = check_model(req.model.as_deref(), served_model)?;
    unsupported::check_chat(req)?;
    let Some(raw) = req.messages.as_ref() else {
        return Err(ApiError::invalid(
            "messages",
            "'messages' is required: an array of {\"role\", \"content\"} objects.",
        ));
    };
    if raw.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "'messages' must contain at least one message.",
        ));
    }
    let mut messages = Vec::with_capacity(raw.len());
    for (i, m) in raw.iter().enumerate() {
        let role = Role::parse(&m.role).ok_or_else(|| {
            ApiError::invalid(
                format!("messages[{i}].role"),
                format!(
                    "Unsupported role '{}' in messages[{i}]; use 'system', 'developer', 'user', 'assistant' or 'tool'.",
                    m.role
                ),
            )
        })?;
        let content = fields::content(i, m.content.as_ref())?;
        let tool_calls = tools::message_tool_calls(i, m.tool_calls.as_ref())?;
        if tool_calls.is_some() && role != Role::Assistant {
            return Err(ApiError::invalid(
                format!("messages[{i}].tool_calls"),
                format!("'messages[{i}].tool_calls' belongs on an assistant message."),
            ));
        }
        let tool_call_id = match (&m.tool_call_id, role) {
            (None | Some(Value::Null), Role::Tool) => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].tool_call_id"),
                    format!("'messages[{i}]' has role 'tool' and needs a 'tool_call_id'."),
                ));
            }
            (None | Some(Value::Null), _) => None,
            (Some(Value::String(id)), Role::Tool) => Some(id.clone()),
            (Some(_), Role::Tool) => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].tool_call_id"),
                    format!("'messages[{i}].tool_call_id' must be a string."),
                ));
            }
            (Some(_), _) => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].tool_call_id"),
                    format!("'messages[{i}].tool_call_id' belongs on a 'tool' message."),
                ));
            }
        };
        messages.push(Message {
            role,
            content,
            tool_calls,
            tool_call_id,
        });
    }

    let max_tokens = match req.max_completion_tokens {
        Some(_) => fields::max_tokens("max_completion_tokens", req.max_completion_tokens)?,
        None => fields::max_tokens("max_tokens", req.max_tokens)?,
    };
    let sampling = fields::sampling(&SamplingInput {
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        min_p: req.min_p,
        seed: req.seed.as_ref(),
        frequency_penalty: req.frequency_penalty,
        presence_penalty: req.presence_penalty,
        repetition_penalty: req.repetition_penalty,
        logit_bias: req.logit_bias.as_ref(),
    })?;
    let logprobs = chat_logprobs(req.logprobs, req.top_logprobs)?;
    let stream = req.stream.unwrap_or(false);
    Ok(ValidatedChat {
        model,
        messages,
        params: ValidatedParams {
            max_tokens,
            sampling,
            stop: fields::stop(req.stop.as_ref())?,
            logprobs,
            n: fields::n(req.n, limits.max_n)?,
            stream,
            include_usage: include_usage(stream, req.stream_options.as_ref()),
            kv_cache: fields::kv_cache(req.kv_cache.as_ref())?,
            ignore_eos: req.ignore_eos.unwrap_or(false),
            response_format: format::response_format(req.response_format.as_ref())?,
        },
        tools: tools::tool_plan(
            req.tools.as_ref(),
            req.tool_choice.as_ref(),
            req.parallel_tool_calls.as_ref(),
        )?,
    })
}

/// Chat `logprobs` (bool) and `top_logprobs` (0..=20, only with `logprobs: true`).
pub fn chat_logprobs(logprobs: Option<bool>, top: Option<i64>) -> Result<Option<usize>, ApiError> {
    let enabled = logprobs.unwrap_or(false);
    match top {
        Some(k) if !(0..=fields::MAX_TOP_LOGPROBS).contains(&k) => Err(ApiError::invalid(
            "top_logprobs",
            format!(
                "'top_logprobs' must be between 0 and {}; got {k}.",
                fields::MAX_TOP_LOGPROBS
            ),
        )),
        Some(_) if !enabled => Err(ApiError::invalid(
            "top_logprobs",
            "'top_logprobs' requires 'logprobs' to be true.",
        )),
        Some(k) => Ok(Some(k as usize)),
        None => Ok(enabled.then_some(0)),
    }
}

/// Checks a legacy completions request.
pub fn validate_completion(
    req: &CompletionRequest,
    served_model: &str,
    limits: &ServerLimits,
) -> Result<ValidatedCompletion, ApiError> {
    let model = check_model(req.model.as_deref(), served_model)?;
    let prompt = prompt(req.prompt.as_ref())?;
    match &req.suffix {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(_) => {
            return Err(ApiError::invalid(
                "suffix",
                "'suffix' (insertion) is not supported by this model.",
            ));
        }
    }
    let logprobs = match req.logprobs {
        None => None,
        Some(k) if (0..=fields::MAX_LEGACY_LOGPROBS).contains(&k) => Some(k as usize),
        Some(k) => {
            return Err(ApiError::invalid(
                "logprobs",
                format!(
                    "'logprobs' must be between 0 and {}; got {k}.",
                    fields::MAX_LEGACY_LOGPROBS
                ),
            ));
        }
    };
    let echo = req.echo.unwrap_or(false);
    if echo && logprobs.is_some() {
        return Err(ApiError::invalid(
            "echo",
            "'echo' together with 'logprobs' is not supported (prompt logprobs are not computed).",
        ));
    }
    let n = fields::n(req.n, limits.max_n)?;
    if let Some(b) = req.best_of
        && b != n as i64
    {
        return Err(ApiError::invalid(
            "best_of",
            format!("'best_of' must equal 'n' ({n}); got {b}."),
        ));
    }
    let sampling = fields::sampling(&SamplingInput {
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        min_p: req.min_p,
        seed: req.seed.as_ref(),
        frequency_penalty: req.frequency_penalty,
        presence_penalty: req.presence_penalty,
        repetition_penalty: req.repetition_penalty,
        logit_bias: req.logit_bias.as_ref(),
    })?;
    let stream = req.stream.unwrap_or(false);
    Ok(ValidatedCompletion {
        model,
        prompt,
        echo,
        params: ValidatedParams {
            max_tokens: Some(
                fields::max_tokens("max_tokens", req.max_tokens)?
                    .unwrap_or(DEFAULT_COMPLETION_MAX_TOKENS),
            ),
            sampling,
            stop: fields::stop(req.stop.as_ref())?,
            logprobs,
            n,
            stream,
            include_usage: include_usage(stream, req.stream_options.as_ref()),
            kv_cache: fields::kv_cache(req.kv_cache.as_ref())?,
            ignore_eos: req.ignore_eos.unwrap_or(false),
            response_format: None,
        },
    })
}

/// `prompt`: a string, `[string]`, `[token ids]` or `[[token ids]]`.
pub fn prompt(v: Option<&Value>) -> Result<Prompt, ApiError> {
    let bad = |msg: &str| ApiError::invalid("prompt", msg);
    match v {
        None | Some(Value::Null) => Err(bad("'prompt' is required.")),
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(items)) => match items.as_slice() {
            [] => Err(bad("'prompt' must not be an empty array.")),
            [Value::String(s)] => Ok(Prompt::Text(s.clone())),
            [Value::Array(inner)] => token_ids(inner),
            items if items.iter().all(Value::is_number) => token_ids(items),
            items if items.iter().all(|i| i.is_string() || i.is_array()) => Err(bad(
                "Only one prompt per request is supported; send one string or one array of token ids.",
            )),
            _ => Err(bad(
                "'prompt' must be a string, an array of one string, or an array of token ids.",
            )),
        },
        Some(other) => Err(ApiError::invalid(
            "prompt",
            format!(
                "'prompt' must be a string or an array; got {}.",
                fields::kind(other)
            ),
        )),
    }
}

fn token_ids(items: &[Value]) -> Result<Prompt, ApiError> {
    if items.is_empty() {
        return Err(ApiError::invalid("prompt", "'prompt' has no token ids."));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| {
                    ApiError::invalid(
                        "prompt",
                        format!("'prompt[{i}]' must be a non-negative integer token id; got {v}."),
                    )
                })
        })
        .collect::<Result<Vec<u32>, ApiError>>()
        .map(Prompt::Tokens)
}

/// Checks token ids against the vocabulary size.
pub fn check_token_ids(ids: &[u32], vocab_size: usize) -> Result<(), ApiError> {
    match ids.iter().position(|&t| t as usize >= vocab_size) {
        Some(i) => Err(ApiError::invalid(
            "prompt",
            format!(
                "Token id {} at prompt[{i}] is out of range: the vocabulary has {vocab_size} tokens.",
                ids[i]
            ),
        )),
        None => Ok(()),
    }
}
