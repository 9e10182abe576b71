//! `lfm2` as mlx-lm 0.32.2 implements it (Liquid's LFM2): a plain pre-norm decoder whose
//! layers mix either by full attention or by a gated short convolution (`short_conv.rs`):
//!
//!   for each layer:  h = h + mixer(operator_norm(h))     mixer = attention | short conv
//!                    h = h + w2(swiglu(w1(x), w3(x))),  x = ffn_norm(h)
//!   logits = embed.T · embedding_norm(h)                  (always tied)
//!
//! Attention normalizes q and k per head (`q_layernorm`, `k_layernorm`) before RoPE, scale
//! head_dim^-½. `lfm2_moe` keeps the first `num_dense_layers` feed-forwards a SwiGLU of
//! `intermediate_size` (`gate_proj`/`up_proj`/`down_proj`, HF's w1/w3/w2 renamed as mlx-lm's
//! sanitize does) and makes the others a sparse block: σ(gate(x)) scores, the top k picked
//! with `expert_bias` added (when `use_expert_bias`), their unbiased scores renormalized
//! (+1e-6) when `norm_topk_prob`, times `routed_scaling_factor`, in x's dtype. The feed-forward width is `block_ff_dim`, auto-adjusted as mlx-lm does
//! (⅔, times the multiplier, rounded up to `block_multiple_of`). Which layers attend:
//! `full_attn_idxs`, else `layer_types`' `full_attention` entries.

use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;

use super::decoder::{Built, Decoder, Dims, FeedForward, Mixer, NamedAttention, Names, Style};
use super::layers::{Attention, Glu, Linear, Mlp, RmsNorm, Rope};
use super::moe::{stack_experts, SwitchGlu, SwitchLinear, EXPERT_NAMES};
use super::moe_family::check_top_k;
use super::shard::Part;
use super::short_conv::{self, ShortConv};
use crate::load::config::{ModelConfig, RopeParameters};
use crate::load::weights::Weights;
use crate::load::LoadError;

type R<T> = Result<T, Exception>;

fn default_theta() -> f32 {
    1_000_000.0
}

fn one() -> f32 {
    1.0
}

/// mlx-lm's `lfm2.ModelArgs` (the fields this engine reads).
#[derive(Debug, Clone, Deserialize)]
pub struct Lfm2Args {
    pub hidden_size: i32,
    pub vocab_size: i32,
    pub num_hidden_layers: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: Option<i32>,
    pub max_position_embeddings: i32,
    pub norm_eps: f32,
    pub conv_bias: bool,
    #[serde(rename = "conv_L_cache")]
    pub conv_l_cache: i32,
    /// lfm2's feed-forward (lfm2_moe has none of these).
    pub block_dim: Option<i32>,
    pub block_multiple_of: Option<i32>,
    pub block_ffn_dim_multiplier: Option<f32>,
    #[serde(default)]
    pub block_auto_adjust_ff_dim: bool,
    /// lfm2_moe's.
    pub moe_intermediate_size: Option<i32>,
    pub num_experts: Option<i32>,
    pub num_experts_per_tok: Option<i32>,
    #[serde(default)]
    pub norm_topk_prob: bool,
    #[serde(default)]
    pub use_expert_bias: bool,
    #[serde(default)]
    pub num_dense_layers: i32,
    #[serde(default = "one")]
    pub routed_scaling_factor: f32,
    pub block_ff_dim: Option<i32>,
    pub intermediate_size: Option<i32>,
    #[serde(default = "default_theta")]
    pub rope_theta: f32,
    pub rope_parameters: Option<RopeParameters>,
    pub full_attn_idxs: Option<Vec<i32>>,
    pub layer_types: Option<Vec<String>>,
}

