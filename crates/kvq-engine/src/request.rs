//! What a client hands the engine (`GenerationRequest`) and what it gets back (a stream of `GenerationEvent`s).

use crate::EngineError;
use crate::grammar::Constraint;
use kvq_cache::ResolvedCache;
use std::time::Duration;

/// Sampling controls, as OpenAI names them. `temperature == 0` is greedy.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_p: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    /// 0 disables min-p.
    pub min_p: f32,
    /// Same seed, same output; `None` draws a random seed.
    pub seed: Option<u64>,
    /// OpenAI frequency penalty: subtracts `penalty * count` from generated tokens' logits.
    pub frequency_penalty: f32,
    /// OpenAI presence penalty: subtracts `penalty` from every token generated at least once.
    pub presence_penalty: f32,
    /// HF/llama.cpp repetition penalty over prompt and output tokens; 1 disables it.
    pub repetition_penalty: f32,
    /// OpenAI `logit_bias`: added to these tokens' logits before every pick, greedy included
    /// (-100 bans a token in practice, 100 all but forces it).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Greedy decoding, no penalties.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }
}

/// One request to generate.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    /// Prompt token ids (already templated and tokenized).
    pub prompt: Vec<u32>,
    /// Most tokens to generate; `None` fills the rest of the context.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    /// Strings that end generation; never emitted, matched across token boundaries.
    pub stop: Vec<String>,
    /// Stop on the model's end-of-sequence tokens (true for chat and completions).
    pub stop_on_eos: bool,
    /// `Some(n)`: report the chosen token's logprob and the top `n` alternatives.
    pub logprobs: Option<usize>,
    /// The KV cache method to build this sequence's cache with.
    pub cache: ResolvedCache,
    /// `Some`: every pick is masked to this grammar and generation stops when it completes.
    pub constraint: Option<Constraint>,
}

/// One alternative in `top_logprobs`.
#[derive(Debug, Clone, PartialEq)]
pub struct TopLogprob {
    pub id: u32,
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// The logprob of a generated token and its top alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct LogprobInfo {
    pub id: u32,
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top: Vec<TopLogprob>,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// max_tokens or the context length.
    Length,
}

impl FinishReason {
    /// OpenAI's name.
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Counts and timings of one finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Prompt tokens not prefilled: the request continued from a held prefix's caches
    /// (OpenAI's `prompt_tokens_details.cached_tokens`).
    pub cached_tokens: usize,
    /// Tokens the model generated, the end-of-sequence token included.
    pub completion_tokens: usize,
    /// Resident bytes of this request's KV cache at its largest.
    pub kv_cache_bytes: usize,
    /// The cache method that ran.
    pub kv_cache_method: String,
    /// From admission to the first generated token.
    pub time_to_first_token: Duration,
    /// From the first to the last generated token.
    pub decode_time: Duration,
    /// With a response format: time spent masking and following the grammar, and the masks
    /// computed (one per generated token).
    pub grammar: Option<(Duration, u64)>,
}

/// What the engine sends back, in order: `Delta`s, then exactly one `Finished` or `Error`.
#[derive(Debug)]
pub enum GenerationEvent {
    /// New text (possibly empty while a stop string might be forming) and, when a token was
    /// generated in this step, its id and logprobs. A final flush may carry text and no token.
    Delta {
        text: String,
        token: Option<u32>,
        logprob: Option<LogprobInfo>,
    },
    /// Generation ended normally.
    Finished { reason: FinishReason, usage: Usage },
    /// Generation failed after it began.
    Error(EngineError),
}

/// The receiving end a client reads; dropping it cancels the request and frees its cache.
pub type GenerationStream = tokio::sync::mpsc::UnboundedReceiver<GenerationEvent>;
