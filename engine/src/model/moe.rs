//! Mixture of experts as mlx-lm 0.32.2 computes it (`switch_layers.py` and the routers of
//! its MoE families):
//!
//!   probs = softmax(gate(x))                         (precise, in x's dtype)
//!   inds  = argpartition(probs, -k)[..., -k:]        (the top k, in argpartition's order)
//!   w     = probs[inds]  (/ their sum with norm_topk_prob)
//!   y     = Σ_k w_k · down_e(swiglu(gate_e(x), up_e(x)))   e = inds_k, via gather_mm
//!
//! The other routers (`Router`) differ in where the softmax sits and which end of the
//! partition they keep; DeepSeek-V3's and Nemotron 3's `group_expert_select` scores by
//! sigmoid, picks with a correction bias (in groups) and scales (`GroupedTopK`). `SwitchMLP`
//! (`SwitchMlp`: fc2(act(fc1(x))), Nemotron 3's relu² experts) shares SwitchGLU's dispatch.
//! The experts' weights are stacked, [experts, out, in] (`SwitchLinear`), dense through
//! `gather_mm` or quantized in any of MLX's modes through `gather_qmm`
//! (`QuantizedSwitchLinear`). With 64 or more routing entries (B·L·k) the tokens are sorted
//! by expert first and unsorted after (`_gather_sort` / `_scatter_unsort`), as mlx-lm does.

mod grouped;
pub mod lora;
mod shard;

pub use grouped::GroupedTopK;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::ops::{
    argpartition_axis, argsort_axis, gather_mm, sigmoid, softmax_axis, stack, unflatten,
};
use mlx_rs::Array;

use super::layers::{swiglu, Linear, Quantized};
use super::quantized;
use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::plant::{self, Defect};

type R<T> = Result<T, Exception>;

/// Per-expert tensor names (gate, up, down) of Hugging Face MoE checkpoints.
pub const EXPERT_NAMES: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];
pub const MIXTRAL_EXPERT_NAMES: [&str; 3] = ["w1", "w3", "w2"];

/// mlx-lm's `SwitchGLU` sorts the tokens by expert from this many routing entries on.
pub const SORT_THRESHOLD: usize = 64;

/// `SwitchLinear` / `QuantizedSwitchLinear`: one linear per expert, stacked.
pub struct SwitchLinear {
    /// [experts, out, in] dense, or packed [experts, out, in·bits/32].
    pub weight: Array,
    pub bias: Option<Array>,
    pub quantized: Option<Quantized>,
    /// A LoRA adapter per expert, when attached (`moe/lora.rs`).
    pub lora: std::cell::RefCell<Option<super::layers::Lora>>,
    /// Tensor parallel (`moe/shard.rs`): narrowed to this rank's slice of the inputs, so its
    /// outputs are partial sums the owning block sums over the ranks after combining.
    pub partial_sums: bool,
}

impl SwitchLinear {
    /// `<prefix>.weight` (and its scales/biases when quantized), which config.json makes
    /// `[experts, out, in]`; its bias `[experts, out]`.
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        bias: bool,
        shape: [i32; 3],
    ) -> Result<Self, LoadError> {
        let (weight, quantized) = Quantized::load_weight(w, prefix, &shape)?;
        if quantized.is_none() {
            check_dense_dtype(&format!("{prefix}.weight"), &weight)?;
        }
        let bias = if bias {
            Some(w.take_shaped(&format!("{prefix}.bias"), &shape[..2])?)
        } else {
            None
        };
        Ok(SwitchLinear {
            weight,
            bias,
            quantized,
            lora: Default::default(),
            partial_sums: false,
        })
    }

    /// x [..., 1, in] through expert `indices` (broadcast against x's batch dims).
    pub fn forward(&self, x: &Array, indices: &Array, sorted: bool) -> R<Array> {
        let y = match &self.quantized {
            None => gather_mm(x, self.weight.swap_axes(-1, -2)?, None, indices, sorted)?,
            Some(q) => quantized::ops::gather_qmm(
                x,
                &self.weight,
                &q.scales,
                q.biases.as_ref(),
                indices,
                true,
                q.params,
                sorted,
            )?,
        };
        let y = match &self.bias {
            None => y,
            Some(b) => y.add(b.take_axis(indices, 0)?.expand_dims(-2)?)?,
        };
        match &*self.lora.borrow() {
            None => Ok(y),
            Some(l) => lora::add_update(l, &y, x, indices, sorted),
        }
    }
}

