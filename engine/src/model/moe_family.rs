//! What the mixture-of-experts families (`qwen3_moe`, `mixtral`, `qwen2_moe`, `glm4_moe`) share on top
//! of the decoder (`decoder.rs`): their attention (Llama's, plain RoPE), the feed-forward of
//! a layer — a dense MLP, the sparse block, or the sparse block with a shared expert — and
//! mlx-lm's check of `num_experts_per_tok`.

use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::decoder::FeedForward;
use super::layers::Glu;
use super::layers::{Attention, Linear, Mlp, RmsNorm, Rope};
use super::moe::{
    combine, Gate, MoeDims, Router, SparseMoe, SwitchGlu, SwitchLinear, EXPERT_NAMES,
};
use super::shard::{Part, Split};
use crate::load::weights::Weights;
use crate::load::LoadError;

/// The sparse block plus a shared expert behind a sigmoid gate (`Qwen2MoeSparseMoeBlock`).
pub struct SharedMoe {
    pub moe: SparseMoe,
    pub shared: Mlp,
    pub shared_gate: Linear,
}

impl SharedMoe {
    /// The sparse block under `mlp` (router `<mlp>.gate`), the shared expert
    /// (`<mlp>.shared_expert`, width `shared`) and its gate (`<mlp>.shared_expert_gate`).
    pub fn load(
        w: &mut Weights,
        mlp: &str,
        d: MoeDims,
        shared: i32,
        kind: Router,
    ) -> Result<Self, LoadError> {
        let moe = SparseMoe::load(w, mlp, &format!("{mlp}.gate"), d, kind, EXPERT_NAMES)?;
        let shared_mlp = format!("{mlp}.shared_expert");
        Ok(SharedMoe {
            moe,
            shared: Mlp::load(w, &shared_mlp, false, d.hidden, shared, Glu::Swiglu)?,
            shared_gate: Linear::load(
                w,
                &format!("{mlp}.shared_expert_gate"),
                false,
                [1, d.hidden],
            )?,
        })
    }

    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        let (inds, scores) = self.moe.router.route(x)?;
        let y = self.moe.experts.forward(x, &inds)?;
        let y = y.multiply(scores.expand_dims(-1)?)?.sum_axis(-2, false)?;
        let shared = self.shared.forward(x)?;
        let shared = mlx_rs::ops::sigmoid(self.shared_gate.forward(x)?)?.multiply(&shared)?;
        // Tensor parallel: both terms are this rank's partial sums, summed once here.
        self.moe.experts.sum_partials(y.add(&shared)?)
    }

    /// `qwen3_5.Model.shard` on the block: the shared expert and every routed expert
    /// narrowed in place (`shard_inplace`: gate and up by columns, down by rows, no `all_sum`
    /// of their own), the router and the shared expert's gate whole; the block's output
    /// (routed + gated shared) is summed over the ranks once (`sharding_group`).
    fn shard(&mut self, part: Part, prefix: &str) -> Result<(), LoadError> {
        let shared = format!("{prefix}.shared_expert");
        self.shared.gate_proj.shard_inplace(
            Split::Columns,
            part,
            &format!("{shared}.gate_proj"),
        )?;
        self.shared
            .down_proj
            .shard_inplace(Split::Rows, part, &format!("{shared}.down_proj"))?;
        self.shared
            .up_proj
            .shard_inplace(Split::Columns, part, &format!("{shared}.up_proj"))?;
        self.moe
            .experts
            .shard(part, &format!("{prefix}.switch_mlp"))
    }
}

/// A router that is no `nn.Linear` (DeepSeek-V3-style `MoEGate`), SwitchGLU experts, and an
/// ungated shared expert added to their weighed sum (`glm4_moe.MoE`):
/// `combine(experts(x), w) + shared_experts(x)`.
pub struct PlusShared {
    pub router: Gate,
    pub experts: SwitchGlu,
    /// `shared_experts`, where `n_shared_experts` is set.
    pub shared: Option<Mlp>,
    /// The router is an `nn.Linear` (ERNIE 4.5's `gate`: LoRA's and quantization's), not
    /// a plain module holding a weight (glm4_moe's `MoEGate`).
    pub linear_router: bool,
}

