//! The Llama family as mlx-lm 0.32.2 implements it: `llama` (and `mistral`, which mlx-lm
//! maps onto it), `qwen2` (q/k/v biases), `qwen3` (per-head q/k RMSNorm, explicit
//! head_dim) and `seed_oss` (explicit head_dim, q/k/v and o biases switched apart).
//!
//!   h = embed(ids)
//!   for each layer:  h = h + attn(rms_norm(h));  h = h + mlp(rms_norm(h))
//!   logits = head(rms_norm(h))      (head = embedding.T when tied)

use serde::Deserialize;

use super::decoder::{Decoder, Dims, Mixer};
use super::layers::{Attention, Glu, Linear, Mlp, RmsNorm, Rope};
use super::rope;
use crate::load::config::{ModelConfig, RopeParameters, RopeScaling};
use crate::load::weights::Weights;
use crate::load::LoadError;

fn default_rope_theta() -> f32 {
    10000.0
}

fn yes() -> bool {
    true
}

/// mlx-lm's `llama.ModelArgs` (defaults included).
#[derive(Debug, Clone, Deserialize)]
pub struct LlamaArgs {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub head_dim: Option<i32>,
    pub num_key_value_heads: Option<i32>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    /// mlx-lm's default 10000 when neither the top level nor rope_parameters has it.
    pub rope_theta: Option<f32>,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<RopeScaling>,
    /// transformers 5 (mlx-lm 0.32.2 ignores it for llama; we read it as transformers does).
    pub rope_parameters: Option<RopeParameters>,
    pub max_position_embeddings: Option<i32>,
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
    pub layer_types: Option<Vec<String>>,
}

/// mlx-lm's `qwen3.ModelArgs`: head_dim, tie_word_embeddings and max_position_embeddings
/// are required; transformers ≥ 5 may nest rope_theta/rope_scaling in rope_parameters.
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen3Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub num_key_value_heads: i32,
    pub max_position_embeddings: i32,
    pub head_dim: i32,
    pub tie_word_embeddings: bool,
    pub rope_theta: Option<f32>,
    pub rope_scaling: Option<RopeScaling>,
    pub rope_parameters: Option<RopeScaling>,
}

/// mlx-lm's `qwen2.ModelArgs`: q/k/v projections carry a bias, o does not.
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen2Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub num_key_value_heads: i32,
    /// mlx-lm's default 1e6 when neither the top level nor rope_parameters has it.
    pub rope_theta: Option<f32>,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<RopeScaling>,
    /// transformers 5 (mlx-lm 0.32.2 ignores it for qwen2; we read it as transformers does).
    pub rope_parameters: Option<RopeParameters>,
    #[serde(default = "qwen2_max_positions")]
    pub max_position_embeddings: i32,
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
}

/// mlx-lm's `seed_oss.ModelArgs` (Seed-OSS): Llama's layers with an explicit `head_dim`,
/// the q/k/v bias (`attention_bias`) apart from the o bias (`attention_out_bias`).
#[derive(Debug, Clone, Deserialize)]
pub struct SeedOssArgs {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub num_key_value_heads: i32,
    pub head_dim: i32,
    pub max_position_embeddings: Option<i32>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub attention_out_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
}

impl From<SeedOssArgs> for Shape {
    fn from(a: SeedOssArgs) -> Self {
        Shape {
            hidden: a.hidden_size,
            vocab: a.vocab_size,
            intermediate: a.intermediate_size,
            layers: a.num_hidden_layers,
            heads: a.num_attention_heads,
            kv_heads: a.num_key_value_heads,
            head_dim: a.head_dim,
            eps: a.rms_norm_eps,
            attention_bias: a.attention_bias,
            o_bias: a.attention_out_bias,
            mlp_bias: a.mlp_bias,
            qk_norm: false,
            tied: a.tie_word_embeddings,
            rope: (a.rope_theta, a.rope_scaling),
            rope_traditional: a.rope_traditional,
            max_positions: a.max_position_embeddings,
        }
    }
}

