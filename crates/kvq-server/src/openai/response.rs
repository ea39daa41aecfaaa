//! Response bodies: `chat.completion`, `chat.completion.chunk`, `text_completion`, the model list,
//! and the conversions from the engine's `Usage` and `LogprobInfo`.

use kvq_engine::{LogprobInfo, TopLogprob, Usage};
use serde::Serialize;

/// OpenAI reports "practically impossible" as -9999; JSON has no -inf.
fn finite_logprob(lp: f32) -> f32 {
    if lp.is_finite() { lp } else { -9999.0 }
}

/// `usage`, with kvq's `kv_cache_bytes` beside OpenAI's counts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UsageOut {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    /// OpenAI's breakdown of the prompt tokens: how many came from a held prefix.
    pub prompt_tokens_details: PromptTokensDetails,
    /// Resident bytes of the request's KV cache at its largest.
    pub kv_cache_bytes: usize,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens not prefilled: the request continued from a held prefix's caches.
    pub cached_tokens: usize,
}

impl From<&Usage> for UsageOut {
    fn from(u: &Usage) -> Self {
        Self {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: u.cached_tokens,
            },
            kv_cache_bytes: u.kv_cache_bytes,
        }
    }
}

impl UsageOut {
    /// Adds another choice's counts (for `n > 1`): prompt tokens are counted once.
    pub fn add_choice(&mut self, other: &UsageOut) {
        self.completion_tokens += other.completion_tokens;
        // Cached: what every choice's prompt was served from.
        let cached = &mut self.prompt_tokens_details.cached_tokens;
        *cached = (*cached).min(other.prompt_tokens_details.cached_tokens);
        self.total_tokens = self.prompt_tokens + self.completion_tokens;
        self.kv_cache_bytes += other.kv_cache_bytes;
    }
}

/// One alternative in chat `top_logprobs`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopLogprobOut {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

impl From<&TopLogprob> for TopLogprobOut {
    fn from(t: &TopLogprob) -> Self {
        Self {
            token: t.token.clone(),
            logprob: finite_logprob(t.logprob),
            bytes: t.bytes.clone(),
        }
    }
}

/// One generated token in chat `logprobs.content`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprobOut>,
}

impl From<&LogprobInfo> for ChatTokenLogprob {
    fn from(l: &LogprobInfo) -> Self {
        Self {
            token: l.token.clone(),
            logprob: finite_logprob(l.logprob),
            bytes: l.bytes.clone(),
            top_logprobs: l.top.iter().map(TopLogprobOut::from).collect(),
        }
    }
}

/// Chat `logprobs`: `{"content": [...]}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

impl ChatLogprobs {
    pub fn from_infos(infos: &[LogprobInfo]) -> Self {
        Self {
            content: infos.iter().map(ChatTokenLogprob::from).collect(),
        }
    }
}

/// The assistant's reply in a non-streaming chat response.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResponseMessage {
    pub role: &'static str,
    /// `null` when the reply is only tool calls.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

/// One call in a reply: `{"id", "type": "function", "function": {"name", "arguments"}}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCallOut {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionOut,
}

/// A call's function: its name and its arguments as JSON text.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionOut {
    pub name: String,
    pub arguments: String,
}

/// A call in a streamed `delta.tool_calls`: the whole call in one chunk, with its position.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(flatten)]
    pub call: ToolCallOut,
}

/// One choice of a `chat.completion`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ResponseMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
}

/// A non-streaming chat response.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: UsageOut,
}

/// The `delta` of a chunk: `{"role": "assistant", "content": ""}` first, `{"content": ...}`
/// after, `{}` in the finishing chunk.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// One choice of a `chat.completion.chunk`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// A streamed chat chunk. `usage` is absent unless `stream_options.include_usage`; then it is
/// `null` in every chunk but the last.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageOut>>,
}

/// Legacy completions `logprobs`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<serde_json::Map<String, serde_json::Value>>,
    pub text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    /// Appends tokens; `offset` is the text length before them and is advanced past them.
    pub fn push_all(&mut self, infos: &[LogprobInfo], offset: &mut usize) {
        for info in infos {
            self.tokens.push(info.token.clone());
            self.token_logprobs.push(finite_logprob(info.logprob));
            let mut top = serde_json::Map::new();
            for t in &info.top {
                top.insert(
                    t.token.clone(),
                    serde_json::json!(finite_logprob(t.logprob)),
                );
            }
            self.top_logprobs.push(top);
            self.text_offset.push(*offset);
            *offset += info.token.len();
        }
    }
}

/// One choice of a `text_completion` (whole or chunk).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionChoice {
    pub text: String,
    pub index: usize,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// A `text_completion`, whole or streamed (then `usage` follows the chat chunk convention).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TextCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageOut>>,
}

/// One entry of `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}
