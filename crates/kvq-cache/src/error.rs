//! Errors raised by caches and by the method registry.

/// What can go wrong when a cache is chosen, built or used.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// The requested method is not in the registry.
    #[error("unknown kv cache method '{name}'; valid methods: {}", valid.join(", "))]
    UnknownMethod { name: String, valid: Vec<String> },
    /// The method exists but does not take these bits.
    #[error("kv cache method '{method}' does not accept {bits} bits; valid bits: {}", valid.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(", "))]
    InvalidBits {
        method: String,
        bits: u8,
        valid: Vec<u8>,
    },
    /// Tensors handed to the cache do not have the geometry it was built for.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// A preset file could not be read or parsed.
    #[error("cache preset {path}: {message}")]
    Preset { path: String, message: String },
    /// A data-dependent method has no usable calibration (missing, for another model, or
    /// unreadable).
    #[error("calibration: {0}")]
    Calibration(String),
    /// A saved cache state could not be made or does not fit the cache it is restored into.
    #[error("saved cache state: {0}")]
    State(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}
