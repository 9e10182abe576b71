//! `qwen2_moe` as mlx-lm 0.32.2 implements it (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's
//! attention (q/k/v biases, head_dim = hidden / heads, plain `nn.RoPE` from rope_theta) and
//! in every layer the sparse block (`moe.rs`, softmax then the top k) plus a shared expert:
//!
//!   h = embed(ids)
//!   for each layer:  h = h + attn(rms_norm(h))
//!                    x = rms_norm(h);  h = h + moe(x) + sigmoid(shared_gate(x)) · shared(x)
//!   logits = head(rms_norm(h))

use serde::Deserialize;

use super::decoder::{dims_of, Decoder, Mixer};
use super::moe::{MoeDims, Router};
use super::moe_family::{check_top_k, load_attention, AttnShape, Ffn, SharedMoe};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;

/// mlx-lm's `qwen2_moe.ModelArgs`, defaults included.
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen2MoeArgs {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub num_experts_per_tok: i32,
    pub num_experts: i32,
    pub moe_intermediate_size: i32,
    pub shared_expert_intermediate_size: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub num_key_value_heads: Option<i32>,
    #[serde(default = "theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

fn theta() -> f32 {
    1_000_000.0
}

/// Qwen2's attention as qwen2_moe builds it: q/k/v biases, head_dim = hidden / heads.
fn attention_shape(a: &Qwen2MoeArgs) -> AttnShape {
    AttnShape {
        hidden: a.hidden_size,
        heads: a.num_attention_heads,
        kv_heads: a.num_key_value_heads.unwrap_or(a.num_attention_heads),
        head_dim: a.hidden_size / a.num_attention_heads,
        qkv_bias: true,
        qk_norm_eps: None,
        rope_traditional: a.rope_traditional,
        rope_base: a.rope_theta,
    }
}

fn load_mlp(w: &mut Weights, p: &str, a: &Qwen2MoeArgs) -> Result<SharedMoe, LoadError> {
    let d = MoeDims {
        hidden: a.hidden_size,
        intermediate: a.moe_intermediate_size,
        experts: a.num_experts,
        top_k: a.num_experts_per_tok,
    };
    let shared = a.shared_expert_intermediate_size;
    SharedMoe::load(w, &format!("{p}.mlp"), d, shared, Router::SoftmaxLowTopK)
}

/// The model: mlx-lm's checks, then the decoder with qwen2_moe's layers.
pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Decoder, LoadError> {
    let a: Qwen2MoeArgs = config.parse()?;
    if a.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(LoadError::Unsupported(
            "qwen2_moe with rope_scaling: mlx-lm's qwen2_moe accepts only `linear` and then \
             applies no scaling (plain RoPE from rope_theta), so it is refused rather than \
             run unscaled"
                .into(),
        ));
    }
    check_top_k(
        "qwen2_moe",
        a.num_experts_per_tok,
        a.num_experts,
        "num_experts",
    )?;
    // mlx-lm's sanitize: a tied checkpoint's head is dropped.
    if a.tie_word_embeddings {
        w.discard(|n| n == "lm_head.weight");
    }
    let dims = dims_of!(a);
    let attn = attention_shape(&a);
    Decoder::load(config, w, dims, |w, p, _| {
        let mixer: Box<dyn Mixer> = Box::new(load_attention(w, p, &attn)?);
        Ok((mixer, Box::new(Ffn::Shared(Box::new(load_mlp(w, p, &a)?)))))
    })
}
