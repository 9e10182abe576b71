//! The Llama family as mlx-lm 0.32.2 implements it: `llama` (and `mistral`, which mlx-lm
//! maps onto it), `qwen2` (q/k/v biases) and `qwen3` (per-head q/k RMSNorm, explicit
//! head_dim).
//!
//!   h = embed(ids)
//!   for each layer:  h = h + attn(rms_norm(h));  h = h + mlp(rms_norm(h))
//!   logits = head(rms_norm(h))      (head = embedding.T when tied)

use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;

use super::layers::{
    attn_mlp_linears, block_linears, Attention, Embedding, Glu, Linear, Mlp, OutputHead, RmsNorm,
    Rope,
};
use super::pipeline::{self, Stage};
use super::rope;
use super::{LanguageModel, Layered};
use crate::cache::{Cache, KvCache, Mask};
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

fn qwen2_max_positions() -> i32 {
    32768
}

const QWEN2_ROPE_THETA: f32 = 1_000_000.0;

impl From<Qwen2Args> for Shape {
    fn from(a: Qwen2Args) -> Self {
        Shape {
            hidden: a.hidden_size,
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
struct Shape {
    hidden: i32,
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

struct Block {
    attn: Attention,
    mlp: Mlp,
    input_norm: RmsNorm,
    post_attn_norm: RmsNorm,
}

pub struct Llama {
    model_type: String,
    embed: Embedding,
    blocks: Vec<Block>,
    head: OutputHead,
    /// Pipeline parallel: this rank's stage (`blocks` then holds only its layers).
    stage: Option<Stage>,
}

impl Llama {
    pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Self, LoadError> {
        let shape: Shape = match config.model_type.as_str() {
            "qwen3" => config.parse::<Qwen3Args>()?.try_into()?,
            "qwen2" => config.parse::<Qwen2Args>()?.into(),
            _ => {
                let args: LlamaArgs = config.parse()?;
                if let Some(types) = &args.layer_types {
                    if types.iter().any(|t| t != "full_attention") {
                        return Err(LoadError::Unsupported(
                            "sliding-window layers need the rotating cache (not supported yet)"
                                .into(),
                        ));
                    }
                }
                args.into()
            }
        };
        // mlx-lm's sanitize: drop precomputed rotary tables, and the head when tied.
        w.discard(|n| n.contains("self_attn.rotary_emb.inv_freq"));
        if shape.tied {
            w.discard(|n| n == "lm_head.weight");
        }
        w.set_quantization(config.quantization.clone());
        let q_dims = shape.heads * shape.head_dim;
        let mut blocks = Vec::new();
        for i in 0..shape.layers {
            let p = format!("model.layers.{i}");
            let proj = |w: &mut Weights, name: &str, in_dims: i32| {
                let bias = if name == "o_proj" {
                    shape.o_bias
                } else {
                    shape.attention_bias
                };
                Linear::load(w, &format!("{p}.self_attn.{name}"), bias, in_dims)
            };
            let norm = |w: &mut Weights, name: &str| -> Result<Option<RmsNorm>, LoadError> {
                if !shape.qk_norm {
                    return Ok(None);
                }
                Ok(Some(RmsNorm::load(
                    w,
                    &format!("{p}.self_attn.{name}"),
                    shape.eps,
                )?))
            };
            let attn = Attention {
                q_proj: proj(&mut w, "q_proj", shape.hidden)?,
                k_proj: proj(&mut w, "k_proj", shape.hidden)?,
                v_proj: proj(&mut w, "v_proj", shape.hidden)?,
                o_proj: proj(&mut w, "o_proj", q_dims)?,
                q_norm: norm(&mut w, "q_norm")?,
                k_norm: norm(&mut w, "k_norm")?,
                n_heads: shape.heads,
                n_kv_heads: shape.kv_heads,
                scale: (shape.head_dim as f32).powf(-0.5),
                norm_after_transpose: false,
                rope: Rope::init(
                    shape.head_dim,
                    shape.rope.0,
                    shape.rope_traditional,
                    shape.rope.1.as_ref(),
                    shape.max_positions,
                )?,
            };
            let post = format!("{p}.post_attention_layernorm");
            blocks.push(Block {
                attn,
                mlp: Mlp::load(
                    &mut w,
                    &format!("{p}.mlp"),
                    shape.mlp_bias,
                    shape.hidden,
                    shape.intermediate,
                    Glu::Swiglu,
                )?,
                input_norm: RmsNorm::load(&mut w, &format!("{p}.input_layernorm"), shape.eps)?,
                post_attn_norm: RmsNorm::load(&mut w, &post, shape.eps)?,
            });
        }
        let embed = Embedding::load(&mut w, "model.embed_tokens", shape.hidden)?;
        let norm = RmsNorm::load(&mut w, "model.norm", shape.eps)?;
        let head = OutputHead::load(&mut w, norm, shape.tied, shape.hidden, None)?;
        w.ensure_consumed(&config.model_type, |_| false)?;
        Ok(Llama {
            model_type: config.model_type.clone(),
            embed,
            blocks,
            head,
            stage: None,
        })
    }
}

impl LanguageModel for Llama {
    fn model_type(&self) -> &str {
        &self.model_type
    }

    fn vocab_size(&self) -> usize {
        self.head.width(&self.embed)
    }

    fn linears(&self) -> Vec<(String, &Linear)> {
        let named = block_linears(&self.blocks, |b| attn_mlp_linears(&b.attn, &b.mlp));
        pipeline::checkpoint_names(self.stage.as_ref(), named)
    }

    fn activation_dtype(&self) -> mlx_rs::Dtype {
        self.embed.output_dtype()
    }

    /// One per local layer (a pipeline stage's in its stage wrapper).
    fn make_caches(&self) -> Vec<Box<dyn Cache>> {
        let caches = self
            .blocks
            .iter()
            .map(|b| match b.attn.rope.needs_int_offset() {
                true => Box::new(rope::IntOffsetKv(KvCache::new())) as Box<dyn Cache>,
                false => Box::new(KvCache::new()) as Box<dyn Cache>,
            })
            .collect();
        pipeline::local_caches(self.stage.as_ref(), caches)
    }

    fn forward(&self, ids: &Array, caches: &mut [Box<dyn Cache>]) -> Result<Array, Exception> {
        let h = self.embed.forward(ids)?;
        // One mask for every (full-attention) layer, from the first cache, as mlx-lm does.
        let mask = caches[0].make_mask(ids.shape()[1], None)?;
        let h = pipeline::run(self.stage.as_ref(), h, caches, |h, caches| {
            self.blocks_with(h, &mask, self.blocks.iter().zip(caches.iter_mut()))
        })?;
        self.head_logits(&h)
    }

    /// None on a pipeline stage: its blocks are only part of the model.
    fn as_layered(&self) -> Option<&dyn Layered> {
        match self.stage {
            Some(_) => None,
            None => Some(self),
        }
    }

    fn shard(&mut self, part: super::shard::Part) -> Result<(), LoadError> {
        for (i, b) in self.blocks.iter_mut().enumerate() {
            let p = format!("model.layers.{i}");
            b.attn.shard(part, &p)?;
            b.mlp.shard(part, &format!("{p}.mlp"))?;
        }
        Ok(())
    }

    /// `Qwen2Model.pipeline`: this rank keeps its stage's layers. mlx-lm 0.32.2 pipelines
    /// only qwen2 of this family (llama, mistral and qwen3 have no `PipelineMixin`).
    fn pipeline(&mut self, part: super::shard::Part) -> Result<(), LoadError> {
        let stage = pipeline::stage_for(&self.model_type, &["qwen2"], part, self.blocks.len())?;
        self.blocks = stage.keep(std::mem::take(&mut self.blocks));
        self.stage = Some(stage);
        Ok(())
    }
}

impl Llama {
    fn blocks_with<'c>(
        &self,
        mut h: Array,
        mask: &Mask,
        blocks: impl Iterator<Item = (&'c Block, &'c mut Box<dyn Cache>)>,
    ) -> Result<Array, Exception>
    where
        Self: 'c,
    {
        for (block, cache) in blocks {
            let x = block.input_norm.forward(&h)?;
            let r = block.attn.forward(&x, mask, cache.as_mut())?;
            let hh = h.add(&r)?;
            let r = block.mlp.forward(&block.post_attn_norm.forward(&hh)?)?;
            h = hh.add(&r)?;
        }
        Ok(h)
    }
}

impl Layered for Llama {
    fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    fn embed_ids(&self, ids: &Array) -> Result<Array, Exception> {
        self.embed.forward(ids)
    }

    fn run_blocks(&self, h: &Array, range: std::ops::Range<usize>) -> Result<Array, Exception> {
        let mut caches: Vec<Box<dyn Cache>> = range
            .clone()
            .map(|_| Box::new(crate::cache::none::PassThrough) as Box<dyn Cache>)
            .collect();
        let mask = caches[0].make_mask(h.shape()[1], None)?;
        self.blocks_with(
            h.clone(),
            &mask,
            self.blocks[range].iter().zip(caches.iter_mut()),
        )
    }

    fn head_logits(&self, h: &Array) -> Result<Array, Exception> {
        self.head.forward(&self.embed, h)
    }
}
