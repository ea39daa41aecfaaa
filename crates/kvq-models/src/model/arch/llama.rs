//! Llama's decoder layer (RMS norms, separate q/k/v projections with optional biases, SwiGLU MLP,
//! sequential residuals), also Mistral's (the sliding window lives in the caches), Qwen2's (the
//! q/k/v biases) and that of Llama-architecture models such as Falcon3 (head_dim 256).

use crate::model::config::ModelConfig;
use crate::model::layers::{Activation, Layer, Mlp, Norm, Qkv};
use crate::model::weights::WeightSource;
use crate::{ModelError, Result};

/// Decoder layer `i`.
pub fn layer(cfg: &ModelConfig, w: &mut dyn WeightSource, i: usize) -> Result<Layer> {
    if !matches!(cfg.activation.as_str(), "silu" | "swish") {
        return Err(ModelError::Unsupported(format!(
            "{} with activation '{}' (the Llama layer is SwiGLU)",
            cfg.architecture, cfg.activation
        )));
    }
    let p = |n: &str| format!("blk.{i}.{n}");
    Ok(Layer {
        attn_norm: Norm::rms(w, &p("attn_norm"), cfg.norm_eps)?,
        mlp_norm: Some(Norm::rms(w, &p("ffn_norm"), cfg.norm_eps)?),
        parallel: false,
        qkv: Qkv::Split {
            q: w.linear(&p("attn_q"))?,
            k: w.linear(&p("attn_k"))?,
            v: w.linear(&p("attn_v"))?,
        },
        q_norm: None,
        k_norm: None,
        wo: w.linear(&p("attn_output"))?,
        post_attn_norm: None,
        post_mlp_norm: None,
        mlp: Mlp::Gated {
            gate: w.linear(&p("ffn_gate"))?,
            up: w.linear(&p("ffn_up"))?,
            down: w.linear(&p("ffn_down"))?,
            act: Activation::Silu,
        },
    })
}

/// Maps a GGUF tensor name to its Hugging Face (transformers) name.
pub fn hf_name(gguf: &str) -> Option<String> {
    let (stem, suffix) = gguf.rsplit_once('.')?;
    let top = match stem {
        "token_embd" => Some("model.embed_tokens"),
        "output_norm" => Some("model.norm"),
        "output" => Some("lm_head"),
        _ => None,
    };
    if let Some(t) = top {
        return Some(format!("{t}.{suffix}"));
    }
    let rest = stem.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let hf_part = match part {
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf_part}.{suffix}"))
}

#[cfg(test)]
mod tests {
    use super::hf_name;

    #[test]
    fn maps_gguf_names_to_hf() {
        assert_eq!(
            hf_name("blk.12.attn_q.weight").as_deref(),
            Some("model.layers.12.self_attn.q_proj.weight")
        );
        assert_eq!(
            hf_name("token_embd.weight").as_deref(),
            Some("model.embed_tokens.weight")
        );
        assert_eq!(hf_name("output.weight").as_deref(), Some("lm_head.weight"));
        assert_eq!(hf_name("blk.1.unknown.weight"), None);
    }
}
