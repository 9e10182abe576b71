//! `minimax` as mlx-lm 0.32.2 implements it (MiniMax-M2 / M2.1; mlx-lm maps `minimax_m2`
//! onto this module, MODEL_REMAPPING), `minimax.py`:
//!
//!   attn  = GQA without biases; with `use_qk_norm` q and k RMSNormed over all their heads
//!           at once (a norm of heads · head_dim, before the split into heads); `nn.RoPE`
//!           over the first `rotary_dim` dims from `rope_theta`
//!   block_sparse_moe, every layer:
//!           s = σ(gate(x in float32));  inds = argpartition(−(s + e_score_correction_bias),
//!           k−1)[..., :k];  w = s[inds] / (Σ s[inds] + 1e-20), cast to x's dtype;
//!           y = Σ_k w_k · SwitchGLU_e(x)
//!   logits = lm_head(rms_norm(h)), or the tied embedding
//!
//! mlx-lm's `sanitize`: per-expert `w1` / `w3` / `w2` stacked into `switch_mlp`'s gate / up /
//! down. Its FP8 dequantization (`weight_scale_inv`) is refused here, not run.
//!
//! Tensor parallel as its `Model.shard`: q/k/v by columns and o by rows (Llama's attention
//! split), the q/k norms over all heads become `ShardedRMSNorm`s (this rank's part of the
//! weight, the sum of squares added over the ranks: `shard::ShardedRmsNorm`), every expert
//! narrowed in place (`shard_inplace`) with the router whole, and the block's weighed sum
//! added over the ranks once (`sharding_group`). mlx-lm 0.32.2 has no `PipelineMixin` here.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::ops::{argpartition_axis, sigmoid};
use mlx_rs::Array;
use serde::Deserialize;

use super::decoder::{dims_of, kv_cache, Decoder, FeedForward, Mixer};
use super::layers::{Attention, Linear, RmsNorm, Rope};
use super::moe::{SwitchGlu, SwitchLinear, MIXTRAL_EXPERT_NAMES};
use super::moe_family::check_top_k;
use super::shard::{Part, ShardedRmsNorm};
use crate::cache::{kv_of, Cache, Mask};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::plant::{self, Defect};

type R<T> = Result<T, Exception>;

/// mlx-lm's `minimax.ModelArgs` (the fields it reads).
#[derive(Debug, Clone, Deserialize)]
pub struct MiniMaxArgs {
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: i32,
    pub num_experts_per_tok: i32,
    pub num_local_experts: i32,
    pub num_hidden_layers: i32,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rotary_dim: i32,
    pub vocab_size: i32,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    pub head_dim: Option<i32>,
    #[serde(default = "yes")]
    pub use_qk_norm: bool,
}

fn yes() -> bool {
    true
}

/// A q/k norm over every head of the projection: whole, or split over the ranks.
enum FlatNorm {
    Whole(RmsNorm),
    Sharded(ShardedRmsNorm),
}

impl FlatNorm {
    fn forward(&self, x: &Array) -> R<Array> {
        match self {
            FlatNorm::Whole(n) => n.forward(x),
            FlatNorm::Sharded(n) => n.forward(x),
        }
    }

    /// `ShardedRMSNorm.from_rms_norm`.
    fn shard(&mut self, part: Part, what: &str) -> Result<(), LoadError> {
        if let FlatNorm::Whole(n) = self {
            *self = FlatNorm::Sharded(ShardedRmsNorm::from_rms_norm(n, part, what)?);
        }
        Ok(())
    }
}

/// `MiniMaxAttention`: the shared attention with its q/k norms taken out and applied to
/// the flat projections (one norm over every head) before the split into heads.
struct FlatNormAttention {
    attn: Attention,
    /// `q_norm` / `k_norm` over heads · head_dim, with `use_qk_norm`.
    norms: Option<(FlatNorm, FlatNorm)>,
}

impl FlatNormAttention {
    fn attend(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        let a = &self.attn;
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let (mut q, mut k) = (a.q_proj.forward(x)?, a.k_proj.forward(x)?);
        let v = a.v_proj.forward(x)?;
        if let Some((q_norm, k_norm)) = &self.norms {
            q = q_norm.forward(&q)?;
            k = k_norm.forward(&k)?;
        }
        let heads = |t: Array, n: i32| t.reshape(&[b, l, n, -1])?.transpose_axes(&[0, 2, 1, 3]);
        let (q, k) = (heads(q, a.n_heads)?, heads(k, a.n_kv_heads)?);
        let v = heads(v, a.n_kv_heads)?;
        let cache = kv_of(cache)?;
        let offset = cache.rope_offset();
        let q = a.rope.forward(&q, &offset)?;
        let k = a.rope.forward(&k, &offset)?;
        let kv = cache.update_and_fetch(k, v)?;
        let out = super::sdpa::attend(&q, &kv, a.scale, mask)?;
        let out = out.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
        a.o_proj.forward(&out)
    }
}

impl Mixer for FlatNormAttention {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        self.attend(x, mask, cache)
    }

    fn make_cache(&self) -> Box<dyn Cache> {
        kv_cache(&self.attn.rope)
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        self.attn.named_linears().into()
    }

    /// `Model.shard` on the attention: Llama's split (which also divides the head counts),
    /// then the q/k norms sharded over the same features.
    fn shard(&mut self, part: Part, layer: &str) -> Result<(), LoadError> {
        self.attn.shard(part, layer)?;
        if let Some((q_norm, k_norm)) = &mut self.norms {
            q_norm.shard(part, &format!("{layer}.self_attn.q_norm"))?;
            k_norm.shard(part, &format!("{layer}.self_attn.k_norm"))?;
        }
        Ok(())
    }
}