impl PlusShared {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        let (inds, scores) = self.router.route(x)?;
        let y = combine(&self.experts.forward(x, &inds)?, &scores)?;
        let y = match &self.shared {
            Some(shared) => y.add(shared.forward(x)?)?,
            None => y,
        };
        // Tensor parallel: both terms are this rank's partial sums, summed once here.
        self.experts.sum_partials(y)
    }

    /// `glm4_moe.Model.shard` on the block: the shared expert and every routed expert
    /// narrowed in place, the router whole, the block's output summed once.
    fn shard(&mut self, part: Part, prefix: &str) -> Result<(), LoadError> {
        if let Some(shared) = &mut self.shared {
            let s = format!("{prefix}.shared_experts");
            shared
                .gate_proj
                .shard_inplace(Split::Columns, part, &format!("{s}.gate_proj"))?;
            shared
                .down_proj
                .shard_inplace(Split::Rows, part, &format!("{s}.down_proj"))?;
            shared
                .up_proj
                .shard_inplace(Split::Columns, part, &format!("{s}.up_proj"))?;
        }
        self.experts.shard(part, &format!("{prefix}.switch_mlp"))
    }
}

/// A layer's feed-forward.
pub enum Ffn {
    Dense(Mlp),
    Sparse(SparseMoe),
    /// Boxed: it is twice the size of the others (one per layer, so the box costs nothing).
    Shared(Box<SharedMoe>),
    PlusShared(Box<PlusShared>),
}

impl Ffn {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        match self {
            Ffn::Dense(mlp) => mlp.forward(x),
            Ffn::Sparse(moe) => moe.forward(x),
            Ffn::Shared(moe) => moe.forward(x),
            Ffn::PlusShared(moe) => moe.forward(x),
        }
    }
}

/// The attention of the MoE families: Llama's, plain `nn.RoPE` (no scaling: mlx-lm's MoE
/// modules never apply it), q/k/v biases for qwen2_moe, per-head q/k RMSNorm for qwen3_moe.
pub struct AttnShape {
    pub hidden: i32,
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub qkv_bias: bool,
    /// The q/k RMSNorms' eps, where the family has them.
    pub qk_norm_eps: Option<f32>,
    pub rope_traditional: bool,
    pub rope_base: f32,
}

/// Layer `p`'s attention: its q/k norms (where the family has them), then q, k, v and o.
pub fn load_attention(w: &mut Weights, p: &str, a: &AttnShape) -> Result<Attention, LoadError> {
    let proj = |w: &mut Weights, name: &str, bias: bool, out_in: [i32; 2]| {
        Linear::load(w, &format!("{p}.self_attn.{name}"), bias, out_in)
    };
    let norm = |w: &mut Weights, name: &str| {
        let prefix = format!("{p}.self_attn.{name}");
        (a.qk_norm_eps)
            .map(|eps| RmsNorm::load(w, &prefix, a.head_dim, eps))
            .transpose()
    };
    let (q_norm, k_norm) = (norm(w, "q_norm")?, norm(w, "k_norm")?);
    let (h, q_dims, kv_dims) = (a.hidden, a.heads * a.head_dim, a.kv_heads * a.head_dim);
    Ok(Attention {
        q_proj: proj(w, "q_proj", a.qkv_bias, [q_dims, h])?,
        k_proj: proj(w, "k_proj", a.qkv_bias, [kv_dims, h])?,
        v_proj: proj(w, "v_proj", a.qkv_bias, [kv_dims, h])?,
        o_proj: proj(w, "o_proj", false, [h, q_dims])?,
        q_norm,
        k_norm,
        n_heads: a.heads,
        n_kv_heads: a.kv_heads,
        scale: (a.head_dim as f32).powf(-0.5),
        norm_after_transpose: false,
        rope: Rope::Standard {
            dims: a.head_dim,
            traditional: a.rope_traditional,
            base: a.rope_base,
            scale: 1.0,
        },
    })
}

