//! Engine errors: the ones a request causes (validation) and the ones it meets while running.

/// What can go wrong when a request is admitted or generated.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    /// The prompt alone does not fit the model's context.
    #[error(
        "This model's maximum context length is {max} tokens. However, your prompt has {prompt} tokens."
    )]
    ContextLengthExceeded { prompt: usize, max: usize },
    /// The prompt fits, but prompt + max_tokens does not.
    #[error(
        "max_tokens is too large: the prompt has {prompt} tokens and this model's maximum context length is {max} tokens, so at most {} tokens can be generated; {requested} were requested.", max.saturating_sub(*prompt)
    )]
    MaxTokensTooLarge {
        prompt: usize,
        max: usize,
        requested: usize,
    },
    /// A request parameter is out of range.
    #[error("{message}")]
    InvalidParameter { param: String, message: String },
    /// The prompt is empty.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// Too many requests are waiting; try again later.
    #[error("the server is busy: {0}")]
    Overloaded(String),
    /// The engine has stopped.
    #[error("the engine is not running")]
    Shutdown,
    /// Something failed while generating (a model or cache error).
    #[error("generation failed: {0}")]
    Internal(String),
}
