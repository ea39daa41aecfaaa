//! kvq-models: model configs, weights (GGUF and safetensors), tokenizers, chat templates and the architectures, all running attention through `KvCache`.

pub mod chat;
pub mod contain;
pub mod error;
pub mod files;
pub mod loader;
pub mod model;
pub mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate};
pub use error::ModelError;
pub use loader::{LoadedModel, ModelInfo, default_model_path, load, load_on};
pub use tokenizer::Tokenizer;

pub type Result<T> = std::result::Result<T, ModelError>;
