//! Engine errors: the ones a request causes (validation) and the ones it meets while running.

/// What can go wrong when a request is admitted or generated.
#[derive(Debug, thiserror::Error)]
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
    /// The request's worst-case KV cache under its method can never fit the server's budget.
    #[error(
        "this request needs {} of KV cache as {method} ({tokens} tokens: prompt plus max_tokens); the server's KV budget is {}",
        human_bytes(*needs),
        human_bytes(*budget)
    )]
    ExceedsBudget {
        needs: usize,
        budget: usize,
        tokens: usize,
        method: String,
    },
    /// Too many requests are waiting; try again later.
    #[error("the server is busy: {0}")]
    Overloaded(String),
    /// The engine has stopped.
    #[error("the engine is not running")]
    Shutdown,
    /// This sequence's cache failed (its batch-mates go on).
    #[error("kv cache: {0}")]
    Cache(#[from] kvq_cache::CacheError),
    /// Something else failed while generating (a model error, a panic in the model step).
    #[error("generation failed: {0}")]
    Internal(String),
}

/// Bytes as people read them: `1.40 GiB`, `312.5 MiB`, `64.0 KiB`, `100 B`.
pub fn human_bytes(n: usize) -> String {
    const UNITS: [(&str, f64); 3] = [
        ("GiB", (1u64 << 30) as f64),
        ("MiB", (1u64 << 20) as f64),
        ("KiB", 1024.0),
    ];
    let x = n as f64;
    for (unit, size) in UNITS {
        if x >= size {
            let v = x / size;
            return match v >= 100.0 {
                true => format!("{v:.0} {unit}"),
                false => format!("{v:.2} {unit}"),
            };
        }
    }
    format!("{n} B")
}

#[cfg(test)]
mod tests {
    use super::human_bytes;

    #[test]
    fn bytes_read_as_people_write_them() {
        assert_eq!(human_bytes(100), "100 B");
        assert_eq!(human_bytes(1536), "1.50 KiB");
        assert_eq!(human_bytes(300 << 20), "300 MiB");
        assert_eq!(human_bytes(1_503_238_553), "1.40 GiB");
    }
}
