//! Architecture hyperparameters, read from GGUF metadata or a Hugging Face `config.json`.

use crate::{ModelError, Result};
use candle_core::quantized::gguf_file;
use serde::Deserialize;

/// More layers than any released model (the largest have about 130): a bigger count is a
/// damaged file.
pub const MAX_LAYERS: usize = 1024;

/// Everything the model definition needs to know about its shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Architecture family, e.g. `llama`.
    pub architecture: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub rope_theta: f32,
    /// Epsilon of the layer norms (RMS or LayerNorm, as the architecture has).
    pub norm_eps: f64,
    /// True when the q/k weights are laid out for interleaved (GPT-J style) rotary pairs, as
    /// llama.cpp's converter permutes them; false for Hugging Face's rotate-half layout.
    pub rope_interleaved: bool,
    /// Sliding attention window, if the architecture has one.
    pub sliding_window: Option<usize>,
    /// Attention and MLP read the layer input and add to the residual together (Falcon).
    pub parallel_residual: bool,
    /// The MLP activation as the config names it (`silu`, `gelu`, ...).
    pub activation: String,
    /// Gemma3: every `n`th layer attends globally, the others within `sliding_window`.
    pub global_every: Option<usize>,
    /// Rotary base of the sliding-window layers when it differs from `rope_theta` (Gemma3).
    pub rope_theta_local: Option<f32>,
    /// Factor the token embeddings are multiplied by (Gemma: sqrt(hidden_size)).
    pub embed_scale: Option<f32>,
    /// Divisor of each rotary frequency pair (`head_dim / 2` of them): Llama 3.1+ rope scaling
    /// (a GGUF's `rope_freqs.weight`, or config.json's `rope_scaling`); None is all ones.
    pub rope_freq_factors: Option<Vec<f32>>,
}

fn md<'a>(c: &'a gguf_file::Content, key: &str) -> Result<&'a gguf_file::Value> {
    c.metadata
        .get(key)
        .ok_or_else(|| ModelError::Invalid(format!("GGUF metadata lacks '{key}'")))
}

fn md_usize(c: &gguf_file::Content, key: &str) -> Result<usize> {
    let v = md(c, key)?;
    v.to_u64()
        .map(|x| x as usize)
        .or_else(|_| v.to_u32().map(|x| x as usize))
        .or_else(|_| v.to_i32().map(|x| x as usize))
        .map_err(|e| ModelError::Invalid(format!("GGUF '{key}': {e}")))
}

fn md_f32(c: &gguf_file::Content, key: &str) -> Result<f32> {
    md(c, key)?
        .to_f32()
        .map_err(|e| ModelError::Invalid(format!("GGUF '{key}': {e}")))
}

