//! DeepSeek-V3's, Nemotron 3's and GLM-4.5's `group_expert_select` (the router kind
//! `Router::SigmoidGroupedTopK`), compiled per set of constants as mlx-lm compiles it.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{topk_axis, Ellipsis, IndexOp};
use mlx_rs::ops::{argpartition_axis, sigmoid, unflatten};
use mlx_rs::Array;

use crate::plant::{self, Defect};

type R<T> = Result<T, Exception>;

/// `group_expert_select`, compiled as mlx-lm compiles it (`@mx.compile`, its Python scalars
/// constants of the trace):
///
///   s     = σ(logits in float32)
///   pick  = s + bias                         (`e_score_correction_bias`: the choice only)
///   n_group > 1: pick split into n_group groups, each ranked by the sum of its top two;
///                the n_group − topk_group lowest (`argpartition(g, k−1, axis=−2)[..., :k, :]`)
///                zeroed (`put_along_axis`)
///   inds  = argpartition(−pick, k−1)[..., :k]
///   w     = s[inds]  (/ their sum (+ 1e-20 where the family adds it: Nemotron 3's and
///                     GLM-4.7-Flash's copies; GLM-4.5's and DeepSeek-V3's divide by the bare
///                     sum) when norm_topk_prob and k > 1)
///   w     = w · routed_scaling_factor
pub struct GroupedTopK {
    /// `e_score_correction_bias` [experts] (float32, as checkpoints keep it).
    pub bias: Array,
    pub n_group: i32,
    pub topk_group: i32,
    pub norm_topk_prob: bool,
    /// Nemotron 3 adds 1e-20 to the sum it renormalizes by; glm4_moe does not.
    pub denominator_eps: bool,
    /// A Python float: weak against the float32 scores.
    pub routed_scaling_factor: f64,
}

/// What a `group_expert_select` trace is specialized on (mlx-lm's compile constants), and
/// whether the planted defect was on when it was traced.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct SelectKey {
    top_k: i32,
    n_group: i32,
    topk_group: i32,
    norm_topk_prob: bool,
    denominator_eps: bool,
    scaling_bits: u64,
    planted: bool,
}

thread_local! {
    /// One compiled `group_expert_select` per set of constants, kept for the thread's life
    /// (MLX work stays on one thread), as `mx.compile` keeps one trace per constant set.
    static GROUP_SELECT: std::cell::RefCell<
        std::collections::HashMap<SelectKey, crate::model::layers::CompiledFn>,
    > = Default::default();
}

impl GroupedTopK {
    /// logits [B, L, experts] → (indices [B, L, k] uint32, weights [B, L, k] float32).
    pub(super) fn select(&self, logits: &Array, top_k: i32) -> R<(Array, Array)> {
        let key = SelectKey {
            top_k,
            n_group: self.n_group,
            topk_group: self.topk_group,
            norm_topk_prob: self.norm_topk_prob,
            denominator_eps: self.denominator_eps,
            scaling_bits: self.routed_scaling_factor.to_bits(),
            planted: plant::is(Defect::MoeCorrectionBiasWeighted),
        };
        let mut out = GROUP_SELECT.with_borrow_mut(|traces| {
            let f = traces.entry(key).or_insert_with(|| {
                let f = move |args: &[Array]| group_expert_select(args, key);
                let mut compiled = mlx_rs::transforms::compile::compile(f, false);
                let f: crate::model::layers::CompiledFn =
                    Box::new(move |args: &[Array]| compiled(args));
                f
            });
            f(&[logits.clone(), self.bias.clone()])
        })?;
        let scores = out
            .pop()
            .ok_or_else(|| Exception::custom("no routing weights"))?;
        let inds = out
            .pop()
            .ok_or_else(|| Exception::custom("no routing indices"))?;
        Ok((inds, scores))
    }
}

/// The traced body of `group_expert_select` (see [`GroupedTopK`]): args [gates, bias].
fn group_expert_select(args: &[Array], c: SelectKey) -> R<Vec<Array>> {
    let (gates, bias) = (&args[0], &args[1]);
    let orig_scores = sigmoid(gates.as_dtype(mlx_rs::Dtype::Float32)?)?;
    let mut scores = orig_scores.add(bias)?;
    if c.n_group > 1 {
        scores = unflatten(&scores, -1, &[c.n_group, -1])?;
        let group_scores = topk_axis(&scores, 2, -1)?.sum_axis(-1, true)?;
        let k = c.n_group - c.topk_group;
        let group_idx = argpartition_axis(&group_scores, k - 1, -2)?;
        let group_idx = group_idx.index((Ellipsis, ..k, ..));
        let zero = Array::from_f32(0.0);
        scores = scores.put_along_axis(mlx_rs::stop_gradient(&group_idx)?, &zero, -2)?;
        scores = scores.flatten(-2, -1)?;
    }
    let k = c.top_k;
    let inds = argpartition_axis(scores.negative()?, k - 1, -1)?.index((Ellipsis, ..k));
    let inds = mlx_rs::stop_gradient(&inds)?;
    // Planted: the weights read from the biased scores the experts were picked by.
    let weighed = if c.planted { &scores } else { &orig_scores };
    let mut scores = weighed.take_along_axis(&inds, -1)?;
    if k > 1 && c.norm_topk_prob {
        let mut denominator = scores.sum_axis(-1, true)?;
        if c.denominator_eps {
            denominator = denominator.add(crate::scalar::weak(1e-20, &denominator)?)?;
        }
        scores = scores.divide(denominator)?;
    }
    let scaling = f64::from_bits(c.scaling_bits);
    let scores = scores.multiply(crate::scalar::weak(scaling, &scores)?)?;
    Ok(vec![inds, scores])
}
