//! `glm4_moe` as mlx-lm 0.32.2 implements it (GLM-4.5 / 4.6 / 4.7, `glm4_moe.py`):
//!
//!   attn  = GQA, q/k/v biases with `attention_bias` (o never), per-head q/k RMSNorm before
//!           the head transpose with `use_qk_norm`, `nn.RoPE` over the first
//!           int(head_dim · partial_rotary_factor) dims from `rope_theta` (no scaling)
//!   mlp   = SwiGLU of `intermediate_size` for the first `first_k_dense_replace` layers, then
//!           the sparse block:
//!             inds, w = group_expert_select(x @ gate.T)   (moe.rs's `GroupedTopK`: σ scores in
//!                       float32, `e_score_correction_bias` for the choice only, groups ranked
//!                       by their top two with the lowest n_group − topk_group zeroed, the top
//!                       k renormalized by their bare sum with `norm_topk_prob`,
//!                       × routed_scaling_factor)
//!             y = Σ_k w_k · SwitchGLU_e(x)  (in y's dtype)  + shared_experts(x)
//!           where `shared_experts` is a plain SwiGLU of moe_intermediate_size · n_shared_experts
//!   logits = lm_head(rms_norm(h))   (always its own head: `tie_word_embeddings` is not read)
//!
//! mlx-lm's `sanitize`: per-expert tensors stacked into `switch_mlp`, and the multi-token
//! prediction layer (`model.layers.{num_hidden_layers}.…`) dropped.

use serde::Deserialize;

use super::decoder::{Decoder, Dims, Mixer};
use super::layers::{Glu, Linear, Mlp, Rope};
use super::moe::{Gate, GroupedTopK, MoeDims, Router, SwitchGlu, EXPERT_NAMES};
use super::moe_family::{check_top_k, load_attention, AttnShape, Ffn, PlusShared};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;

/// mlx-lm's `glm4_moe.ModelArgs` (the fields it reads).
#[derive(Debug, Clone, Deserialize)]
pub struct Glm4MoeArgs {
    pub vocab_size: i32,
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub moe_intermediate_size: i32,
    pub norm_topk_prob: bool,
    pub num_attention_heads: i32,
    pub n_group: i32,
    pub head_dim: i32,
    pub topk_group: i32,
    pub n_shared_experts: Option<i32>,
    pub n_routed_experts: Option<i32>,
    pub routed_scaling_factor: f64,
    pub num_experts_per_tok: i32,
    pub first_k_dense_replace: i32,
    pub num_hidden_layers: i32,
    pub num_key_value_heads: i32,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<serde_json::Value>,
    pub use_qk_norm: bool,
    pub attention_bias: bool,
    pub partial_rotary_factor: f64,
    #[serde(default = "noaux_tc")]
    pub topk_method: String,
}

fn noaux_tc() -> String {
    "noaux_tc".into()
}

impl Glm4MoeArgs {
    /// What mlx-lm asserts or would silently get wrong, refused before any weight is read.
    fn check(&self) -> Result<(), LoadError> {
        let refuse = |m: String| Err(LoadError::Unsupported(format!("glm4_moe: {m}")));
        if self.topk_method != "noaux_tc" {
            return refuse(format!(
                "topk_method `{}`; mlx-lm's MoEGate supports only noaux_tc",
                self.topk_method
            ));
        }
        if let Some(v) = self.rope_scaling.as_ref().filter(|v| !v.is_null()) {
            let kind = v.get("rope_type").or_else(|| v.get("type"));
            if kind.and_then(|k| k.as_str()).unwrap_or("default") != "default" {
                return refuse(format!(
                    "rope_scaling {v}: mlx-lm's glm4_moe applies plain RoPE from rope_theta, so \
                     a scaled config is refused rather than run unscaled"
                ));
            }
        }
        if let Some(experts) = self.n_routed_experts {
            check_top_k(
                "glm4_moe",
                self.num_experts_per_tok,
                experts,
                "n_routed_experts",
            )?;
            // n_group 1 skips the grouping (topk_group unread), as mlx-lm does.
            let groups_ok = self.n_group == 1
                || (self.n_group > 1
                    && experts % self.n_group == 0
                    && experts / self.n_group >= 2
                    && (1..=self.n_group).contains(&self.topk_group));
            if !groups_ok {
                return refuse(format!(
                    "{experts} experts in n_group {} (topk_group {}): the groups must split the \
                     experts evenly, at least two to a group, and keep 1..=n_group of them (or n_group 1)",
                    self.n_group, self.topk_group
                ));
            }
        }
        Ok(())
    }
}

