//! Gemma 4's mixture-of-experts block (`enable_moe_block`, the 26B-A4B) as mlx-lm 0.32.2's
//! gemma4_text computes it. Every layer runs it beside the dense MLP, on the same input h
//! (the residual stream after attention):
//!
//!   route:    x̂ = rms_norm(h, scale · hidden^-½)      s = proj(x̂)           (all experts)
//!             inds = argpartition(s, -k)[..., -k:]      (the top k, in argpartition's order)
//!             w = softmax(s[inds]) · per_expert_scale[inds]
//!   experts:  y = Σ_k w_k · down_e(geglu(gate_e(x), up_e(x)))   x = pre_ffw_norm_2(h),
//!             e = inds_k, through SwitchGLU (moe.rs: gather_mm / gather_qmm, sorted from 64
//!             routing entries on)
//!   block:    post_ffw_norm_1(mlp) + post_ffw_norm_2(y)   (then the layer's post_ffw_norm)
//!
//! Hugging Face checkpoints store a layer's experts fused: `experts.gate_up_proj`
//! [E, 2·I, D] and `experts.down_proj` [E, D, I]; mlx-lm's sanitize splits gate_up in two
//! along axis -2 (gate first) into `experts.switch_glu.{gate,up,down}_proj`, the names MLX
//! checkpoints (quantized ones included) carry.

use mlx_rs::error::Exception;
use mlx_rs::fast;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::ops::{argpartition_axis, softmax_axis};
use mlx_rs::Array;

use super::args::Gemma4Args;
use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::model::layers::{geglu, weak, Linear, RmsNorm};
use crate::model::moe::{dense_experts, SwitchGlu, SwitchLinear};
use crate::plant::{self, Defect};

type R<T> = Result<T, Exception>;

/// `Router`: norm → scale → project → top k → softmax over the k → per-expert scale.
struct Router {
    proj: Linear,
    scale: Array,
    per_expert_scale: Array,
    top_k: i32,
    hidden: i32,
    eps: f32,
}

impl Router {
    /// h [B, L, D] → (expert indices [B, L, k], their weights [B, L, k]).
    fn route(&self, h: &Array) -> R<(Array, Array)> {
        let k = self.top_k;
        let root = (self.hidden as f64).powf(-0.5);
        let scale = self.scale.multiply(weak(root, &self.scale)?)?;
        let x = fast::rms_norm(h, Some(&scale), self.eps)?;
        let scores = self.proj.forward(&x)?;
        let n = *scores.shape().last().unwrap_or(&0);
        let part = argpartition_axis(&scores, -k, -1)?;
        let inds = mlx_rs::stop_gradient(part.index((Ellipsis, (n - k)..n)))?;
        let weights = softmax_axis(scores.take_along_axis(&inds, -1)?, -1, false)?;
        if plant::is(Defect::Gemma4PerExpertScaleDropped) {
            return Ok((inds, weights));
        }
        let weights = weights.multiply(self.per_expert_scale.take_axis(&inds, 0)?)?;
        Ok((inds, weights))
    }
}

/// The experts and their norms beside a layer's dense MLP.
pub struct MoeBlock {
    router: Router,
    experts: SwitchGlu,
    post_ffw_norm_1: RmsNorm,
    pre_ffw_norm_2: RmsNorm,
    post_ffw_norm_2: RmsNorm,
}

impl MoeBlock {
    /// The feed-forward output before the layer's `post_feedforward_layernorm`: the dense
    /// MLP's `mlp` (of `pre_feedforward_layernorm(h)`) and the experts', each normed.
    pub fn forward(&self, h: &Array, mlp: &Array) -> R<Array> {
        let dense = self.post_ffw_norm_1.forward(mlp)?;
        let (inds, weights) = self.router.route(h)?;
        let x = self.pre_ffw_norm_2.forward(h)?;
        let y = self.experts.forward_with(&x, &inds, geglu)?;
        let y = weights.expand_dims(-1)?.multiply(&y)?.sum_axis(-2, false)?;
        dense.add(&self.post_ffw_norm_2.forward(&y)?)
    }