/// `MiniMaxSparseMoeBlock` (see the module header).
struct SigmoidMoe {
    gate: Linear,
    e_score_correction_bias: Array,
    top_k: i32,
    experts: SwitchGlu,
}

impl SigmoidMoe {
    fn route(&self, x: &Array) -> R<(Array, Array)> {
        let gates = self.gate.forward(&x.as_dtype(mlx_rs::Dtype::Float32)?)?;
        let scores = sigmoid(&gates)?;
        let biased = scores.add(&self.e_score_correction_bias)?;
        let k = self.top_k;
        let part = argpartition_axis(biased.negative()?, k - 1, -1)?;
        let inds = mlx_rs::stop_gradient(part.index((Ellipsis, ..k)))?;
        // Planted: the weights read from the biased scores the experts were picked by.
        let weighed = match plant::is(Defect::MoeCorrectionBiasWeighted) {
            true => &biased,
            false => &scores,
        };
        let picked = weighed.take_along_axis(&inds, -1)?;
        let total = picked.sum_axis(-1, true)?;
        let total = total.add(crate::scalar::weak(1e-20, &total)?)?;
        Ok((inds, picked.divide(total)?.as_dtype(x.dtype())?))
    }
}

impl FeedForward for SigmoidMoe {
    fn forward(&self, x: &Array) -> R<Array> {
        let (inds, scores) = self.route(x)?;
        let y = self.experts.forward(x, &inds)?;
        let y = y.multiply(scores.expand_dims(-1)?)?.sum_axis(-2, false)?;
        // Tensor parallel: this rank's partial sums, added over the ranks once.
        self.experts.sum_partials(y)
    }

    fn linears(&self, module: &str) -> Vec<(String, &Linear)> {
        vec![(format!("{module}.gate"), &self.gate)]
    }

    fn switches(&self, module: &str) -> Vec<(String, &SwitchLinear)> {
        self.experts.named(&format!("{module}.switch_mlp"))
    }

    /// `Model.shard` on the block: every expert narrowed in place, the router whole.
    fn shard(&mut self, part: Part, prefix: &str) -> Result<(), LoadError> {
        self.experts.shard(part, &format!("{prefix}.switch_mlp"))
    }
}

fn load_attention(
    w: &mut Weights,
    p: &str,
    a: &MiniMaxArgs,
) -> Result<FlatNormAttention, LoadError> {
    let head_dim = a.head_dim.unwrap_or(a.hidden_size / a.num_attention_heads);
    let (h, q_dims, kv_dims) = (
        a.hidden_size,
        a.num_attention_heads * head_dim,
        a.num_key_value_heads * head_dim,
    );
    let norm = |w: &mut Weights, n: &str, dims: i32| {
        RmsNorm::load(w, &format!("{p}.self_attn.{n}"), dims, a.rms_norm_eps).map(FlatNorm::Whole)
    };
    let norms = match a.use_qk_norm {
        true => Some((norm(w, "q_norm", q_dims)?, norm(w, "k_norm", kv_dims)?)),
        false => None,
    };
    Ok(FlatNormAttention {
        attn: Attention {
            scale: (head_dim as f32).powf(-0.5),
            rope: Rope::Standard {
                dims: a.rotary_dim,
                traditional: false,
                base: a.rope_theta,
                scale: 1.0,
            },
            ..Attention::load_projections(
                w,
                &format!("{p}.self_attn"),
                false,
                h,
                a.num_attention_heads,
                a.num_key_value_heads,
                head_dim,
            )?
        },
        norms,
    })
}

fn load_moe(w: &mut Weights, p: &str, a: &MiniMaxArgs) -> Result<SigmoidMoe, LoadError> {
    let m = format!("{p}.block_sparse_moe");
    let (h, e) = (a.hidden_size, a.num_local_experts);
    Ok(SigmoidMoe {
        gate: Linear::load(w, &format!("{m}.gate"), false, [e, h])?,
        e_score_correction_bias: w.take_shaped(&format!("{m}.e_score_correction_bias"), &[e])?,
        top_k: a.num_experts_per_tok,
        experts: SwitchGlu::load(w, &m, (h, a.intermediate_size), e, MIXTRAL_EXPERT_NAMES)?,
    })
}

pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Decoder, LoadError> {
    let a: MiniMaxArgs = config.parse()?;
    check_top_k(
        "minimax",
        a.num_experts_per_tok,
        a.num_local_experts,
        "num_local_experts",
    )?;
    if let Some(name) = w
        .remaining()
        .iter()
        .find(|n| n.contains("weight_scale_inv"))
    {
        return Err(LoadError::Unsupported(format!(
            "minimax: `{name}` is an FP8 block scale; mlx-lm dequantizes FP8 checkpoints in its \
             sanitize, which the engine does not: convert the checkpoint with mlx_lm.convert first"
        )));
    }
    if a.tie_word_embeddings {
        w.discard(|n| n == "lm_head.weight");
    }
    let dims = dims_of!(a, "block_sparse_moe");
    Decoder::load(config, w, dims, |w, p, _| {
        let mixer: Box<dyn Mixer> = Box::new(load_attention(w, p, &a)?);
        Ok((mixer, Box::new(load_moe(w, p, &a)?)))
    })
}
