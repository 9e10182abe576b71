//! `qwen3_next` (Qwen3-Next) as mlx-lm 0.32.2 implements it: Qwen 3.5's decoder
//! (`qwen3_5.rs`: gated delta nets beside gated attention every `full_attention_interval`
//! layers) with the delta nets' fused projections (`in_proj_qkvz`, `in_proj_ba`, grouped per
//! key head) and the sparse block on the layers `decoder_sparse_step` picks outside
//! `mlp_only_layers`. RoPE reads the top-level `rope_theta`, `partial_rotary_factor` and
//! `rope_scaling` (mlx-lm's qwen3_next has no `rope_parameters`).
//!
//! mlx-lm's sanitize acts only on Hugging Face's per-expert layout (`experts.{e}.…`): it
//! then drops `mtp.` heads and a tied `lm_head`, stacks the experts (`SwitchGlu::load`
//! stacks them here), moves the conv kernels and gives the (1 + w) norms their 1; a
//! checkpoint already in MLX's layout is read as is.

use serde::Deserialize;

use super::gated_delta::GdnLayout;
use super::moe::stack_experts;
use super::qwen3_5::{self, Qwen35Args};
use crate::load::config::{ModelConfig, RopeScaling};
use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::plant::{self, Defect};

/// mlx-lm's `qwen3_next.ModelArgs`.
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen3NextArgs {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub linear_num_value_heads: i32,
    pub linear_num_key_heads: i32,
    pub linear_key_head_dim: i32,
    pub linear_value_head_dim: i32,
    pub linear_conv_kernel_dim: i32,
    pub num_experts: i32,
    pub num_experts_per_tok: i32,
    pub decoder_sparse_step: i32,
    pub shared_expert_intermediate_size: i32,
    pub mlp_only_layers: Vec<i32>,
    pub moe_intermediate_size: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub num_key_value_heads: i32,
    pub rope_theta: f32,
    pub partial_rotary_factor: f64,
    pub max_position_embeddings: i32,
    pub head_dim: i32,
    #[serde(default)]
    pub norm_topk_prob: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default = "four")]
    pub full_attention_interval: i32,
}

fn four() -> i32 {
    4
}

impl Qwen3NextArgs {
    /// The same decoder's arguments in Qwen 3.5's terms.
    fn as_qwen3_5(&self) -> Qwen35Args {
        Qwen35Args {
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            rms_norm_eps: self.rms_norm_eps,
            vocab_size: self.vocab_size,
            num_key_value_heads: self.num_key_value_heads,
            max_position_embeddings: self.max_position_embeddings,
            linear_num_value_heads: self.linear_num_value_heads,
            linear_num_key_heads: self.linear_num_key_heads,
            linear_key_head_dim: self.linear_key_head_dim,
            linear_value_head_dim: self.linear_value_head_dim,
            linear_conv_kernel_dim: self.linear_conv_kernel_dim,
            tie_word_embeddings: self.tie_word_embeddings,
            attention_bias: self.attention_bias,
            head_dim: Some(self.head_dim),
            full_attention_interval: self.full_attention_interval,
            num_experts: self.num_experts,
            num_experts_per_tok: self.num_experts_per_tok,
            moe_intermediate_size: self.moe_intermediate_size,
            shared_expert_intermediate_size: self.shared_expert_intermediate_size,
            norm_topk_prob: self.norm_topk_prob,
            rope_parameters: None,
            partial_rotary_factor: self.partial_rotary_factor,
            rope_theta: self.rope_theta,
            rope_scaling: self.rope_scaling.clone(),
        }
    }

    /// Whether layer i's MLP is the sparse block.
    fn sparse(&self, i: i32) -> bool {
        !self.mlp_only_layers.contains(&i)
            && self.num_experts > 0
            && (i + 1) % self.decoder_sparse_step.max(1) == 0
    }
}

/// mlx-lm's `sanitize` (see the module header).
fn sanitize(w: &mut Weights, a: &Qwen3NextArgs) -> Result<(), LoadError> {
    let names = w.remaining();
    let moe_layers: Vec<i32> = names
        .iter()
        .filter(|n| n.starts_with("model.layers.") && n.ends_with(".mlp.experts.0.up_proj.weight"))
        .filter_map(|n| n.split('.').nth(2)?.parse().ok())
        .collect();
    // Stacked by `SwitchGlu::load`.
    if moe_layers.is_empty() && !plant::is(Defect::HybridNormOffsetOnMlxLayout) {
        return Ok(());
    }
    w.discard(|n| n.contains("mtp."));
    if a.tie_word_embeddings {
        w.discard(|n| n == "lm_head.weight");
    }
    qwen3_5::hf_conv_and_norms(w, true)
}

/// What `engine convert` does to a qwen3_next checkpoint's tensors: the loader's sanitize,
/// and — on Hugging Face's per-expert layout, as mlx-lm's sanitize does — each sparse
/// block's experts stacked under `switch_mlp` (the loader stacks them as it builds).
pub(crate) fn convert_sanitize(config: &ModelConfig, w: &mut Weights) -> Result<(), LoadError> {
    let a: Qwen3NextArgs = config.parse()?;
    sanitize(w, &a)?;
    for l in 0..a.num_hidden_layers {
        let mlp = format!("model.layers.{l}.mlp");
        for n in ["up_proj", "down_proj", "gate_proj"] {
            if let Some(stacked) = stack_experts(w, &mlp, n, a.num_experts, None)? {
                w.insert(format!("{mlp}.switch_mlp.{n}.weight"), stacked);
            }
        }
    }
    Ok(())
}

pub fn load(config: &ModelConfig, mut w: Weights) -> Result<super::decoder::Decoder, LoadError> {
    let a: Qwen3NextArgs = config.parse()?;
    sanitize(&mut w, &a)?;
    qwen3_5::build(config, w, &a.as_qwen3_5(), GdnLayout::Fused, |i| {
        a.sparse(i)
    })
}
