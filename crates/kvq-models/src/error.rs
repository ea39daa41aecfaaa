//! Errors raised while loading or running a model, tokenizing or rendering a chat template.

/// What can go wrong in kvq-models.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// Loading the model at `path` failed: says which file or directory the user gave.
    #[error("{path}: {source}")]
    InFile {
        path: String,
        #[source]
        source: Box<ModelError>,
    },
    /// The model files are there but not usable (missing tensor or metadata, bad config).
    #[error("invalid model: {0}")]
    Invalid(String),
    /// The architecture is not one kvq implements.
    #[error("unsupported architecture '{0}'")]
    Unsupported(String),
    /// Tokenizer construction, encoding or decoding failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template failed to compile or render (e.g. it raised for the given roles).
    #[error("chat template: {0}")]
    Template(String),
    #[error(transparent)]
    Cache(#[from] kvq_cache::CacheError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl ModelError {
    /// Wraps an io error with the path it concerns.
    pub fn io(path: impl AsRef<std::path::Path>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.as_ref().display().to_string(),
            source,
        }
    }
}