fn qwen2_max_positions() -> i32 {
    32768
}

const QWEN2_ROPE_THETA: f32 = 1_000_000.0;

impl From<Qwen2Args> for Shape {
    fn from(a: Qwen2Args) -> Self {
        Shape {
            hidden: a.hidden_size,
            vocab: a.vocab_size,
            intermediate: a.intermediate_size,
            layers: a.num_hidden_layers,
            heads: a.num_attention_heads,
            kv_heads: a.num_key_value_heads,
            head_dim: a.hidden_size / a.num_attention_heads,
            eps: a.rms_norm_eps,
            attention_bias: true,
            o_bias: false,
            mlp_bias: false,
            qk_norm: false,
            tied: a.tie_word_embeddings,
            rope: rope::settings(
                a.rope_theta,
                a.rope_scaling.as_ref(),
                a.rope_parameters.as_ref(),
                "full_attention",
                QWEN2_ROPE_THETA,
            ),
            rope_traditional: a.rope_traditional,
            max_positions: Some(a.max_position_embeddings),
        }
    }
}

/// What the families reduce to.
pub struct Shape {
    hidden: i32,
    vocab: i32,
    intermediate: i32,
    layers: i32,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    eps: f32,
    /// Bias on the q/k/v projections.
    attention_bias: bool,
    /// Bias on the output projection.
    o_bias: bool,
    mlp_bias: bool,
    qk_norm: bool,
    tied: bool,
    /// rope_theta and the scaling settings (`rope::settings`).
    rope: (f32, Option<RopeScaling>),
    rope_traditional: bool,
    max_positions: Option<i32>,
}

impl From<LlamaArgs> for Shape {
    fn from(a: LlamaArgs) -> Self {
        Shape {
            hidden: a.hidden_size,
            vocab: a.vocab_size,
            intermediate: a.intermediate_size,
            layers: a.num_hidden_layers,
            heads: a.num_attention_heads,
            kv_heads: a.num_key_value_heads.unwrap_or(a.num_attention_heads),
            head_dim: a.head_dim.unwrap_or(a.hidden_size / a.num_attention_heads),
            eps: a.rms_norm_eps,
            attention_bias: a.attention_bias,
            o_bias: a.attention_bias,
            mlp_bias: a.mlp_bias,
            qk_norm: false,
            tied: a.tie_word_embeddings,
            rope: rope::settings(
                a.rope_theta,
                a.rope_scaling.as_ref(),
                a.rope_parameters.as_ref(),
                "full_attention",
                default_rope_theta(),
            ),
            rope_traditional: a.rope_traditional,
            max_positions: a.max_position_embeddings,
        }
    }
}

impl TryFrom<Qwen3Args> for Shape {
    type Error = LoadError;

    /// mlx-lm's `qwen3.ModelArgs.__post_init__`: rope_theta and rope_scaling from
    /// rope_parameters when missing, and no default theta.
    fn try_from(a: Qwen3Args) -> Result<Self, LoadError> {
        let nested = a.rope_parameters.clone();
        let theta = a
            .rope_theta
            .or(nested.as_ref().and_then(|p| p.rope_theta))
            .ok_or_else(|| {
                LoadError::Unsupported("rope_theta is missing from the model config".into())
            })?;
        Ok(Shape {
            hidden: a.hidden_size,
            vocab: a.vocab_size,
            intermediate: a.intermediate_size,
            layers: a.num_hidden_layers,
            heads: a.num_attention_heads,
            kv_heads: a.num_key_value_heads,
            head_dim: a.head_dim,
            eps: a.rms_norm_eps,
            attention_bias: false,
            o_bias: false,
            mlp_bias: false,
            qk_norm: true,
            tied: a.tie_word_embeddings,
            rope: (theta, a.rope_scaling.or(nested)),
            rope_traditional: false,
            max_positions: Some(a.max_position_embeddings),
        })
    }
}

