//! Falcon (`FalconForCausalLM`, also the older `RWForCausalLM` configs): LayerNorms with biases,
//! one fused q/k/v projection grouped per kv head (multi-query: one group; the new decoder
//! architecture of 40B/180B: `num_kv_heads` groups), rotary positions, a plain GELU MLP, and
//! attention and MLP in parallel on the layer input (with a second norm for the MLP in the new
//! decoder architecture) or, with `parallel_attn = false`, one after the other.

use crate::model::config::ModelConfig;
use crate::model::layers::{Activation, Layer, Mlp, Norm, Qkv};
use crate::model::weights::WeightSource;
use crate::{ModelError, Result};
use serde::Deserialize;

fn yes() -> bool {
    true
}
fn default_vocab() -> usize {
    65024
}
fn default_eps() -> f64 {
    1e-5
}
fn default_context() -> usize {
    2048
}
fn default_theta() -> f32 {
    10_000.0
}
fn default_activation() -> String {
    "gelu".into()
}

/// A Hugging Face Falcon `config.json` (transformers' `FalconConfig`, with the old `RW` names
/// as aliases and its defaults).
#[derive(Deserialize)]
struct FalconHf {
    #[serde(default = "default_vocab")]
    vocab_size: usize,
    hidden_size: usize,
    #[serde(alias = "n_layer")]
    num_hidden_layers: usize,
    #[serde(alias = "n_head")]
    num_attention_heads: usize,
    #[serde(alias = "n_head_kv")]
    num_kv_heads: Option<usize>,
    #[serde(default = "default_eps")]
    layer_norm_epsilon: f64,
    #[serde(default)]
    alibi: bool,
    #[serde(default)]
    new_decoder_architecture: bool,
    #[serde(default = "yes")]
    multi_query: bool,
    #[serde(default = "yes")]
    parallel_attn: bool,
    #[serde(default = "default_context")]
    max_position_embeddings: usize,
    #[serde(default = "default_theta")]
    rope_theta: f32,
    rope_scaling: Option<serde_json::Value>,
    ffn_hidden_size: Option<usize>,
    #[serde(default = "default_activation")]
    activation: String,
}

/// The model config of a Falcon `config.json`.
pub fn config(text: &str) -> Result<ModelConfig> {
    let hf: FalconHf = serde_json::from_str(text)
        .map_err(|e| ModelError::Invalid(format!("config.json (falcon): {e}")))?;
    if hf.alibi {
        return Err(ModelError::Unsupported(
            "falcon with alibi positions (only rotary is implemented)".into(),
        ));
    }
    activation(&hf.activation)?;
    if hf.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
        tracing::warn!("config.json has rope_scaling, which kvq ignores for now");
    }
    let heads = hf.num_attention_heads;
    if heads == 0 || !hf.hidden_size.is_multiple_of(heads) {
        return Err(ModelError::Invalid(format!(
            "config.json (falcon): hidden_size {} is not a multiple of {heads} heads",
            hf.hidden_size
        )));
    }
    // As transformers' FalconAttention: the new decoder has num_kv_heads groups, multi-query one,
    // the old multi-head layout one per head.
    let kv_heads = if hf.new_decoder_architecture {
        hf.num_kv_heads.unwrap_or(heads)
    } else if hf.multi_query {
        1
    } else {
        heads
    };
    Ok(ModelConfig {
        architecture: "falcon".into(),
        hidden_size: hf.hidden_size,
        intermediate_size: hf.ffn_hidden_size.unwrap_or(4 * hf.hidden_size),
        n_layers: hf.num_hidden_layers,
        n_heads: heads,
        n_kv_heads: kv_heads,
        head_dim: hf.hidden_size / heads,
        vocab_size: hf.vocab_size,
        context_length: hf.max_position_embeddings,
        rope_theta: hf.rope_theta,
        norm_eps: hf.layer_norm_epsilon,
        rope_interleaved: false,
        sliding_window: None,
        parallel_residual: hf.new_decoder_architecture || hf.parallel_attn,
        activation: hf.activation,
        global_every: None,
        rope_theta_local: None,
        embed_scale: None,
        rope_freq_factors: None,
    })
}

/// The MLP activation named by `config.json`'s `activation`.
fn activation(name: &str) -> Result<Activation> {
    match name {
        "gelu" => Ok(Activation::GeluErf),
        "gelu_new" | "gelu_pytorch_tanh" => Ok(Activation::GeluTanh),
        other => Err(ModelError::Unsupported(format!(
            "falcon activation '{other}'"
        ))),
    }
}

