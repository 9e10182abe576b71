//! `qwen3_5` (Qwen 3.5 / 3.6, dense; the text path of the multimodal checkpoints) as mlx-lm
//! 0.32.2 implements it: the plain pre-norm decoder where three of every
//! `full_attention_interval` layers are gated delta nets (`gated_delta.rs`, an ArraysCache
//! state) and the last of each group attends:
//!
//!   for each layer:  h = h + mixer(input_layernorm(h))     mixer = gated delta net | attention
//!                    h = h + down(swiglu(gate(x), up(x))),  x = post_attention_layernorm(h)
//!   attention: q and its output gate from one projection (per head [q; gate]), q/k RMSNorm,
//!              RoPE on the first head_dim · partial_rotary_factor dims, o_proj(out · σ(gate))
//!
//! The multimodal checkpoint's config keeps the text model's fields in `text_config` (a flat
//! config is read as it is); its tensors are sanitized as mlx-lm's `Model.sanitize` then
//! `TextModel.sanitize` do: vision tensors and `mtp.` heads dropped, `model.language_model.`
//! and `language_model.` prefixes stripped, a tied `lm_head` dropped, and — in Hugging
//! Face's layout, recognized by its [C, 1, K] conv kernels — the kernels moved to MLX's
//! [C, K, 1] and the (1 + w) RMSNorm weights of the layers, q/k norms and final norm given
//! their 1.
//!
//! Tensor parallel as mlx-lm's `Model.shard`: the delta nets by heads (`gated_delta.rs`), the
//! attention by heads (its K/V heads repeated first when the ranks outnumber them), the dense
//! MLP as Llama's, the sparse block with its shared expert narrowed in place and summed once
//! (`moe_family.rs`), and an untied `lm_head` by the vocabulary, its logits gathered on every
//! rank. Pipeline parallel is the decoder's (`PipelineMixin`; also qwen3_next's).

use mlx_rs::error::Exception;
use mlx_rs::ops::sigmoid;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::decoder::{dims_of, kv_cache, Built, Decoder, Mixer};
use super::gated_delta::{GatedDeltaNet, GdnLayout, GdnShape};
use super::layers::{Glu, Linear, Mlp, RmsNorm, Rope};
use super::moe::{unfuse_experts, MoeDims, Router};
use super::moe_family::{check_top_k, Ffn, SharedMoe};
use super::shard::{Part, Split};
use crate::cache::{kv_of, Cache, Mask};
use crate::load::config::{ModelConfig, RopeScaling};
use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::plant::{self, Defect};

type R<T> = Result<T, Exception>;

/// mlx-lm's `qwen3_5.TextModelArgs` (dense fields), defaults included.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct Qwen35Args {
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub num_hidden_layers: i32,
    pub num_attention_heads: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub num_key_value_heads: i32,
    pub max_position_embeddings: i32,
    pub linear_num_value_heads: i32,
    pub linear_num_key_heads: i32,
    pub linear_key_head_dim: i32,
    pub linear_value_head_dim: i32,
    pub linear_conv_kernel_dim: i32,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub head_dim: Option<i32>,
    pub full_attention_interval: i32,
    pub num_experts: i32,
    pub num_experts_per_tok: i32,
    pub moe_intermediate_size: i32,
    pub shared_expert_intermediate_size: i32,
    pub norm_topk_prob: bool,
    pub rope_parameters: Option<Value>,
    pub partial_rotary_factor: f64,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
}

impl Default for Qwen35Args {
    fn default() -> Self {
        Qwen35Args {
            hidden_size: 4096,
            intermediate_size: 14336,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            rms_norm_eps: 1e-6,
            vocab_size: 151_936,
            num_key_value_heads: 8,
            max_position_embeddings: 131_072,
            linear_num_value_heads: 64,
            linear_num_key_heads: 16,
            linear_key_head_dim: 192,
            linear_value_head_dim: 128,
            linear_conv_kernel_dim: 4,
            tie_word_embeddings: false,
            attention_bias: false,
            head_dim: None,
            full_attention_interval: 4,
            num_experts: 0,
            num_experts_per_tok: 0,
            moe_intermediate_size: 0,
            shared_expert_intermediate_size: 0,
            norm_topk_prob: true,
            rope_parameters: Some(serde_json::json!({
                "type": "default",
                "mrope_section": [11, 11, 10],
                "rope_theta": 100000,
                "partial_rotary_factor": 0.25,
            })),
            partial_rotary_factor: 0.25,
            rope_theta: 100_000.0,
            rope_scaling: None,
        }
    }
}

