//! `qwen3_moe` as mlx-lm 0.32.2 implements it (Qwen3-30B-A3B, Qwen3-Coder): Qwen3's
//! attention (per-head q/k RMSNorm, explicit head_dim, plain `nn.RoPE` from rope_theta),
//! and in each layer either a dense SwiGLU MLP or the sparse MoE block (`moe.rs`):
//!
//!   h = embed(ids)
//!   for each layer:  h = h + attn(rms_norm(h));  h = h + mlp(rms_norm(h))
//!       mlp = SparseMoe  if i ∉ mlp_only_layers and num_experts > 0 and (i+1) % decoder_sparse_step == 0
//!           = Mlp        otherwise (intermediate_size wide)
//!   logits = head(rms_norm(h))

use serde::Deserialize;

use super::decoder::{dims_of, Decoder, Mixer};
use super::layers::{Glu, Mlp};
use super::moe::{MoeDims, Router, SparseMoe, EXPERT_NAMES};
use super::moe_family::{check_top_k, load_attention, AttnShape, Ffn};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;

/// mlx-lm's `qwen3_moe.ModelArgs`: every field is required there, and here.
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen3MoeArgs {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub num_experts: i32,
    pub num_experts_per_tok: i32,
    pub decoder_sparse_step: i32,
    pub mlp_only_layers: Vec<i32>,
    pub moe_intermediate_size: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub num_key_value_heads: i32,
    pub head_dim: i32,
    /// Required by mlx-lm; a transformers-5 config may carry it only in rope_parameters.
    pub rope_theta: Option<f32>,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: i32,
    pub norm_topk_prob: bool,
    pub rope_scaling: Option<serde_json::Value>,
    pub rope_parameters: Option<serde_json::Value>,
}

impl Qwen3MoeArgs {
    /// The RoPE base. mlx-lm's qwen3_moe builds `nn.RoPE(head_dim, base=rope_theta)` and
    /// never reads rope_scaling: a config that asks for scaling is refused rather than run
    /// unscaled.
    fn rope_base(&self) -> Result<f32, LoadError> {
        let kind = |v: &serde_json::Value| {
            v.get("rope_type")
                .or_else(|| v.get("type"))
                .and_then(|t| t.as_str())
                .unwrap_or("default")
                .to_owned()
        };
        for (field, v) in [
            ("rope_scaling", &self.rope_scaling),
            ("rope_parameters", &self.rope_parameters),
        ] {
            if let Some(v) = v.as_ref().filter(|v| !v.is_null()) {
                let kind = kind(v);
                if kind != "default" {
                    return Err(LoadError::Unsupported(format!(
                        "qwen3_moe with {field} type `{kind}`: mlx-lm's qwen3_moe applies no RoPE \
                         scaling (plain RoPE from rope_theta), so it is refused rather than run \
                         unscaled"
                    )));
                }
            }
        }
        let nested = self
            .rope_parameters
            .as_ref()
            .and_then(|p| p.get("rope_theta"))
            .and_then(|t| t.as_f64())
            .map(|t| t as f32);
        self.rope_theta.or(nested).ok_or_else(|| {
            LoadError::Unsupported(
                "qwen3_moe needs `rope_theta` (top level or rope_parameters)".into(),
            )
        })
    }

    /// Whether layer `i` is sparse, as `Qwen3MoeDecoderLayer.__init__` decides.
    fn sparse(&self, i: i32) -> bool {
        !self.mlp_only_layers.contains(&i)
            && self.num_experts > 0
            && (i + 1) % self.decoder_sparse_step == 0
    }
}

/// Qwen3's attention as qwen3_moe builds it: no biases, q/k RMSNorm before the transpose.
fn attention_shape(a: &Qwen3MoeArgs, base: f32) -> AttnShape {
    AttnShape {
        hidden: a.hidden_size,
        heads: a.num_attention_heads,
        kv_heads: a.num_key_value_heads,
        head_dim: a.head_dim,
        qkv_bias: false,
        qk_norm_eps: Some(a.rms_norm_eps),
        rope_traditional: false,
        rope_base: base,
    }
}

fn load_ffn(w: &mut Weights, p: &str, a: &Qwen3MoeArgs, i: i32) -> Result<Ffn, LoadError> {
    let mlp = format!("{p}.mlp");
    if !a.sparse(i) {
        let dense = Mlp::load(
            w,
            &mlp,
            false,
            a.hidden_size,
            a.intermediate_size,
            Glu::Swiglu,
        )?;
        return Ok(Ffn::Dense(dense));
    }
    let d = MoeDims {
        hidden: a.hidden_size,
        intermediate: a.moe_intermediate_size,
        experts: a.num_experts,
        top_k: a.num_experts_per_tok,
    };
    let router = Router::SoftmaxTopK {
        norm_topk_prob: a.norm_topk_prob,
    };
    let gate = format!("{mlp}.gate");
    Ok(Ffn::Sparse(SparseMoe::load(
        w,
        &mlp,
        &gate,
        d,
        router,
        EXPERT_NAMES,
    )?))
}

/// The model: mlx-lm's checks, then the decoder with qwen3_moe's layers.
pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Decoder, LoadError> {
    let a: Qwen3MoeArgs = config.parse()?;
    let base = a.rope_base()?;
    if a.decoder_sparse_step <= 0 {
        return Err(LoadError::Unsupported(format!(
            "qwen3_moe: decoder_sparse_step must be positive, got {}",
            a.decoder_sparse_step
        )));
    }
    check_top_k(
        "qwen3_moe",
        a.num_experts_per_tok,
        a.num_experts,
        "num_experts",
    )?;
    // mlx-lm's sanitize: a tied checkpoint's head is dropped.
    if a.tie_word_embeddings {
        w.discard(|n| n == "lm_head.weight");
    }
    let dims = dims_of!(a);
    let attn = attention_shape(&a, base);
    Decoder::load(config, w, dims, |w, p, i| {
        let mixer: Box<dyn Mixer> = Box::new(load_attention(w, p, &attn)?);
        Ok((mixer, Box::new(load_ffn(w, p, &a, i)?)))
    })
}
