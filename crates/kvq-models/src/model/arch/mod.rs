//! The architecture families kvq runs. Each file says how its Hugging Face config reads, where its
//! weights are (the GGUF-style names the model asks for and their Hugging Face counterparts) and
//! which pieces (`layers.rs`) its decoder layers are made of; the forward pass is shared.
//! Adding an architecture means one file here and one arm in each match below.

pub mod falcon;
pub mod gemma3;
pub mod llama;

use super::config::ModelConfig;
use super::layers::{Layer, Norm};
use super::weights::WeightSource;
use crate::{ModelError, Result};

/// A family of architectures that share one layer layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Llama, Mistral (sliding window), Qwen2 (q/k/v biases) and Llama-architecture models such
    /// as Falcon3.
    Llama,
    /// Falcon-7B/40B/180B (`FalconForCausalLM`).
    Falcon,
    /// Gemma3 (GGUF only).
    Gemma3,
}

impl Family {
    /// The family of `cfg.architecture`.
    pub fn of(cfg: &ModelConfig) -> Result<Self> {
        match cfg.architecture.as_str() {
            "llama" | "mistral" | "qwen2" => Ok(Self::Llama),
            "falcon" => Ok(Self::Falcon),
            "gemma3" => Ok(Self::Gemma3),
            other => Err(ModelError::Unsupported(other.to_string())),
        }
    }

    /// The Hugging Face names a GGUF-style tensor name may have in this family's safetensors,
    /// most likely first (empty when it has none).
    pub fn hf_names(self, gguf: &str) -> Vec<String> {
        match self {
            Self::Llama => llama::hf_name(gguf).into_iter().collect(),
            Self::Falcon => falcon::hf_names(gguf),
            // Read from GGUF only: no Hugging Face layout.
            Self::Gemma3 => Vec::new(),
        }
    }

    /// Decoder layer `i`.
    pub fn layer(self, cfg: &ModelConfig, w: &mut dyn WeightSource, i: usize) -> Result<Layer> {
        match self {
            Self::Llama => llama::layer(cfg, w, i),
            Self::Falcon => falcon::layer(cfg, w, i),
            Self::Gemma3 => gemma3::layer(cfg, w, i),
        }
    }

    /// The norm before the output projection.
    pub fn final_norm(self, cfg: &ModelConfig, w: &mut dyn WeightSource) -> Result<Norm> {
        match self {
            Self::Llama | Self::Gemma3 => Norm::rms(w, "output_norm", cfg.norm_eps),
            Self::Falcon => Norm::layer(w, "output_norm", cfg.norm_eps),
        }
    }
}