impl ModelConfig {
    /// Reads the hyperparameters of a GGUF file.
    pub fn from_gguf(c: &gguf_file::Content) -> Result<Self> {
        let arch = md(c, "general.architecture")?
            .to_string()
            .map_err(|e| ModelError::Invalid(e.to_string()))?
            .clone();
        // llama.cpp permutes Llama's q/k rows for interleaved rotary pairs; Qwen2 (Llama's layer
        // with q/k/v biases, which the Llama layer reads when present) keeps rotate-half order.
        let rope_interleaved = match arch.as_str() {
            "llama" => true,
            "qwen2" | "gemma3" => false,
            _ => return Err(ModelError::Unsupported(arch)),
        };
        let gemma3 = arch == "gemma3";
        let p = |k: &str| format!("{arch}.{k}");
        let hidden_size = md_usize(c, &p("embedding_length"))?;
        let n_heads = md_usize(c, &p("attention.head_count"))?;
        let n_kv_heads = md_usize(c, &p("attention.head_count_kv")).unwrap_or(n_heads);
        let head_dim = md_usize(c, &p("attention.key_length"))
            .or_else(|_| md_usize(c, &p("rope.dimension_count")))
            .unwrap_or(hidden_size / n_heads.max(1));
        let vocab_size = match c.metadata.get("tokenizer.ggml.tokens") {
            Some(gguf_file::Value::Array(v)) => v.len(),
            _ => md_usize(c, &p("vocab_size"))?,
        };
        let cfg = Self {
            architecture: arch.clone(),
            hidden_size,
            intermediate_size: md_usize(c, &p("feed_forward_length"))?,
            n_layers: md_usize(c, &p("block_count"))?,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab_size,
            context_length: md_usize(c, &p("context_length"))?,
            rope_theta: md_f32(c, &p("rope.freq_base")).unwrap_or(10_000.0),
            norm_eps: md_f32(c, &p("attention.layer_norm_rms_epsilon"))? as f64,
            rope_interleaved,
            // Gemma3 (as llama.cpp runs it): five sliding-window layers with rotary base 10000,
            // then one global layer; GeGLU with GELU's tanh form; embeddings scaled by
            // sqrt(hidden). Its GGUF norm weights already hold Gemma's `1 + w`.
            sliding_window: match gemma3 {
                true => Some(md_usize(c, &p("attention.sliding_window"))?),
                false => None,
            },
            parallel_residual: false,
            activation: if gemma3 { "gelu_pytorch_tanh" } else { "silu" }.into(),
            global_every: gemma3.then_some(6),
            rope_theta_local: gemma3.then_some(10_000.0),
            embed_scale: gemma3.then(|| (hidden_size as f32).sqrt()),
            // Read from the `rope_freqs.weight` tensor by the loader, when the file has one.
            rope_freq_factors: None,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads a Hugging Face `config.json`.
    pub fn from_hf_json(text: &str) -> Result<Self> {
        let head: ArchOnly = serde_json::from_str(text)
            .map_err(|e| ModelError::Invalid(format!("config.json: {e}")))?;
        let arch = head
            .architectures
            .first()
            .cloned()
            .unwrap_or_else(|| head.model_type.clone().unwrap_or_default());
        if matches!(
            arch.as_str(),
            "FalconForCausalLM" | "RWForCausalLM" | "falcon"
        ) {
            let cfg = super::arch::falcon::config(text)?;
            cfg.validate()?;
            return Ok(cfg);
        }
        let hf: HfConfig = serde_json::from_str(text)
            .map_err(|e| ModelError::Invalid(format!("config.json: {e}")))?;
        // Mistral is Llama's decoder with a sliding attention window (`sliding_window`, null
        // in the later releases); the caches honor it.
        let family = match arch.as_str() {
            "LlamaForCausalLM" | "llama" => "llama",
            "MistralForCausalLM" | "mistral" => "mistral",
            other => return Err(ModelError::Unsupported(other.to_string())),
        };
        let sliding_window = match (family, hf.sliding_window) {
            ("mistral", Some(0)) => {
                return Err(ModelError::Invalid(
                    "config.json: sliding_window must be positive".into(),
                ));
            }
            ("mistral", w) => w,
            _ => None,
        };
        let n_kv_heads = hf.num_key_value_heads.unwrap_or(hf.num_attention_heads);
        let head_dim = hf
            .head_dim
            .unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1));
        let rope_theta = hf.rope_theta.unwrap_or(10_000.0);
        let cfg = Self {
            architecture: family.to_string(),
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            n_layers: hf.num_hidden_layers,
            n_heads: hf.num_attention_heads,
            n_kv_heads,
            head_dim,
            vocab_size: hf.vocab_size,
            context_length: hf.max_position_embeddings,
            rope_theta,
            norm_eps: hf.rms_norm_eps.unwrap_or(1e-6),
            rope_interleaved: false,
            sliding_window,
            parallel_residual: false,
            activation: hf.hidden_act.unwrap_or_else(|| "silu".into()),
            global_every: None,
            rope_theta_local: None,
            embed_scale: None,
            rope_freq_factors: super::rope::hf_freq_factors(
                hf.rope_scaling.as_ref(),
                head_dim,
                rope_theta,
            )?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The sliding window of layer `layer` (Gemma3's global layers have none).
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        match self.global_every {
            Some(n) if n > 0 && (layer + 1).is_multiple_of(n) => None,
            _ => self.sliding_window,
        }
    }

    /// The rotary base of layer `layer`.
    pub fn layer_rope_theta(&self, layer: usize) -> f32 {
        match (self.layer_window(layer), self.rope_theta_local) {
            (Some(_), Some(local)) => local,
            _ => self.rope_theta,
        }
    }

    /// Checks the counts a damaged file could make absurd before anything is sized by them.
    fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(ModelError::Invalid(m.to_string()));
        if self.n_heads == 0
            || self.n_kv_heads == 0
            || !self.n_heads.is_multiple_of(self.n_kv_heads)
        {
            return bad("head counts must be positive and heads a multiple of kv heads");
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad("head_dim must be positive and even");
        }
        if self.n_layers == 0 || self.hidden_size == 0 || self.vocab_size == 0 {
            return bad("layers, hidden size and vocabulary must be positive");
        }
        if self.n_layers > MAX_LAYERS {
            return Err(ModelError::Invalid(format!(
                "{} layers is more than any known model has (at most {MAX_LAYERS})",
                self.n_layers
            )));
        }
        Ok(())
    }
}

/// The fields that pick the parser.
#[derive(Deserialize)]
struct ArchOnly {
    #[serde(default)]
    architectures: Vec<String>,
    model_type: Option<String>,
}

#[derive(Deserialize)]
struct HfConfig {
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    max_position_embeddings: usize,
    rope_theta: Option<f32>,
    rms_norm_eps: Option<f64>,
    rope_scaling: Option<serde_json::Value>,
    sliding_window: Option<usize>,
    hidden_act: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_config_parses_llama() {
        let c = ModelConfig::from_hf_json(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,
            "max_position_embeddings":256,"rope_theta":100000.0,"rms_norm_eps":1e-5}"#,
        )
        .unwrap();
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.n_kv_heads, 2);
        assert!(!c.rope_interleaved);
    }

    #[test]
    fn an_absurd_layer_count_is_refused_before_anything_is_sized_by_it() {
        // A fuzzed GGUF with block_count near 2^40 once made the loader allocate terabytes.
        let with = |n: usize| {
            ModelConfig::from_hf_json(&format!(
                r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
                "num_hidden_layers":{n},"num_attention_heads":4,"num_key_value_heads":2,
                "vocab_size":100,"max_position_embeddings":256}}"#
            ))
        };
        assert!(with(MAX_LAYERS).is_ok());
        let err = with(1 << 40)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("more than any known model"), "{err}");
    }

    #[test]
    fn hf_config_parses_mistral_and_its_sliding_window() {
        let base = r#""hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,"max_position_embeddings":4096"#;
        let with = |w: &str| {
            ModelConfig::from_hf_json(&format!(
                r#"{{"architectures":["MistralForCausalLM"],"sliding_window":{w},{base}}}"#
            ))
        };
        let c = with("256").unwrap();
        assert_eq!(
            (c.architecture.as_str(), c.sliding_window),
            ("mistral", Some(256))
        );
        assert_eq!(with("null").unwrap().sliding_window, None);
        assert!(matches!(with("0"), Err(ModelError::Invalid(_))));
        // Llama ignores a stray sliding_window.
        let llama = ModelConfig::from_hf_json(&format!(
            r#"{{"architectures":["LlamaForCausalLM"],"sliding_window":8,{base}}}"#
        ))
        .unwrap();
        assert_eq!(llama.sliding_window, None);
    }

    #[test]
    fn hf_config_rejects_unknown_arch_and_bad_heads() {
        let base = r#""hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"vocab_size":100,"max_position_embeddings":256"#;
        let unknown = format!(r#"{{"architectures":["GPTNeoX"],"num_attention_heads":4,{base}}}"#);
        assert!(matches!(
            ModelConfig::from_hf_json(&unknown),
            Err(ModelError::Unsupported(_))
        ));
        let bad = format!(
            r#"{{"architectures":["LlamaForCausalLM"],"num_attention_heads":4,"num_key_value_heads":3,{base}}}"#
        );
        assert!(matches!(
            ModelConfig::from_hf_json(&bad),
            Err(ModelError::Invalid(_))
        ));
    }
}
