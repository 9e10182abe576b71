//! `mixtral` as mlx-lm 0.32.2 implements it: Llama's attention (no biases, head_dim =
//! hidden / heads, plain `nn.RoPE` from rope_theta) and in every layer the sparse block
//! `block_sparse_moe` (`moe.rs`) with Mixtral's router: the top k gate logits, then a
//! softmax over those k.
//!
//!   h = embed(ids)
//!   for each layer:  h = h + attn(rms_norm(h));  h = h + moe(rms_norm(h))
//!   logits = head(rms_norm(h))

use serde::Deserialize;

use super::decoder::{dims_of, Decoder, Mixer};
use super::moe::{MoeDims, Router, SparseMoe, MIXTRAL_EXPERT_NAMES};
use super::moe_family::{check_top_k, load_attention, AttnShape, Ffn};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;

/// mlx-lm's `mixtral.ModelArgs`, defaults included (Mixtral-8x7B's).
#[derive(Debug, Clone, Deserialize)]
pub struct MixtralArgs {
    #[serde(default = "vocab")]
    pub vocab_size: i32,
    #[serde(default = "hidden")]
    pub hidden_size: i32,
    #[serde(default = "intermediate")]
    pub intermediate_size: i32,
    #[serde(default = "layers")]
    pub num_hidden_layers: i32,
    #[serde(default = "heads")]
    pub num_attention_heads: i32,
    #[serde(default = "two")]
    pub num_experts_per_tok: i32,
    pub num_key_value_heads: Option<i32>,
    #[serde(default = "eight")]
    pub num_local_experts: i32,
    #[serde(default = "eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

fn vocab() -> i32 {
    32000
}
fn hidden() -> i32 {
    4096
}
fn intermediate() -> i32 {
    14336
}
fn layers() -> i32 {
    32
}
fn heads() -> i32 {
    32
}
fn two() -> i32 {
    2
}
fn eight() -> i32 {
    8
}
fn eps() -> f32 {
    1e-5
}
fn theta() -> f32 {
    1e6
}

/// Llama's attention as mixtral builds it: no biases, head_dim = hidden / heads.
fn attention_shape(a: &MixtralArgs) -> AttnShape {
    AttnShape {
        hidden: a.hidden_size,
        heads: a.num_attention_heads,
        kv_heads: a.num_key_value_heads.unwrap_or(a.num_attention_heads),
        head_dim: a.hidden_size / a.num_attention_heads,
        qkv_bias: false,
        qk_norm_eps: None,
        rope_traditional: a.rope_traditional,
        rope_base: a.rope_theta,
    }
}

fn load_moe(w: &mut Weights, p: &str, a: &MixtralArgs) -> Result<SparseMoe, LoadError> {
    let mlp = format!("{p}.block_sparse_moe");
    let d = MoeDims {
        hidden: a.hidden_size,
        intermediate: a.intermediate_size,
        experts: a.num_local_experts,
        top_k: a.num_experts_per_tok,
    };
    let gate = format!("{mlp}.gate");
    SparseMoe::load(w, &mlp, &gate, d, Router::TopKSoftmax, MIXTRAL_EXPERT_NAMES)
}

/// The model: mlx-lm's checks, then the decoder with Mixtral's layers.
pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Decoder, LoadError> {
    let a: MixtralArgs = config.parse()?;
    if a.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(LoadError::Unsupported(
            "mixtral with rope_scaling: mlx-lm's mixtral applies no RoPE scaling (plain \
             RoPE from rope_theta), so it is refused rather than run unscaled"
                .into(),
        ));
    }
    check_top_k(
        "mixtral",
        a.num_experts_per_tok,
        a.num_local_experts,
        "num_local_experts",
    )?;
    // mlx-lm's sanitize: a tied checkpoint's head is dropped.
    if a.tie_word_embeddings {
        w.discard(|n| n == "lm_head.weight");
    }
    let dims = dims_of!(a, "block_sparse_moe");
    let attn = attention_shape(&a);
    Decoder::load(config, w, dims, |w, p, _| {
        let mixer: Box<dyn Mixer> = Box::new(load_attention(w, p, &attn)?);
        Ok((mixer, Box::new(Ffn::Sparse(load_moe(w, p, &a)?))))
    })
}