impl Lfm2Args {
    /// `__post_init__`'s attention layers.
    fn attends(&self) -> Result<Vec<bool>, LoadError> {
        let n = self.num_hidden_layers as usize;
        let idxs: Vec<usize> = match (&self.full_attn_idxs, &self.layer_types) {
            (Some(idxs), _) => idxs.iter().map(|&i| i as usize).collect(),
            (None, Some(types)) => types
                .iter()
                .enumerate()
                .filter(|(_, t)| t.as_str() == "full_attention")
                .map(|(i, _)| i)
                .collect(),
            (None, None) => {
                return Err(LoadError::Unsupported(
                    "lfm2: the config names no attention layers (full_attn_idxs or \
                     layer_types)"
                        .into(),
                ))
            }
        };
        if idxs.is_empty() || idxs.iter().any(|&i| i >= n) {
            return Err(LoadError::Unsupported(format!(
                "lfm2: attention layers {idxs:?} must be some of the {n} layers"
            )));
        }
        Ok((0..n).map(|i| idxs.contains(&i)).collect())
    }

    /// `MLP.__init__`'s width.
    fn ff_dim(&self) -> Result<i32, LoadError> {
        let mut ff = self
            .block_ff_dim
            .or(self.intermediate_size)
            .ok_or_else(|| {
                LoadError::Unsupported(
                    "lfm2: the config needs block_ff_dim or intermediate_size".into(),
                )
            })?;
        if self.block_auto_adjust_ff_dim {
            ff = (2 * ff) / 3;
            if let Some(m) = self.block_ffn_dim_multiplier {
                ff = (m * ff as f32) as i32;
            }
            let k = self.block_multiple_of.unwrap_or(1).max(1);
            ff = k * ((ff + k - 1) / k);
        }
        Ok(ff)
    }

    fn theta(&self) -> f32 {
        // `rope_parameters["rope_theta"]` wins where it is given (one set, not per layer type).
        match &self.rope_parameters {
            Some(RopeParameters::One(s)) => s.rope_theta.unwrap_or(self.rope_theta),
            _ => self.rope_theta,
        }
    }
}

/// The SwiGLU under LFM2's names (`w1` gate, `w3` up, `w2` down).
struct Lfm2Mlp(Mlp);

impl FeedForward for Lfm2Mlp {
    fn forward(&self, x: &Array) -> R<Array> {
        self.0.forward(x)
    }

    fn linears(&self, module: &str) -> Vec<(String, &Linear)> {
        let m = &self.0;
        [
            ("w1", &m.gate_proj),
            ("w3", &m.up_proj),
            ("w2", &m.down_proj),
        ]
        .map(|(n, l)| (format!("{module}.{n}"), l))
        .into()
    }

    fn shard(&mut self, _part: Part, prefix: &str) -> Result<(), LoadError> {
        Err(not_sharded(prefix))
    }
}

fn not_sharded(at: &str) -> LoadError {
    LoadError::Unsupported(format!("{at}: lfm2 is not split across ranks"))
}