impl Qwen35Args {
    fn head_dim(&self) -> i32 {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// `__post_init__`: a non-empty `rope_parameters` gives the rotated share, the base and
    /// the scaling; otherwise the top-level fields do.
    fn rope(&self) -> Result<(f64, f32, Option<RopeScaling>), LoadError> {
        let params = self
            .rope_parameters
            .as_ref()
            .and_then(Value::as_object)
            .filter(|m| !m.is_empty());
        let Some(p) = params else {
            return Ok((
                self.partial_rotary_factor,
                self.rope_theta,
                self.rope_scaling.clone(),
            ));
        };
        let scaling: RopeScaling = serde_json::from_value(Value::Object(p.clone()))
            .map_err(|e| LoadError::Unsupported(format!("qwen3_5: rope_parameters: {e}")))?;
        let share = p
            .get("partial_rotary_factor")
            .and_then(Value::as_f64)
            .unwrap_or(0.25);
        let theta = p
            .get("rope_theta")
            .and_then(Value::as_f64)
            .unwrap_or(100_000.0);
        Ok((share, theta as f32, Some(scaling)))
    }
}

/// Qwen3-Next's attention: q and a sigmoid output gate from one projection.
struct GatedAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    n_heads: i32,
    n_kv_heads: i32,
    scale: f32,
    rope: Rope,
}

impl Mixer for GatedAttention {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let qg = self
            .q_proj
            .forward(x)?
            .reshape(&[b, l, self.n_heads, -1])?
            .split_equal(2, -1)?;
        let gate = qg[1].reshape(&[b, l, -1])?;
        let heads = [0, 2, 1, 3];
        let q = self.q_norm.forward(&qg[0])?.transpose_axes(&heads)?;
        let k = self.k_proj.forward(x)?;
        let v = self.v_proj.forward(x)?;
        let k = self
            .k_norm
            .forward(&k.reshape(&[b, l, self.n_kv_heads, -1])?)?
            .transpose_axes(&heads)?;
        let v = v
            .reshape(&[b, l, self.n_kv_heads, -1])?
            .transpose_axes(&heads)?;
        let cache = kv_of(cache)?;
        let offset = cache.rope_offset();
        let q = self.rope.forward(&q, &offset)?;
        let k = self.rope.forward(&k, &offset)?;
        let kv = cache.update_and_fetch(k, v)?;
        let out = super::sdpa::attend(&q, &kv, self.scale, mask)?;
        let out = out.transpose_axes(&heads)?.reshape(&[b, l, -1])?;
        self.o_proj.forward(&out.multiply(sigmoid(&gate)?)?)
    }

    fn make_cache(&self) -> Box<dyn Cache> {
        kv_cache(&self.rope)
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        vec![
            ("self_attn.q_proj", &self.q_proj),
            ("self_attn.k_proj", &self.k_proj),
            ("self_attn.v_proj", &self.v_proj),
            ("self_attn.o_proj", &self.o_proj),
        ]
    }

    /// `qwen3_5.Model.shard` on an attention layer: q (with its per-head output gate) and k,
    /// v by columns, o by rows (one `all_sum`); with more ranks than KV heads, k and v first
    /// repeat their heads (`repeat_kv_layer_inplace`) so that every rank keeps one.
    fn shard(&mut self, part: Part, layer: &str) -> Result<(), LoadError> {
        let attn = format!("{layer}.self_attn");
        let n = part.size as i32;
        let kv = self.n_kv_heads;
        let kv_fits = if n > kv { n % kv == 0 } else { kv % n == 0 };
        if self.n_heads % n != 0 || !kv_fits {
            return Err(LoadError::Unsupported(format!(
                "{attn}: {} query and {kv} KV heads do not split over {n} ranks (tensor \
                 parallel needs the query heads, and the KV heads or the rank count, to \
                 divide by the other; try --pipeline)",
                self.n_heads
            )));
        }
        self.o_proj
            .shard(Split::Rows, part, &format!("{attn}.o_proj"))?;
        self.q_proj
            .shard(Split::Columns, part, &format!("{attn}.q_proj"))?;
        let repeat_after = crate::plant::is(crate::plant::Defect::KvRepeatAfterShard);
        for (proj, name) in [(&mut self.k_proj, "k_proj"), (&mut self.v_proj, "v_proj")] {
            let what = format!("{attn}.{name}");
            if n > kv && !repeat_after {
                proj.repeat_heads(kv, n / kv, &what)?;
            }
            proj.shard(Split::Columns, part, &what)?;
            if n > kv && repeat_after {
                proj.repeat_heads(1, n / kv, &what)?;
            }
        }
        self.n_heads /= n;
        self.n_kv_heads = (kv / n).max(1);
        Ok(())
    }
}