/// Decoder layer `i`. The norms follow the checkpoint: a second one (`ln_mlp`) makes the new
/// decoder's two-norm layer; without it a parallel layer feeds the MLP the attention norm's
/// output, a sequential one normalizes the residual after attention.
pub fn layer(cfg: &ModelConfig, w: &mut dyn WeightSource, i: usize) -> Result<Layer> {
    let p = |n: &str| format!("blk.{i}.{n}");
    let eps = cfg.norm_eps;
    let mlp_norm = if w.contains(&p("attn_norm_2.weight")) {
        Some(Norm::layer(w, &p("attn_norm_2"), eps)?)
    } else if cfg.parallel_residual {
        None
    } else {
        Some(Norm::layer(w, &p("ffn_norm"), eps)?)
    };
    Ok(Layer {
        attn_norm: Norm::layer(w, &p("attn_norm"), eps)?,
        mlp_norm,
        parallel: cfg.parallel_residual,
        qkv: Qkv::Fused {
            w: w.linear(&p("attn_qkv"))?,
        },
        q_norm: None,
        k_norm: None,
        wo: w.linear(&p("attn_output"))?,
        post_attn_norm: None,
        post_mlp_norm: None,
        mlp: Mlp::Plain {
            up: w.linear(&p("ffn_up"))?,
            down: w.linear(&p("ffn_down"))?,
            act: activation(&cfg.activation)?,
        },
    })
}

/// The Hugging Face names of a GGUF-style tensor name, most likely first.
pub fn hf_names(gguf: &str) -> Vec<String> {
    let Some((stem, suffix)) = gguf.rsplit_once('.') else {
        return Vec::new();
    };
    let top = match stem {
        "token_embd" => Some("transformer.word_embeddings"),
        "output_norm" => Some("transformer.ln_f"),
        "output" => Some("lm_head"),
        _ => None,
    };
    if let Some(t) = top {
        return vec![format!("{t}.{suffix}")];
    }
    let Some((layer, part)) = stem.strip_prefix("blk.").and_then(|r| r.split_once('.')) else {
        return Vec::new();
    };
    let parts: &[&str] = match part {
        "attn_norm" => &["ln_attn", "input_layernorm"],
        "attn_norm_2" => &["ln_mlp"],
        "ffn_norm" => &["post_attention_layernorm"],
        "attn_qkv" => &["self_attention.query_key_value"],
        "attn_output" => &["self_attention.dense"],
        "ffn_up" => &["mlp.dense_h_to_4h"],
        "ffn_down" => &["mlp.dense_4h_to_h"],
        _ => &[],
    };
    parts
        .iter()
        .map(|hf| format!("transformer.h.{layer}.{hf}.{suffix}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str =
        r#""hidden_size":64,"num_hidden_layers":2,"num_attention_heads":8,"vocab_size":100"#;

    #[test]
    fn kv_heads_follow_transformers() {
        let c = |extra: &str| config(&format!("{{{BASE}{extra}}}")).unwrap();
        // Falcon-7B: multi-query, parallel, one norm.
        let seven = c("");
        assert_eq!(
            (seven.n_kv_heads, seven.head_dim, seven.intermediate_size),
            (1, 8, 256)
        );
        assert!(seven.parallel_residual);
        // 40B: the new decoder with grouped kv heads (always parallel).
        let forty = c(r#","new_decoder_architecture":true,"num_kv_heads":2,"parallel_attn":false"#);
        assert_eq!(forty.n_kv_heads, 2);
        assert!(forty.parallel_residual);
        // The old RW names, multi-head and sequential.
        let rw = config(
            r#"{"hidden_size":64,"n_layer":2,"n_head":4,"multi_query":false,"parallel_attn":false}"#,
        )
        .unwrap();
        assert_eq!((rw.n_layers, rw.n_heads, rw.n_kv_heads), (2, 4, 4));
        assert!(!rw.parallel_residual);
        assert!(matches!(
            config(&format!(r#"{{{BASE},"alibi":true}}"#)),
            Err(ModelError::Unsupported(_))
        ));
    }

    #[test]
    fn names_map_to_both_norm_layouts() {
        assert_eq!(
            hf_names("blk.3.attn_norm.bias"),
            [
                "transformer.h.3.ln_attn.bias",
                "transformer.h.3.input_layernorm.bias"
            ]
        );
        assert_eq!(
            hf_names("blk.0.attn_qkv.weight"),
            ["transformer.h.0.self_attention.query_key_value.weight"]
        );
        assert_eq!(hf_names("output_norm.weight"), ["transformer.ln_f.weight"]);
        assert!(hf_names("blk.0.nope.weight").is_empty());
    }
}