/// `num_experts_per_tok` must pick at least one and at most every expert (`field` names
/// the family's expert count).
pub fn check_top_k(
    model_type: &str,
    top_k: i32,
    experts: i32,
    field: &str,
) -> Result<(), LoadError> {
    if top_k <= 0 || top_k > experts {
        return Err(LoadError::Unsupported(format!(
            "{model_type}: num_experts_per_tok {top_k} must be in 1..={experts} ({field})"
        )));
    }
    Ok(())
}

impl Ffn {
    /// Its linears under mlx-lm's names within the block (`ffn` is the module's name):
    /// the dense MLP's three; the router `gate`; a shared expert's three and its gate.
    fn named_linears(&self, ffn: &str) -> Vec<(String, &Linear)> {
        fn mlp(prefix: String, m: &Mlp) -> [(String, &Linear); 3] {
            [
                ("gate_proj", &m.gate_proj),
                ("up_proj", &m.up_proj),
                ("down_proj", &m.down_proj),
            ]
            .map(|(n, l)| (format!("{prefix}.{n}"), l))
        }
        match self {
            Ffn::Dense(m) => mlp(ffn.to_owned(), m).into(),
            Ffn::Sparse(moe) => vec![(format!("{ffn}.gate"), &moe.router.gate)],
            Ffn::Shared(s) => std::iter::once((format!("{ffn}.gate"), &s.moe.router.gate))
                .chain(mlp(format!("{ffn}.shared_expert"), &s.shared))
                .chain([(format!("{ffn}.shared_expert_gate"), &s.shared_gate)])
                .collect(),
            Ffn::PlusShared(p) => p
                .linear_router
                .then(|| (format!("{ffn}.gate"), &p.router.gate))
                .into_iter()
                .chain(
                    p.shared
                        .iter()
                        .flat_map(|m| mlp(format!("{ffn}.shared_experts"), m)),
                )
                .collect(),
        }
    }

    /// Its stacked experts (`<ffn>.switch_mlp.{gate,up,down}_proj`), none for a dense MLP.
    fn named_switches(&self, ffn: &str) -> Vec<(String, &SwitchLinear)> {
        match self {
            Ffn::Dense(_) => Vec::new(),
            Ffn::Sparse(moe) => moe.experts.named(&format!("{ffn}.switch_mlp")),
            Ffn::Shared(s) => s.moe.experts.named(&format!("{ffn}.switch_mlp")),
            Ffn::PlusShared(p) => p.experts.named(&format!("{ffn}.switch_mlp")),
        }
    }
}

/// A layer's feed-forward, named by the decoder (`mlp`, Mixtral's `block_sparse_moe`).
impl FeedForward for Ffn {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        Ffn::forward(self, x)
    }

    fn linears(&self, module: &str) -> Vec<(String, &Linear)> {
        self.named_linears(module)
    }

    fn switches(&self, module: &str) -> Vec<(String, &SwitchLinear)> {
        self.named_switches(module)
    }

    /// As `qwen3_moe.Model.shard`: dense MLPs as Llama's; a sparse block keeps its router
    /// whole and every expert narrowed (`moe/shard.rs`), and sums its combined output over
    /// the ranks. A block with a shared expert as `qwen3_5.Model.shard` splits it (the one
    /// family mlx-lm 0.32.2 shards with one: the registry refuses qwen2_moe and qwen3_next).
    fn shard(&mut self, part: Part, prefix: &str) -> Result<(), LoadError> {
        match self {
            Ffn::Dense(mlp) => mlp.shard(part, prefix),
            Ffn::Sparse(moe) => moe.experts.shard(part, &format!("{prefix}.switch_mlp")),
            Ffn::Shared(moe) => moe.shard(part, prefix),
            Ffn::PlusShared(moe) => moe.shard(part, prefix),
        }
    }
}