/// The model: the plain decoder under LFM2's norm names, each layer attention or a short
/// convolution, the head tied.
pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Decoder, LoadError> {
    let a: Lfm2Args = config.parse()?;
    let attends = a.attends()?;
    let moe = match config.model_type.as_str() {
        "lfm2_moe" => Some(MoeShape::of(&a)?),
        _ => None,
    };
    let ff = match moe {
        Some(_) => 0,
        None => a.ff_dim()?,
    };
    sanitize(&mut w, moe.is_some())?;
    let heads = a.num_attention_heads;
    let kv_heads = a.num_key_value_heads.unwrap_or(heads);
    let head_dim = a.hidden_size / heads;
    let dims = Dims {
        layers: a.num_hidden_layers,
        hidden: a.hidden_size,
        vocab: a.vocab_size,
        rms_norm_eps: a.norm_eps,
        tie_word_embeddings: true,
        ffn_module: "feed_forward",
    };
    let style = Style {
        names: Names {
            input: "operator_norm",
            post: "ffn_norm",
            last: "model.embedding_norm",
            ..Names::default()
        },
        ..Style::default()
    };
    Decoder::load_styled(config, w, dims, style, |w, p, i| {
        let mixer: Box<dyn Mixer> = match attends[i as usize] {
            true => {
                let lin = |w: &mut Weights, n: &str, out_in: [i32; 2]| {
                    Linear::load(w, &format!("{p}.self_attn.{n}"), false, out_in)
                };
                let norm = |w: &mut Weights, n: &str| {
                    RmsNorm::load(w, &format!("{p}.self_attn.{n}"), head_dim, a.norm_eps)
                };
                let (h, q_dims, kv_dims) = (a.hidden_size, heads * head_dim, kv_heads * head_dim);
                let (q_norm, k_norm) = (norm(w, "q_layernorm")?, norm(w, "k_layernorm")?);
                Box::new(NamedAttention {
                    attn: Attention {
                        q_proj: lin(w, "q_proj", [q_dims, h])?,
                        k_proj: lin(w, "k_proj", [kv_dims, h])?,
                        v_proj: lin(w, "v_proj", [kv_dims, h])?,
                        o_proj: lin(w, "out_proj", [h, q_dims])?,
                        q_norm: Some(q_norm),
                        k_norm: Some(k_norm),
                        n_heads: heads,
                        n_kv_heads: kv_heads,
                        scale: (head_dim as f32).powf(-0.5),
                        norm_after_transpose: false,
                        rope: Rope::init(head_dim, a.theta(), false, None, None)?,
                    },
                    names: [
                        "self_attn.q_proj",
                        "self_attn.k_proj",
                        "self_attn.v_proj",
                        "self_attn.out_proj",
                    ],
                    family: "lfm2",
                })
            }
            false => Box::new(ShortConv::load(
                w,
                &format!("{p}.conv"),
                a.hidden_size,
                a.conv_l_cache,
                a.conv_bias,
            )?),
        };
        let ffn: Box<dyn FeedForward> = match moe {
            Some(m) if i >= a.num_dense_layers => Box::new(Lfm2Moe::load(w, p, &a, m)?),
            Some(_) => Box::new(Mlp::load(
                w,
                &format!("{p}.feed_forward"),
                false,
                a.hidden_size,
                a.intermediate_size.unwrap_or(0),
                Glu::Swiglu,
            )?),
            None => {
                let mut lin = |n: &str, out_in: [i32; 2]| {
                    Linear::load(w, &format!("{p}.feed_forward.{n}"), false, out_in)
                };
                let dim = a.block_dim.unwrap_or(a.hidden_size);
                Box::new(Lfm2Mlp(Mlp {
                    gate_proj: lin("w1", [ff, dim])?,
                    up_proj: lin("w3", [ff, dim])?,
                    down_proj: lin("w2", [dim, ff])?,
                    glu: Glu::Swiglu,
                }))
            }
        };
        Ok(Built {
            mixer,
            ffn: Some(ffn),
            tail: None,
            borrows: None,
        })
    })
}

/// lfm2_moe's sparse block sizes.
#[derive(Debug, Clone, Copy)]
struct MoeShape {
    experts: i32,
    top_k: i32,
    intermediate: i32,
}

impl MoeShape {
    fn of(a: &Lfm2Args) -> Result<Self, LoadError> {
        let need = |v: Option<i32>, f: &str| {
            v.ok_or_else(|| LoadError::Unsupported(format!("lfm2_moe: the config needs `{f}`")))
        };
        let shape = MoeShape {
            experts: need(a.num_experts, "num_experts")?,
            top_k: need(a.num_experts_per_tok, "num_experts_per_tok")?,
            intermediate: need(a.moe_intermediate_size, "moe_intermediate_size")?,
        };
        check_top_k("lfm2_moe", shape.top_k, shape.experts, "num_experts")?;
        Ok(shape)
    }
}

/// mlx-lm's `sanitize` of lfm2 (the conv kernels in MLX's layout) and, with `moe`, of
/// lfm2_moe (also its expert names): at load and in `engine convert`.
pub(crate) fn sanitize(w: &mut Weights, moe: bool) -> Result<(), LoadError> {
    short_conv::sanitize_kernels(w)?;
    if moe {
        sanitize_moe(w);
    }
    Ok(())
}