/// `SwitchGLU`: down(swiglu(gate(x), up(x))) with each token's k experts.
pub struct SwitchGlu {
    pub gate_proj: SwitchLinear,
    pub up_proj: SwitchLinear,
    pub down_proj: SwitchLinear,
}

impl SwitchGlu {
    /// The experts under `mlp` (`<mlp>.switch_mlp.{gate,up,down}_proj`), or — mlx-lm's
    /// `sanitize` of a Hugging Face checkpoint — `<mlp>.experts.{e}.<hf name>` stacked into
    /// them; `hf_names` are the per-expert names of gate, up and down
    /// (`EXPERT_NAMES` for Qwen, `MIXTRAL_EXPERT_NAMES`).
    pub fn load(
        w: &mut Weights,
        mlp: &str,
        dims: (i32, i32),
        experts: i32,
        hf_names: [&str; 3],
    ) -> Result<Self, LoadError> {
        let (hidden, intermediate) = dims;
        let mut proj = |n: &str, hf: &str, [out, inp]: [i32; 2]| match stacked_experts(
            w,
            mlp,
            hf,
            [experts, out, inp],
        )? {
            Some(l) => Ok::<_, LoadError>(l),
            None => SwitchLinear::load(
                w,
                &format!("{mlp}.switch_mlp.{n}"),
                false,
                [experts, out, inp],
            ),
        };
        let [gate, up, down] = hf_names;
        Ok(SwitchGlu {
            gate_proj: proj("gate_proj", gate, [intermediate, hidden])?,
            up_proj: proj("up_proj", up, [intermediate, hidden])?,
            down_proj: proj("down_proj", down, [hidden, intermediate])?,
        })
    }

    /// Its three stacks under `<prefix>.{gate,up,down}_proj`, as LoRA and quantization name
    /// them.
    pub fn named(&self, prefix: &str) -> Vec<(String, &SwitchLinear)> {
        [
            ("gate_proj", &self.gate_proj),
            ("up_proj", &self.up_proj),
            ("down_proj", &self.down_proj),
        ]
        .map(|(n, l)| (format!("{prefix}.{n}"), l))
        .into()
    }

    /// x [B, L, D], indices [B, L, k] → [B, L, k, D].
    pub fn forward(&self, x: &Array, indices: &Array) -> R<Array> {
        self.forward_with(x, indices, swiglu)
    }

    /// As [`Self::forward`] with another activation `act(gate, up)` in place of swiglu
    /// (Gemma 4's experts: `geglu`).
    pub fn forward_with(
        &self,
        x: &Array,
        indices: &Array,
        act: impl Fn(&Array, &Array) -> R<Array>,
    ) -> R<Array> {
        dispatch(x, indices, |x, idx, sorted| {
            let up = self.up_proj.forward(x, idx, sorted)?;
            let gate = self.gate_proj.forward(x, idx, sorted)?;
            self.down_proj.forward(&act(&gate, &up)?, idx, sorted)
        })
    }
}

/// `SwitchMLP`: fc2(act(fc1(x))) with each token's k experts, no gate projection (Nemotron
/// 3's experts, `act` relu²).
pub struct SwitchMlp {
    pub fc1: SwitchLinear,
    pub fc2: SwitchLinear,
}

impl SwitchMlp {
    /// `<mlp>.switch_mlp.fc1` [experts, hidden, input] and `fc2` [experts, input, hidden]
    /// (a family's sanitize stacks a per-expert checkpoint into them first, as mlx-lm's
    /// does).
    pub fn load(
        w: &mut Weights,
        mlp: &str,
        (input, hidden): (i32, i32),
        experts: i32,
    ) -> Result<Self, LoadError> {
        let fc = |w: &mut Weights, n: &str, out_in: [i32; 2]| {
            let shape = [experts, out_in[0], out_in[1]];
            SwitchLinear::load(w, &format!("{mlp}.switch_mlp.{n}"), false, shape)
        };
        Ok(SwitchMlp {
            fc1: fc(w, "fc1", [hidden, input])?,
            fc2: fc(w, "fc2", [input, hidden])?,
        })
    }

