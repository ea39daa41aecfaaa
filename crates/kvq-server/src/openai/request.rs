//! Request bodies of `/v1/chat/completions` and `/v1/completions`, as loosely typed as OpenAI
//! clients need: numbers are wide, polymorphic fields (`stop`, `content`, `prompt`, `kv_cache`)
//! stay JSON values. A field OpenAI's API does not define (nor kvq's `top_k`, `min_p`,
//! `repetition_penalty`, `kv_cache`) is a 400 naming it, as OpenAI answers. Of the fields OpenAI
//! defines, those that cannot change the answer are accepted and ignored (`user`, `metadata`,
//! `store`, ...), and those kvq does not implement (`functions`, `audio`, ...) are refused by
//! `crate::validate::unsupported`. `crate::validate` turns them into checked
//! values.

use serde::Deserialize;
use serde_json::Value;

/// `stream_options`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (and `usage: null` in the others).
    pub include_usage: Option<bool>,
}

/// One entry of `messages`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputMessage {
    /// `system`, `developer` (same as system), `user` or `assistant`.
    pub role: String,
    /// A string, or an array of `{"type": "text", "text": ...}` parts; `null` is empty.
    #[serde(default)]
    pub content: Option<Value>,
    /// OpenAI's other message fields: `name` and `refusal` are accepted and not used;
    /// `tool_calls` and `tool_call_id` are checked by `crate::validate::tools`; `function_call`
    /// and `audio` are refused (`crate::validate::unsupported`).
    #[serde(default)]
    pub name: Option<Value>,
    #[serde(default)]
    pub tool_calls: Option<Value>,
    #[serde(default)]
    pub tool_call_id: Option<Value>,
    #[serde(default)]
    pub function_call: Option<Value>,
    #[serde(default)]
    pub refusal: Option<Value>,
    #[serde(default)]
    pub audio: Option<Value>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatCompletionRequest {
    pub model: Option<String>,
    pub messages: Option<Vec<InputMessage>>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<serde_json::Number>,
    pub stop: Option<Value>,
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// `{"method": str, "bits": int}` (or just the method name): the body form of the
    /// `x-kv-cache-method` / `x-kv-cache-bits` headers.
    pub kv_cache: Option<Value>,
    /// Generate past the EOS token up to `max_tokens` (as vLLM and llama.cpp's server do).
    pub ignore_eos: Option<bool>,
    // The rest of OpenAI's fields (`deny_unknown_fields` does not combine with `flatten`, so
    // they are listed here): `logit_bias` is honored; `crate::validate::unsupported` says which
    // of the others are ignored by design and which are refused until implemented.
    pub user: Option<Value>,
    pub metadata: Option<Value>,
    pub store: Option<Value>,
    pub service_tier: Option<Value>,
    pub safety_identifier: Option<Value>,
    pub prompt_cache_key: Option<Value>,
    pub reasoning_effort: Option<Value>,
    pub verbosity: Option<Value>,
    pub logit_bias: Option<Value>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<Value>,
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
    pub response_format: Option<Value>,
    pub modalities: Option<Value>,
    pub audio: Option<Value>,
    pub prediction: Option<Value>,
    pub web_search_options: Option<Value>,
}

/// `POST /v1/completions` (the legacy API).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequest {
    pub model: Option<String>,
    /// A string, an array of one string, an array of token ids, or an array of one such array.
    pub prompt: Option<Value>,
    pub suffix: Option<Value>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<serde_json::Number>,
    pub stop: Option<Value>,
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    /// 0..=5: the chosen token's logprob and this many alternatives.
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub n: Option<i64>,
    pub best_of: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub kv_cache: Option<Value>,
    pub ignore_eos: Option<bool>,
    /// Accepted and not acted on, as in chat.
    pub user: Option<Value>,
    /// Honored, as in chat.
    pub logit_bias: Option<Value>,
}