/// The text model's config: `text_config` when the checkpoint is multimodal, else the
/// config itself. Its `model_type` stays the checkpoint's (mlx-lm's `Model.model_type`, the
/// registry's row): `text_config`'s own (`qwen3_5_text`) names no family.
fn text_config(config: &ModelConfig) -> Result<ModelConfig, LoadError> {
    match config.raw.get("text_config") {
        Some(Value::Object(text)) => {
            let mut text =
                ModelConfig::from_value(config.path.clone(), Value::Object(text.clone()))?;
            text.quantization = config.quantization.clone();
            text.model_type = config.model_type.clone();
            Ok(text)
        }
        Some(_) => Err(LoadError::Unsupported(format!(
            "{}: text_config is not an object",
            config.path.display()
        ))),
        None => Ok(config.clone()),
    }
}

/// `qwen3_5_moe`'s `Model.sanitize`: Hugging Face's fused experts (`experts.gate_up_proj`
/// [E, 2·I, D], gate first along axis −2, and `experts.down_proj`) as the SwitchGLU's
/// `switch_mlp.{gate,up,down}_proj`.
fn split_fused_experts(w: &mut Weights, layers: i32) -> Result<(), LoadError> {
    for l in 0..layers {
        let p = format!("model.layers.{l}.mlp");
        let fused = format!("{p}.experts.gate_up_proj");
        if w.contains(&fused) {
            unfuse_experts(w, &p, &fused, &format!("{p}.experts.down_proj"))?;
        }
    }
    Ok(())
}

/// mlx-lm's `Model.sanitize` and `TextModel.sanitize` (see the module header).
fn sanitize(w: &mut Weights, tied: bool) -> Result<(), LoadError> {
    w.rename(|n| {
        if n.starts_with("vision_tower") || n.starts_with("model.visual") {
            return None;
        }
        let n = match n.strip_prefix("model.language_model.") {
            Some(rest) => format!("model.{rest}"),
            None => n.strip_prefix("language_model.").unwrap_or(n).to_owned(),
        };
        (!n.contains("mtp.")).then_some(n)
    });
    if tied {
        w.discard(|n| n == "lm_head.weight");
    }
    let hf_layout = w.remaining().iter().any(|n| {
        n.contains("conv1d.weight") && w.shape_of(n).is_some_and(|s| s.last() != Some(&1))
    });
    hf_conv_and_norms(
        w,
        hf_layout || plant::is(Defect::HybridNormOffsetOnMlxLayout),
    )
}

/// The (1 + w) RMSNorms Hugging Face's Qwen 3.5 / Qwen3-Next checkpoints store as w.
pub(crate) const OFFSET_NORMS: [&str; 5] = [
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
];

/// Conv kernels in Hugging Face's [C, 1, K] layout moved to MLX's [C, K, 1]; with
/// `add_one`, the offset norms given their 1.
pub(crate) fn hf_conv_and_norms(w: &mut Weights, add_one: bool) -> Result<(), LoadError> {
    w.transform(|n, a| {
        if n.contains("conv1d.weight") && a.shape().last() != Some(&1) {
            return Ok(Some(mlx_rs::ops::move_axis(a, 2, 1)?));
        }
        let offset = add_one && !plant::is(Defect::HybridNormOffsetSkipped);
        if offset && OFFSET_NORMS.iter().any(|s| n.ends_with(s)) && a.ndim() == 1 {
            let one = Array::from_f32(1.0).as_dtype(a.dtype())?;
            return Ok(Some(a.add(&one)?));
        }
        Ok(None)
    })
}

/// What `engine convert` does to a qwen3_5 / qwen3_5_moe checkpoint's tensors: the
/// loader's sanitize (and qwen3_5_moe's expert split) as above, then every name under
/// `language_model.`, where mlx-lm's `Model` holds its text model.
pub(crate) fn convert_sanitize(config: &ModelConfig, w: &mut Weights) -> Result<(), LoadError> {
    let text = text_config(config)?;
    let a: Qwen35Args = text.parse()?;
    sanitize(w, a.tie_word_embeddings)?;
    if config.model_type == "qwen3_5_moe" {
        split_fused_experts(w, a.num_hidden_layers)?;
    }
    w.rename(|n| Some(format!("language_model.{n}")));
    Ok(())
}