    /// x [B, L, D], indices [B, L, k] → [B, L, k, D].
    pub fn forward_with(
        &self,
        x: &Array,
        indices: &Array,
        act: impl Fn(&Array) -> R<Array>,
    ) -> R<Array> {
        dispatch(x, indices, |x, idx, sorted| {
            let h = self.fc1.forward(x, idx, sorted)?;
            self.fc2.forward(&act(&h)?, idx, sorted)
        })
    }
}

/// What `SwitchGLU` and `SwitchMLP` do around their experts: x [B, L, D] given its two unit
/// axes, the indices' gradient stopped (they are integers), the (token, slot) rows sorted by
/// expert from [`SORT_THRESHOLD`] routing entries on (`_gather_sort`) and unsorted after
/// (`_scatter_unsort`); `experts(x, indices, sorted)` runs the stacks in between.
fn dispatch(
    x: &Array,
    indices: &Array,
    experts: impl FnOnce(&Array, &Array, bool) -> R<Array>,
) -> R<Array> {
    let x = x.expand_dims_axes(&[-2, -3])?;
    let indices = &mlx_rs::stop_gradient(indices)?;
    let do_sort = indices.size() >= SORT_THRESHOLD;
    let (x, idx, inv_order) = if do_sort {
        let (x, idx, inv) = gather_sort(&x, indices)?;
        (x, idx, Some(inv))
    } else {
        (x, indices.clone(), None)
    };
    let x = experts(&x, &idx, do_sort)?;
    let x = match inv_order {
        Some(inv) => unflatten(x.take_axis(&inv, 0)?, 0, indices.shape())?,
        None => x,
    };
    x.squeeze_axes(&[-2])
}

/// mlx-lm's `_gather_sort`: the (token, slot) rows ordered by expert, the sorted experts
/// and the inverse order.
fn gather_sort(x: &Array, indices: &Array) -> R<(Array, Array, Array)> {
    let m = *indices.shape().last().unwrap_or(&1);
    let flat = indices.flatten(None, None)?;
    let order = argsort_axis(&flat, -1)?;
    let inv_order = argsort_axis(&order, -1)?;
    let rows = order.floor_divide(Array::from_int(m).as_dtype(order.dtype())?)?;
    let x = x.flatten(0, -3)?.take_axis(&rows, 0)?;
    Ok((x, flat.take_axis(&order, 0)?, inv_order))
}

/// `<mlp>.experts.{e}.<hf>.weight` (a Hugging Face checkpoint, each `[out, in]` of
/// `[experts, out, in]`) stacked into one dense `SwitchLinear`, as mlx-lm's `sanitize`
/// stacks them; None when the checkpoint has them stacked already (`<mlp>.switch_mlp.<name>`).
fn stacked_experts(
    w: &mut Weights,
    mlp: &str,
    hf: &str,
    [experts, out, inp]: [i32; 3],
) -> Result<Option<SwitchLinear>, LoadError> {
    let Some(weight) = stack_experts(w, mlp, hf, experts, Some([out, inp]))? else {
        return Ok(None);
    };
    Ok(Some(SwitchLinear {
        weight,
        bias: None,
        quantized: None,
        lora: Default::default(),
        partial_sums: false,
    }))
}

