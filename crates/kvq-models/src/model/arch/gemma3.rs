//! Gemma3 (GGUF `gemma3`, e.g. Gemma-3-270M: head_dim 256): RMS norms around both sublayers
//! (pre and post, "sandwich"), per-head RMS norms of queries and keys, GeGLU with GELU's tanh
//! form, and five sliding-window layers (rotary base 10000) for every global one; embeddings
//! scaled by sqrt(hidden). The geometry and the per-layer windows and rotary bases come from
//! `ModelConfig`; llama.cpp's converter has already folded Gemma's `1 + w` into the norm weights.

use crate::Result;
use crate::model::config::ModelConfig;
use crate::model::layers::{Activation, Layer, Mlp, Norm, Qkv};
use crate::model::weights::WeightSource;

/// Decoder layer `i`.
pub fn layer(cfg: &ModelConfig, w: &mut dyn WeightSource, i: usize) -> Result<Layer> {
    let p = |n: &str| format!("blk.{i}.{n}");
    let eps = cfg.norm_eps;
    Ok(Layer {
        attn_norm: Norm::rms(w, &p("attn_norm"), eps)?,
        mlp_norm: Some(Norm::rms(w, &p("ffn_norm"), eps)?),
        parallel: false,
        qkv: Qkv::Split {
            q: w.linear(&p("attn_q"))?,
            k: w.linear(&p("attn_k"))?,
            v: w.linear(&p("attn_v"))?,
        },
        q_norm: Some(Norm::rms(w, &p("attn_q_norm"), eps)?),
        k_norm: Some(Norm::rms(w, &p("attn_k_norm"), eps)?),
        wo: w.linear(&p("attn_output"))?,
        post_attn_norm: Some(Norm::rms(w, &p("post_attention_norm"), eps)?),
        post_mlp_norm: Some(Norm::rms(w, &p("post_ffw_norm"), eps)?),
        mlp: Mlp::Gated {
            gate: w.linear(&p("ffn_gate"))?,
            up: w.linear(&p("ffn_up"))?,
            down: w.linear(&p("ffn_down"))?,
            act: Activation::GeluTanh,
        },
    })
}
