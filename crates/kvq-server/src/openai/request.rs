//! Request bodies of `/v1/chat/completions` and `/v1/completions`, as loosely typed as OpenAI
//! clients need: numbers are wide, polymorphic fields (`stop`, `content`, `prompt`, `kv_cache`)
//! stay JSON values, and unknown fields are ignored. `crate::validate` turns them into checked values.

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
pub struct InputMessage {
    /// `system`, `developer` (same as system), `user` or `assistant`.
    pub role: String,
    /// A string, or an array of `{"type": "text", "text": ...}` parts; `null` is empty.
    #[serde(default)]
    pub content: Option<Value>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
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
}

/// `POST /v1/completions` (the legacy API).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
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
}
