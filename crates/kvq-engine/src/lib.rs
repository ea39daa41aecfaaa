//! kvq-engine: turns requests into streams of tokens. Owns the model on a worker thread, schedules
//! every running sequence (continuous batching), samples, detokenizes, matches stop strings and
//! frees a sequence's cache the moment its client goes away.

pub mod engine;
pub mod error;
pub mod grammar;
mod prefix;
mod release;
pub mod request;
pub mod sampling;
mod sequence;
pub mod stop;
pub mod store;
mod worker;

pub use engine::{DEFAULT_PREFIX_CACHE, Engine, EngineConfig, EngineStats};
pub use error::EngineError;
pub use grammar::{Constraint, GrammarCompiler, GrammarError, GrammarSpec};
pub use request::{
    FinishReason, GenerationEvent, GenerationRequest, GenerationStream, LogprobInfo,
    SamplingParams, TopLogprob, Usage,
};
pub use store::{KvStore, KvStoreConfig, StoreError, StoreStats};