    /// Layer `p`'s (`model.layers.{i}`) router, experts and MoE norms; None without
    /// `enable_moe_block`.
    pub fn load(w: &mut Weights, p: &str, a: &Gemma4Args) -> Result<Option<Self>, LoadError> {
        if !a.enable_moe_block {
            return Ok(None);
        }
        let (experts, top_k, inter) = moe_shape(a)?;
        let (eps, h) = (a.rms_norm_eps, a.hidden_size);
        let norm = |w: &mut Weights, name: &str| RmsNorm::load(w, &format!("{p}.{name}"), h, eps);
        let router = Router {
            proj: Linear::load(w, &format!("{p}.router.proj"), false, [experts, h])?,
            scale: w.take_shaped(&format!("{p}.router.scale"), &[h])?,
            per_expert_scale: w.take_shaped(&format!("{p}.router.per_expert_scale"), &[experts])?,
            top_k,
            hidden: a.hidden_size,
            eps,
        };
        Ok(Some(MoeBlock {
            router,
            experts: load_experts(w, &format!("{p}.experts"), a.hidden_size, (experts, inter))?,
            post_ffw_norm_1: norm(w, "post_feedforward_layernorm_1")?,
            pre_ffw_norm_2: norm(w, "pre_feedforward_layernorm_2")?,
            post_ffw_norm_2: norm(w, "post_feedforward_layernorm_2")?,
        }))
    }
}

/// (num_experts, top_k_experts, moe_intermediate_size), which `enable_moe_block` needs.
fn moe_shape(a: &Gemma4Args) -> Result<(i32, i32, i32), LoadError> {
    let (Some(experts), Some(top_k), Some(inter)) =
        (a.num_experts, a.top_k_experts, a.moe_intermediate_size)
    else {
        return Err(LoadError::Unsupported(
            "gemma4_text with `enable_moe_block` needs `num_experts`, `top_k_experts` and \
             `moe_intermediate_size` (mlx-lm has no defaults for them)"
                .into(),
        ));
    };
    if top_k <= 0 || top_k > experts {
        return Err(LoadError::Unsupported(format!(
            "gemma4_text: top_k_experts {top_k} must be in 1..={experts} (num_experts)"
        )));
    }
    Ok((experts, top_k, inter))
}

/// The experts under `prefix` (`model.layers.{i}.experts`): Hugging Face's fused tensors
/// split as mlx-lm's sanitize splits them, or MLX's `switch_glu.*` (dense or quantized).
fn load_experts(
    w: &mut Weights,
    prefix: &str,
    hidden: i32,
    (experts, inter): (i32, i32),
) -> Result<SwitchGlu, LoadError> {
    let fused = format!("{prefix}.gate_up_proj");
    if !w.contains(&fused) {
        let mut proj = |name: &str, shape: [i32; 3]| {
            SwitchLinear::load(w, &format!("{prefix}.switch_glu.{name}"), false, shape)
        };
        return Ok(SwitchGlu {
            gate_proj: proj("gate_proj", [experts, inter, hidden])?,
            up_proj: proj("up_proj", [experts, inter, hidden])?,
            down_proj: proj("down_proj", [experts, hidden, inter])?,
        });
    }
    let down_name = format!("{prefix}.down_proj");
    let gate_up = w.take_shaped(&fused, &[experts, 2 * inter, hidden])?;
    let down = w.take_shaped(&down_name, &[experts, hidden, inter])?;
    let halves = gate_up
        .split_equal(2, -2)
        .and_then(|h| h.iter().map(|a| a.contiguous()).collect::<R<Vec<_>>>())
        .map_err(|e| LoadError::Weights(e.what().to_owned()))?;
    let [gate, up]: [Array; 2] = halves
        .try_into()
        .map_err(|_| LoadError::Weights(format!("`{fused}` did not split in two")))?;
    Ok(SwitchGlu {
        gate_proj: dense_experts(&fused, gate)?,
        up_proj: dense_experts(&fused, up)?,
        down_proj: dense_experts(&down_name, down)?,
    })
}