/// What `engine convert` does to an lfm2 / lfm2_moe checkpoint's tensors: the loader's
/// sanitize and, for lfm2_moe on Hugging Face's per-expert layout, as mlx-lm's sanitize
/// does, each sparse block's experts stacked under `switch_mlp` (the loader stacks them as
/// it builds).
pub(crate) fn convert_sanitize(config: &ModelConfig, w: &mut Weights) -> Result<(), LoadError> {
    let moe = config.model_type == "lfm2_moe";
    sanitize(w, moe)?;
    if !moe {
        return Ok(());
    }
    let a: Lfm2Args = config.parse()?;
    for l in 0..a.num_hidden_layers {
        let ff = format!("model.layers.{l}.feed_forward");
        for n in ["gate_proj", "down_proj", "up_proj"] {
            if let Some(stacked) = stack_experts(w, &ff, n, a.num_experts.unwrap_or(0), None)? {
                w.insert(format!("{ff}.switch_mlp.{n}.weight"), stacked);
            }
        }
    }
    Ok(())
}

/// mlx-lm's lfm2_moe `sanitize`: HF's w1/w2/w3 as gate/down/up_proj (its per-expert
/// tensors are stacked by `SwitchGlu::load`, as its sanitize stacks them).
fn sanitize_moe(w: &mut Weights) {
    w.rename(|n| {
        Some(
            n.replace("w1.weight", "gate_proj.weight")
                .replace("w2.weight", "down_proj.weight")
                .replace("w3.weight", "up_proj.weight"),
        )
    });
}

/// lfm2_moe's sparse block (see the module header).
struct Lfm2Moe {
    gate: Linear,
    expert_bias: Option<Array>,
    experts: SwitchGlu,
    top_k: i32,
    norm_topk_prob: bool,
    scaling: f32,
}

impl Lfm2Moe {
    fn load(w: &mut Weights, p: &str, a: &Lfm2Args, m: MoeShape) -> Result<Self, LoadError> {
        let f = format!("{p}.feed_forward");
        Ok(Lfm2Moe {
            gate: Linear::load(w, &format!("{f}.gate"), false, [m.experts, a.hidden_size])?,
            expert_bias: match a.use_expert_bias {
                true => Some(w.take_shaped(&format!("{f}.expert_bias"), &[m.experts])?),
                false => None,
            },
            experts: SwitchGlu::load(
                w,
                &f,
                (a.hidden_size, m.intermediate),
                m.experts,
                EXPERT_NAMES,
            )?,
            top_k: m.top_k,
            norm_topk_prob: a.norm_topk_prob,
            scaling: a.routed_scaling_factor,
        })
    }
}

impl FeedForward for Lfm2Moe {
    fn forward(&self, x: &Array) -> R<Array> {
        use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
        let k = self.top_k;
        let weights = mlx_rs::ops::sigmoid(&self.gate.forward(x)?)?;
        let for_routing = match &self.expert_bias {
            Some(bias) => weights.as_dtype(mlx_rs::Dtype::Float32)?.add(bias)?,
            None => weights.clone(),
        };
        let n = *for_routing.shape().last().unwrap_or(&0);
        let part = mlx_rs::ops::argpartition_axis(&for_routing, -k, -1)?;
        let inds = mlx_rs::stop_gradient(part.index((Ellipsis, (n - k)..n)))?;
        let mut scores = weights.take_along_axis(&inds, -1)?;
        if self.norm_topk_prob {
            let sum = scores.sum_axis(-1, true)?;
            let sum = sum.add(crate::scalar::weak(1e-6, &sum)?)?;
            scores = scores.divide(&sum)?;
        }
        let scores = scores
            .multiply(crate::scalar::weak(self.scaling as f64, &scores)?)?
            .as_dtype(x.dtype())?;
        let y = self.experts.forward(x, &inds)?;
        y.multiply(scores.expand_dims(-1)?)?.sum_axis(-2, false)
    }

    fn linears(&self, module: &str) -> Vec<(String, &Linear)> {
        vec![(format!("{module}.gate"), &self.gate)]
    }

    fn switches(&self, module: &str) -> Vec<(String, &SwitchLinear)> {
        self.experts.named(&format!("{module}.switch_mlp"))
    }

    fn shard(&mut self, _part: Part, prefix: &str) -> Result<(), LoadError> {
        Err(not_sharded(prefix))
    }
}
