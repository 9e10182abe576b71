//! `llama4_text` as mlx-lm 0.32.2 implements it (`llama4_text.py`): a dense Llama 4 text
//! stack — no experts, no chunked attention (those are in mlx-lm's `llama4.py`, the
//! multimodal wrapper: `llama4.rs`):
//!
//!   attn  = GQA without biases; with `use_qk_norm` q and k through a weightless
//!           `fast.rms_norm(·, None, rms_norm_eps)` per head, before the head transpose;
//!           traditional (interleaved) RoPE from `rope_theta` on the layers where
//!           `no_rope_layers[i]` is non-zero, none (NoPE) where it is 0
//!   ffn   = SwiGLU of `intermediate_size_mlp` (`feed_forward`)
//!   logits = `output`(rms_norm(h)), or h @ embed_tokens.weightᵀ when tied
//!
//! The weightless norm is run as an RMSNorm with a weight of ones: x · 1 is x exactly, so
//! the values are mlx-lm's.

use mlx_rs::Array;
use serde::Deserialize;

use super::decoder::{dims_of, Decoder, Mixer};
use super::layers::{Glu, Mlp, RmsNorm, Rope};
use super::moe_family::{load_attention, AttnShape};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;

/// mlx-lm's `llama4_text.ModelArgs`: every field required there, and here.
#[derive(Debug, Clone, Deserialize)]
pub struct Llama4TextArgs {
    pub hidden_size: i32,
    pub num_attention_heads: i32,
    pub num_hidden_layers: i32,
    pub vocab_size: i32,
    pub intermediate_size_mlp: i32,
    pub num_key_value_heads: i32,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub head_dim: i32,
    pub tie_word_embeddings: bool,
    pub no_rope_layers: Vec<i64>,
    pub use_qk_norm: bool,
}

/// `fast.rms_norm(x, None, eps)` over a head: an RMSNorm whose weight is ones of `dtype`.
fn weightless_norm(head_dim: i32, eps: f32, dtype: mlx_rs::Dtype) -> Result<RmsNorm, LoadError> {
    let ones = mlx_rs::ops::ones_dtype(&[head_dim], dtype)
        .map_err(|e| LoadError::Weights(format!("llama4_text q/k norm: {e}")))?;
    Ok(RmsNorm {
        weight: ones,
        eps,
        upcast: false,
        layer_norm: None,
    })
}

pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Decoder, LoadError> {
    let a: Llama4TextArgs = config.parse()?;
    if a.no_rope_layers.len() < a.num_hidden_layers as usize {
        return Err(LoadError::Unsupported(format!(
            "llama4_text: no_rope_layers has {} entries for {} layers",
            a.no_rope_layers.len(),
            a.num_hidden_layers
        )));
    }
    // mlx-lm names the untied head `output`; the decoder reads it as `lm_head`.
    if a.tie_word_embeddings {
        w.discard(|n| n == "output.weight");
    } else {
        w.rename(|n| match n.strip_prefix("output.") {
            Some(rest) => Some(format!("lm_head.{rest}")),
            None => Some(n.to_owned()),
        });
    }
    let attn = AttnShape {
        hidden: a.hidden_size,
        heads: a.num_attention_heads,
        kv_heads: a.num_key_value_heads,
        head_dim: a.head_dim,
        qkv_bias: false,
        qk_norm_eps: None,
        rope_traditional: true,
        rope_base: a.rope_theta,
    };
    let dims = dims_of!(a, "feed_forward");
    Decoder::load(config, w, dims, |w, p, i| {
        let mut attention = load_attention(w, p, &attn)?;
        if a.no_rope_layers[i as usize] == 0 {
            attention.rope = Rope::None;
        }
        if a.use_qk_norm {
            let dtype = dtype_of(&attention.o_proj);
            attention.q_norm = Some(weightless_norm(a.head_dim, a.rms_norm_eps, dtype)?);
            attention.k_norm = Some(weightless_norm(a.head_dim, a.rms_norm_eps, dtype)?);
        }
        let ffn = Mlp::load(
            w,
            &format!("{p}.feed_forward"),
            false,
            a.hidden_size,
            a.intermediate_size_mlp,
            Glu::Swiglu,
        )?;
        let mixer: Box<dyn Mixer> = Box::new(attention);
        Ok((mixer, Box::new(ffn)))
    })
}

/// The model's float dtype as a linear holds it (a quantized one's scales).
fn dtype_of(l: &super::layers::Linear) -> mlx_rs::Dtype {
    let w: &Array = match &l.quantized {
        Some(q) => &q.scales,
        None => &l.weight,
    };
    w.dtype()
}