/// The model: its config read as mlx-lm's `ModelArgs` of `llama`, `qwen2` or `qwen3`, then
/// the decoder with Llama's layers (every layer rotates).
pub fn load(config: &ModelConfig, w: Weights) -> Result<Decoder, LoadError> {
    let shape: Shape = match config.model_type.as_str() {
        "qwen3" => config.parse::<Qwen3Args>()?.try_into()?,
        "qwen2" => config.parse::<Qwen2Args>()?.into(),
        "seed_oss" => config.parse::<SeedOssArgs>()?.into(),
        _ => llama_shape(config.parse()?)?,
    };
    build(config, w, &shape, |_| true)
}

/// `llama.ModelArgs` reduced to the shape, for full-attention layers only.
pub fn llama_shape(args: LlamaArgs) -> Result<Shape, LoadError> {
    if let Some(types) = &args.layer_types {
        if types.iter().any(|t| t != "full_attention") {
            return Err(LoadError::Unsupported(
                "sliding-window layers need the rotating cache (not supported yet)".into(),
            ));
        }
    }
    Ok(args.into())
}

/// mlx-lm's sanitize (precomputed rotary tables dropped, the head too when tied), then the
/// decoder with Llama's layers: attention (q/k/v biases for qwen2, q/k RMSNorm for qwen3;
/// RoPE where `rotates(layer)`, none elsewhere) and a SwiGLU MLP.
pub fn build(
    config: &ModelConfig,
    mut w: Weights,
    shape: &Shape,
    rotates: impl Fn(i32) -> bool,
) -> Result<Decoder, LoadError> {
    w.discard(|n| n.contains("self_attn.rotary_emb.inv_freq"));
    if shape.tied {
        w.discard(|n| n == "lm_head.weight");
    }
    let dims = Dims {
        layers: shape.layers,
        hidden: shape.hidden,
        vocab: shape.vocab,
        rms_norm_eps: shape.eps,
        tie_word_embeddings: shape.tied,
        ffn_module: "mlp",
    };
    let q_dims = shape.heads * shape.head_dim;
    let kv_dims = shape.kv_heads * shape.head_dim;
    Decoder::load(config, w, dims, |w, p, i| {
        let proj = |w: &mut Weights, name: &str, out_in: [i32; 2]| {
            let bias = match name {
                "o_proj" => shape.o_bias,
                _ => shape.attention_bias,
            };
            Linear::load(w, &format!("{p}.self_attn.{name}"), bias, out_in)
        };
        let norm = |w: &mut Weights, name: &str| -> Result<Option<RmsNorm>, LoadError> {
            let prefix = format!("{p}.self_attn.{name}");
            (shape.qk_norm)
                .then(|| RmsNorm::load(w, &prefix, shape.head_dim, shape.eps))
                .transpose()
        };
        let (q_norm, k_norm) = (norm(w, "q_norm")?, norm(w, "k_norm")?);
        let h = shape.hidden;
        let attn = Attention {
            q_proj: proj(w, "q_proj", [q_dims, h])?,
            k_proj: proj(w, "k_proj", [kv_dims, h])?,
            v_proj: proj(w, "v_proj", [kv_dims, h])?,
            o_proj: proj(w, "o_proj", [h, q_dims])?,
            q_norm,
            k_norm,
            n_heads: shape.heads,
            n_kv_heads: shape.kv_heads,
            scale: (shape.head_dim as f32).powf(-0.5),
            norm_after_transpose: false,
            rope: match rotates(i) {
                true => Rope::init(
                    shape.head_dim,
                    shape.rope.0,
                    shape.rope_traditional,
                    shape.rope.1.as_ref(),
                    shape.max_positions,
                )?,
                false => Rope::None,
            },
        };
        let mlp = Mlp::load(
            w,
            &format!("{p}.mlp"),
            shape.mlp_bias,
            shape.hidden,
            shape.intermediate,
            Glu::Swiglu,
        )?;
        Ok((Box::new(attn) as Box<dyn Mixer>, Box::new(mlp) as _))
    })
}