/// The model: the plain decoder, gated delta nets and gated attention by
/// `full_attention_interval`, the SwiGLU MLP or (every layer, with experts) the sparse block;
/// its layers under `language_model.` where LoRA names them, as mlx-lm's `Model` (dense and
/// MoE, flat config or not) always holds its `TextModel` there.
pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Decoder, LoadError> {
    let text = text_config(config)?;
    let a: Qwen35Args = text.parse()?;
    sanitize(&mut w, a.tie_word_embeddings)?;
    if config.model_type == "qwen3_5_moe" {
        split_fused_experts(&mut w, a.num_hidden_layers)?;
    }
    let decoder = build(&text, w, &a, GdnLayout::Split, |_| a.num_experts > 0)?;
    // Tensor parallel splits an untied lm_head by the vocabulary (`Model.shard`).
    Ok(decoder.under_language_model().with_vocab_sharded_head())
}

/// The decoder of Qwen 3.5 and Qwen3-Next (`qwen3_next.rs`) from their (sanitized) weights:
/// `layout` is the delta nets' projections, `sparse(i)` whether layer i's MLP is the
/// sparse block.
pub(crate) fn build(
    config: &ModelConfig,
    w: Weights,
    a: &Qwen35Args,
    layout: GdnLayout,
    sparse: impl Fn(i32) -> bool,
) -> Result<Decoder, LoadError> {
    if a.num_experts > 0 {
        check_top_k(
            &config.model_type,
            a.num_experts_per_tok,
            a.num_experts,
            "num_experts",
        )?;
    }
    let head_dim = a.head_dim();
    let (share, theta, scaling) = a.rope()?;
    let gdn = GdnShape {
        hidden: a.hidden_size,
        k_heads: a.linear_num_key_heads,
        v_heads: a.linear_num_value_heads,
        k_dim: a.linear_key_head_dim,
        v_dim: a.linear_value_head_dim,
        conv_kernel: a.linear_conv_kernel_dim,
        eps: a.rms_norm_eps,
    };
    let dims = dims_of!(a);
    let interval = a.full_attention_interval.max(1);
    Decoder::load(config, w, dims, |w, p, i| {
        let mixer: Box<dyn Mixer> = match (i + 1) % interval != 0 {
            true => Box::new(GatedDeltaNet::load(
                w,
                &format!("{p}.linear_attn"),
                gdn,
                layout,
            )?),
            false => {
                let lin = |w: &mut Weights, n: &str, out_in: [i32; 2]| {
                    Linear::load(w, &format!("{p}.self_attn.{n}"), a.attention_bias, out_in)
                };
                let norm = |w: &mut Weights, n: &str| {
                    RmsNorm::load(w, &format!("{p}.self_attn.{n}"), head_dim, a.rms_norm_eps)
                };
                let h = a.hidden_size;
                let q_dims = a.num_attention_heads * head_dim;
                let kv_dims = a.num_key_value_heads * head_dim;
                let (q_norm, k_norm) = (norm(w, "q_norm")?, norm(w, "k_norm")?);
                Box::new(GatedAttention {
                    // q and its output gate, one projection.
                    q_proj: lin(w, "q_proj", [2 * q_dims, h])?,
                    k_proj: lin(w, "k_proj", [kv_dims, h])?,
                    v_proj: lin(w, "v_proj", [kv_dims, h])?,
                    o_proj: lin(w, "o_proj", [h, q_dims])?,
                    q_norm,
                    k_norm,
                    n_heads: a.num_attention_heads,
                    n_kv_heads: a.num_key_value_heads,
                    scale: (head_dim as f32).powf(-0.5),
                    rope: Rope::init(
                        (head_dim as f64 * share) as i32,
                        theta,
                        false,
                        scaling.as_ref(),
                        Some(a.max_position_embeddings),
                    )?,
                })
            }
        };
        let ffn = feed_forward(w, p, a, sparse(i))?;
        Ok(Built::from((mixer, Box::new(ffn))))
    })
}

/// A layer's feed-forward: the SwiGLU MLP, or with experts Qwen3-Next's sparse block (softmax
/// over the experts, the top k renormalized when `norm_topk_prob`) beside a shared expert
/// behind a sigmoid gate.
fn feed_forward(w: &mut Weights, p: &str, a: &Qwen35Args, sparse: bool) -> Result<Ffn, LoadError> {
    let mlp = format!("{p}.mlp");
    if !sparse {
        return Ok(Ffn::Dense(Mlp::load(
            w,
            &mlp,
            false,
            a.hidden_size,
            a.intermediate_size,
            Glu::Swiglu,
        )?));
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
    let shared = a.shared_expert_intermediate_size;
    Ok(Ffn::Shared(Box::new(SharedMoe::load(
        w, &mlp, d, shared, router,
    )?)))
}