/// mlx-lm's sanitize of Hugging Face's per-expert tensors: `<mlp>.experts.{e}.<hf>.weight`
/// for e in 0..experts taken (each of `shape` when given) and stacked into
/// `[experts, out, in]`; None when the checkpoint has no `<mlp>.experts.0.<hf>.weight`.
pub(crate) fn stack_experts(
    w: &mut Weights,
    mlp: &str,
    hf: &str,
    experts: i32,
    shape: Option<[i32; 2]>,
) -> Result<Option<Array>, LoadError> {
    if !w.contains(&format!("{mlp}.experts.0.{hf}.weight")) {
        return Ok(None);
    }
    let parts = (0..experts)
        .map(|e| {
            let name = format!("{mlp}.experts.{e}.{hf}.weight");
            match shape {
                Some(shape) => w.take_shaped(&name, &shape),
                None => w.take(&name),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    let weight = stack(&parts, 0).map_err(|e| LoadError::Weights(e.what().to_owned()))?;
    Ok(Some(weight))
}

/// A checkpoint's fused expert stacks as the SwitchGLU's: `fused` [E, 2·I, D] split along
/// its middle axis (gate first) into `<mlp>.switch_mlp.{gate,up}_proj.weight`, and `down`
/// as `<mlp>.switch_mlp.down_proj.weight` (the sanitizes of qwen3_5_moe and
/// granitemoehybrid).
pub fn unfuse_experts(
    w: &mut Weights,
    mlp: &str,
    fused: &str,
    down: &str,
) -> Result<(), LoadError> {
    let gate_up = w.take(fused)?;
    let mid = gate_up.shape()[1] / 2;
    let halves = gate_up
        .split_at_indices(&[mid], 1)
        .map_err(|e| LoadError::Weights(format!("`{fused}`: {e}")))?;
    let out = |n: &str| format!("{mlp}.switch_mlp.{n}.weight");
    w.insert(out("gate_proj"), halves[0].clone());
    w.insert(out("up_proj"), halves[1].clone());
    let down = w.take(down)?;
    w.insert(out("down_proj"), down);
    Ok(())
}

/// A sparse block's sizes: `experts` of width `intermediate` over `hidden`, `top_k` a token.
#[derive(Debug, Clone, Copy)]
pub struct MoeDims {
    pub hidden: i32,
    pub intermediate: i32,
    pub experts: i32,
    pub top_k: i32,
}

/// A dense, bias-free stack of experts [experts, out, in] that a family's sanitize made from
/// the checkpoint's `name` (Gemma 4 splits its fused `experts.gate_up_proj`), refused on the
/// CPU unless float32 as [`SwitchLinear::load`] refuses it.
pub fn dense_experts(name: &str, weight: Array) -> Result<SwitchLinear, LoadError> {
    if weight.ndim() != 3 {
        return Err(LoadError::Weights(format!(
            "`{name}` has shape {:?}; stacked experts are [num_experts, out, in]",
            weight.shape()
        )));
    }
    check_dense_dtype(name, &weight)?;
    Ok(SwitchLinear {
        weight,
        bias: None,
        quantized: None,
        lora: Default::default(),
        partial_sums: false,
    })
}

/// MLX's CPU `gather_mm` (dense experts) runs float32 only — in mlx-lm as here — so a
/// dense expert stack of another dtype is refused at load rather than failing every forward.
fn check_dense_dtype(name: &str, weight: &Array) -> Result<(), LoadError> {
    if weight.dtype() != mlx_rs::Dtype::Float32
        && crate::runtime::default_device().starts_with("cpu")
    {
        return Err(LoadError::Unsupported(format!(
            "`{name}` is {:?}: MLX's CPU gather_mm (dense experts) runs float32 only, in \
             mlx-lm as here; on the CPU use float32 or quantized experts",
            weight.dtype()
        )));
    }
    Ok(())
}

/// How a router picks each token's k experts and weighs them.
pub enum Router {
    /// Qwen3-MoE: `softmax` over all experts, the top k by `argpartition(p, -k)[..., -k:]`,
    /// their probabilities renormalized when `norm_topk_prob`.
    SoftmaxTopK { norm_topk_prob: bool },
    /// Qwen2-MoE: `softmax` over all experts, the top k by `argpartition(-p, k-1)[..., :k]`,
    /// their probabilities as they are.
    SoftmaxLowTopK,
    /// Mixtral: the top k logits by `argpartition(-g, k-1)[..., :k]`, then `softmax` over
    /// those k.
    TopKSoftmax,
    /// Granite 4: the top k logits by `argpartition(g, -k)[..., -k:]`, then `softmax` over
    /// those k.
    HighTopKSoftmax,
    /// DeepSeek-V3's and Nemotron 3's `group_expert_select` (see [`GroupedTopK`]).
    SigmoidGroupedTopK(GroupedTopK),
    /// ERNIE 4.5: softmax (or sigmoid) over the float32 logits, the top k by
    /// `argpartition(-p, k-1)[..., :k]`, renormalized by `maximum(their sum, 1e-12)`.
    ActTopKRenormalized { sigmoid: bool },
}

/// A router: the `gate` linear scores every expert, `kind` picks `top_k` of them.
pub struct Gate {
    pub gate: Linear,
    pub top_k: i32,
    pub kind: Router,
}

impl Gate {
    /// x [B, L, D] → (expert indices [B, L, k] uint32, their weights [B, L, k]).
    pub fn route(&self, x: &Array) -> R<(Array, Array)> {
        let k = self.top_k;
        let off = plant::is(Defect::MoeTopKOffByOne) as i32;
        let logits = self.gate.forward(x)?;
        match &self.kind {
            Router::SigmoidGroupedTopK(g) => g.select(&logits, k),
            &Router::ActTopKRenormalized {
                sigmoid: act_sigmoid,
            } => {
                let logits = logits.as_dtype(mlx_rs::Dtype::Float32)?;
                let gates = match act_sigmoid {
                    true => sigmoid(&logits)?,
                    false => softmax_axis(&logits, -1, false)?,
                };
                let part = argpartition_axis(gates.negative()?, k - 1, -1)?;
                let inds = mlx_rs::stop_gradient(part.index((Ellipsis, off..(k + off))))?;
                let scores = gates.take_along_axis(&inds, -1)?;
                let total = scores.sum_axis(-1, true)?;
                let floor = crate::scalar::weak(1e-12, &total)?;
                Ok((inds, scores.divide(mlx_rs::ops::maximum(&total, &floor)?)?))
            }
            &Router::SoftmaxTopK { norm_topk_prob } => {
                let gates = softmax_axis(&logits, -1, true)?;
                let n = *gates.shape().last().unwrap_or(&0);
                let part = argpartition_axis(&gates, -k, -1)?;
                let inds = mlx_rs::stop_gradient(part.index((Ellipsis, (n - k - off)..(n - off))))?;
                let scores = gates.take_along_axis(&inds, -1)?;
                let scores = if norm_topk_prob {
                    scores.divide(scores.sum_axis(-1, true)?)?
                } else {
                    scores
                };
                Ok((inds, scores))
            }
            Router::SoftmaxLowTopK => {
                let gates = softmax_axis(&logits, -1, true)?;
                let part = argpartition_axis(gates.negative()?, k - 1, -1)?;
                let inds = mlx_rs::stop_gradient(part.index((Ellipsis, off..(k + off))))?;
                let scores = gates.take_along_axis(&inds, -1)?;
                Ok((inds, scores))
            }
            Router::HighTopKSoftmax => {
                let n = *logits.shape().last().unwrap_or(&0);
                let part = argpartition_axis(&logits, -k, -1)?;
                let inds = mlx_rs::stop_gradient(part.index((Ellipsis, (n - k - off)..(n - off))))?;
                let scores = logits.take_along_axis(&inds, -1)?;
                Ok((inds, softmax_axis(&scores, -1, true)?))
            }
            Router::TopKSoftmax => {
                let part = argpartition_axis(logits.negative()?, k - 1, -1)?;
                let inds = mlx_rs::stop_gradient(part.index((Ellipsis, off..(k + off))))?;
                let scores = logits.take_along_axis(&inds, -1)?;
                Ok((inds, softmax_axis(&scores, -1, true)?))
            }
        }
    }
}

/// Σ_k scores_k · y_k over the k experts' outputs y [B, L, k, D], in y's dtype.
pub fn combine(y: &Array, scores: &Array) -> R<Array> {
    y.multiply(scores.expand_dims(-1)?)?
        .sum_axis(-2, false)?
        .as_dtype(y.dtype())
}

/// The sparse block (`Qwen3MoeSparseMoeBlock`, `MixtralSparseMoeBlock`): router, then
/// the experts, weighed.
pub struct SparseMoe {
    pub router: Gate,
    pub experts: SwitchGlu,
}

impl SparseMoe {
    /// The router `gate` (its linear's full name) picking by `kind`, and the experts under
    /// `mlp` (`hf_names` for a per-expert checkpoint, see [`SwitchGlu::load`]).
    pub fn load(
        w: &mut Weights,
        mlp: &str,
        gate: &str,
        d: MoeDims,
        kind: Router,
        hf_names: [&str; 3],
    ) -> Result<Self, LoadError> {
        Ok(SparseMoe {
            router: Gate {
                gate: Linear::load(w, gate, false, [d.experts, d.hidden])?,
                top_k: d.top_k,
                kind,
            },
            experts: SwitchGlu::load(w, mlp, (d.hidden, d.intermediate), d.experts, hf_names)?,
        })
    }

    pub fn forward(&self, x: &Array) -> R<Array> {
        let (inds, scores) = self.router.route(x)?;
        let y = self.experts.forward(x, &inds)?;
        self.experts.sum_partials(combine(&y, &scores)?)
    }
}