/// mlx-lm's sanitize: the MTP layer dropped (the experts are stacked as each block loads).
fn sanitize(a: &Glm4MoeArgs, w: &mut Weights) {
    let mtp = format!("model.layers.{}", a.num_hidden_layers);
    w.discard(|n| n.starts_with(&mtp));
}

/// Layer `i`'s feed-forward under `<p>.mlp`.
fn load_ffn(w: &mut Weights, p: &str, a: &Glm4MoeArgs, i: i32) -> Result<Ffn, LoadError> {
    let mlp = format!("{p}.mlp");
    let h = a.hidden_size;
    let experts = match a.n_routed_experts {
        Some(e) if i >= a.first_k_dense_replace => e,
        _ => {
            let dense = Mlp::load(w, &mlp, false, h, a.intermediate_size, Glu::Swiglu)?;
            return Ok(Ffn::Dense(dense));
        }
    };
    let d = MoeDims {
        hidden: h,
        intermediate: a.moe_intermediate_size,
        experts,
        top_k: a.num_experts_per_tok,
    };
    // MoEGate is a plain module (`weight`, `e_score_correction_bias`), never an nn.Linear:
    // a dense `x @ weight.T`, left unquantized by mlx-lm.
    let router = Gate {
        gate: Linear {
            weight: w.take_shaped(&format!("{mlp}.gate.weight"), &[experts, h])?,
            bias: None,
            quantized: None,
            lora: Default::default(),
            reduce: false,
        },
        top_k: d.top_k,
        kind: Router::SigmoidGroupedTopK(GroupedTopK {
            bias: w.take_shaped(&format!("{mlp}.gate.e_score_correction_bias"), &[experts])?,
            n_group: a.n_group,
            topk_group: a.topk_group,
            norm_topk_prob: a.norm_topk_prob,
            denominator_eps: false,
            routed_scaling_factor: a.routed_scaling_factor,
        }),
    };
    let experts = SwitchGlu::load(w, &mlp, (h, d.intermediate), experts, EXPERT_NAMES)?;
    let shared = match a.n_shared_experts {
        Some(n) => Some(Mlp::load(
            w,
            &format!("{mlp}.shared_experts"),
            false,
            h,
            a.moe_intermediate_size * n,
            Glu::Swiglu,
        )?),
        None => None,
    };
    Ok(Ffn::PlusShared(Box::new(PlusShared {
        router,
        experts,
        shared,
        linear_router: false,
    })))
}

pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Decoder, LoadError> {
    let a: Glm4MoeArgs = config.parse()?;
    a.check()?;
    sanitize(&a, &mut w);
    let attn = AttnShape {
        hidden: a.hidden_size,
        heads: a.num_attention_heads,
        kv_heads: a.num_key_value_heads,
        head_dim: a.head_dim,
        qkv_bias: a.attention_bias,
        qk_norm_eps: a.use_qk_norm.then_some(a.rms_norm_eps),
        rope_traditional: false,
        rope_base: a.rope_theta,
    };
    // Python's int(head_dim * partial_rotary_factor), in double precision.
    let rotated = (f64::from(a.head_dim) * a.partial_rotary_factor) as i32;
    let dims = Dims {
        layers: a.num_hidden_layers,
        hidden: a.hidden_size,
        vocab: a.vocab_size,
        rms_norm_eps: a.rms_norm_eps,
        tie_word_embeddings: false,
        ffn_module: "mlp",
    };
    Decoder::load(config, w, dims, |w, p, i| {
        let mut attention = load_attention(w, p, &attn)?;
        attention.rope = Rope::Standard {
            dims: rotated,
            traditional: false,
            base: a.rope_theta,
            scale: 1.0,
        };
        let mixer: Box<dyn Mixer> = Box::new(attention);
        Ok((mixer, Box::new(load_ffn(w, p, &a, i)?)))
    })
}
