//! The pieces every architecture is assembled from: norms (RMS or LayerNorm), the attention
//! projections (separate q/k/v or one fused projection), the MLP (gated or plain) and the decoder
//! layer that wires them, sequentially (Llama) or in parallel (Falcon). Each architecture file in
//! `arch/` only says which pieces a layer has and where their weights are.

use super::weights::{Linear, WeightSource};
use crate::Result;
use candle_core::Tensor;

/// A normalization over the last dimension.
#[derive(Debug, Clone)]
pub enum Norm {
    /// `x / rms(x) * w`.
    Rms { w: Tensor, eps: f32 },
    /// `(x - mean) / std * w + b`.
    Layer { w: Tensor, b: Tensor, eps: f32 },
}

impl Norm {
    /// An RMS norm from `{name}.weight`.
    pub fn rms(w: &mut dyn WeightSource, name: &str, eps: f64) -> Result<Self> {
        Ok(Self::Rms {
            w: w.dense(&format!("{name}.weight"))?,
            eps: eps as f32,
        })
    }

    /// A LayerNorm from `{name}.weight` and `{name}.bias` (zero when absent).
    pub fn layer(w: &mut dyn WeightSource, name: &str, eps: f64) -> Result<Self> {
        let weight = w.dense(&format!("{name}.weight"))?;
        let bias = format!("{name}.bias");
        let b = if w.contains(&bias) {
            w.dense(&bias)?
        } else {
            weight.zeros_like()?
        };
        Ok(Self::Layer {
            w: weight,
            b,
            eps: eps as f32,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Self::Rms { w, eps } => candle_nn::ops::rms_norm(x, w, *eps)?,
            Self::Layer { w, b, eps } => candle_nn::ops::layer_norm(x, w, b, *eps)?,
        })
    }
}

/// The attention input projections.
#[derive(Debug, Clone)]
pub enum Qkv {
    Split {
        q: Linear,
        k: Linear,
        v: Linear,
    },
    /// One projection whose rows are grouped per kv head: its query heads, then its key head,
    /// then its value head (Hugging Face Falcon; multi-query is one group, the old multi-head
    /// layout one query head per group).
    Fused {
        w: Linear,
    },
}

impl Qkv {
    /// `[T, hidden]` to q `[T, heads * hd]`, k and v `[T, kv_heads * hd]`.
    pub fn project(
        &self,
        h: &Tensor,
        dense_rows: usize,
        heads: usize,
        kv_heads: usize,
        hd: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        match self {
            Self::Split { q, k, v } => Ok((
                q.forward_split(h, dense_rows)?,
                k.forward_split(h, dense_rows)?,
                v.forward_split(h, dense_rows)?,
            )),
            Self::Fused { w } => {
                let y = w.forward_split(h, dense_rows)?;
                let t = y.dim(0)?;
                let per = heads / kv_heads;
                let y = y.reshape((t, kv_heads, per + 2, hd))?;
                let part = |at: usize, n: usize, heads: usize| -> Result<Tensor> {
                    Ok(y.narrow(2, at, n)?.contiguous()?.reshape((t, heads * hd))?)
                };
                Ok((
                    part(0, per, heads)?,
                    part(per, 1, kv_heads)?,
                    part(per + 1, 1, kv_heads)?,
                ))
            }
        }
    }
}

/// An MLP activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// The exact GELU (`erf`), as PyTorch's `nn.GELU()`.
    GeluErf,
    /// GELU's tanh approximation (`gelu_pytorch_tanh`).
    GeluTanh,
}

impl Activation {
    fn apply(self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Self::Silu => candle_nn::ops::silu(x)?,
            Self::GeluErf => x.gelu_erf()?,
            Self::GeluTanh => x.gelu()?,
        })
    }
}

/// The feed-forward block.
#[derive(Debug, Clone)]
pub enum Mlp {
    /// `down(act(gate(x)) * up(x))` (Llama's SwiGLU, Gemma's GeGLU).
    Gated {
        gate: Linear,
        up: Linear,
        down: Linear,
        act: Activation,
    },
    /// `down(act(up(x)))` (Falcon).
    Plain {
        up: Linear,
        down: Linear,
        act: Activation,
    },
}

impl Mlp {
    pub fn forward(&self, x: &Tensor, dense_rows: usize) -> Result<Tensor> {
        match self {
            Self::Gated {
                gate,
                up,
                down,
                act,
            } => {
                let g = act.apply(&gate.forward_split(x, dense_rows)?)?;
                down.forward_split(&(g * up.forward_split(x, dense_rows)?)?, dense_rows)
            }
            Self::Plain { up, down, act } => {
                down.forward_split(&act.apply(&up.forward_split(x, dense_rows)?)?, dense_rows)
            }
        }
    }
}

/// One decoder layer.
#[derive(Debug, Clone)]
pub struct Layer {
    /// Norm of the layer input before attention.
    pub attn_norm: Norm,
    /// Norm before the MLP: of the residual after attention in a sequential layer; of the layer
    /// input in a parallel one (Falcon's new decoder), where `None` reuses `attn_norm`'s output
    /// (Falcon-7B).
    pub mlp_norm: Option<Norm>,
    /// Attention and MLP both read the layer input and add to the residual together.
    pub parallel: bool,
    pub qkv: Qkv,
    /// Per-head RMS norms of queries and keys before rotary (Gemma3).
    pub q_norm: Option<Norm>,
    pub k_norm: Option<Norm>,
    pub wo: Linear,
    /// Norms of the attention and MLP outputs before they join the residual (Gemma's sandwich).
    pub post_attn_norm: Option<Norm>,
    pub post_mlp_norm: Option<Norm>,
    pub mlp: Mlp,
}

impl Layer {
    /// The residual stream after this layer, given its input `x`, the attention norm's output
    /// `h` and the attention output `attn` (`[T, heads * hd]`, before `wo`).
    pub fn finish(
        &self,
        x: &Tensor,
        h: Tensor,
        attn: &Tensor,
        dense_rows: usize,
    ) -> Result<Tensor> {
        let post = |n: &Option<Norm>, y: Tensor| -> Result<Tensor> {
            match n {
                Some(n) => n.forward(&y),
                None => Ok(y),
            }
        };
        let a = post(
            &self.post_attn_norm,
            self.wo.forward_split(attn, dense_rows)?,
        )?;
        if self.parallel {
            let hm = match &self.mlp_norm {
                Some(n) => n.forward(x)?,
                None => h,
            };
            let m = post(&self.post_mlp_norm, self.mlp.forward(&hm, dense_rows)?)?;
            return Ok(((x + a)? + m)?);
        }
        let x = (x + a)?;
        let hm = match &self.mlp_norm {
            Some(n) => n.forward(&x)?,
            None => x.clone(),
        };
        let m = post(&self.post_mlp_norm, self.mlp.forward(&hm, dense_rows)?)?;
        Ok((&x + m)?)
    }
}
