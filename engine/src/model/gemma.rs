//! Gemma 3 text (`gemma3_text`) as mlx-lm 0.32.2 implements it:
//!
//!   h = embed(ids) · √hidden (the scale rounded through bf16)
//!   each layer:  h = h + post_attn_norm(attn(input_norm(h)))
//!                h = h + post_ffw_norm(mlp(pre_ffw_norm(h)))     mlp = down(gelu_tanh(gate) · up)
//!   logits = head(norm(h))                                        (tied when no lm_head)
//!
//! RMSNorms scale by (1 + w). Every `sliding_window_pattern`-th layer attends globally
//! (standard cache, rope_theta); the others attend within `sliding_window` through a
//! rotating cache (rope_local_base_freq).

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};
use serde::Deserialize;

use super::layers::{
    attn_mlp_linears, block_linears, layer_cache, Attention, Embedding, Glu, Linear, Mlp,
    OutputHead, RmsNorm, Rope,
};
use super::rope;
use super::LanguageModel;
use crate::cache::Cache;
use crate::load::config::{ModelConfig, RopeParameters, RopeScaling};
use crate::load::weights::Weights;
use crate::load::LoadError;

type R<T> = Result<T, Exception>;

/// mlx-lm's `gemma3_text.ModelArgs`, defaults included.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct Gemma3Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub head_dim: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub num_key_value_heads: i32,
    /// None: from rope_parameters (transformers 5), else mlx-lm's 1e6 / 1e4.
    pub rope_theta: Option<f32>,
    pub rope_local_base_freq: Option<f32>,
    pub query_pre_attn_scalar: f32,
    pub sliding_window: i32,
    pub sliding_window_pattern: i32,
    pub max_position_embeddings: i32,
    pub rope_scaling: Option<RopeScaling>,
    /// transformers 5, per layer type (mlx-lm 0.32.2 ignores it; we read it as transformers).
    pub rope_parameters: Option<RopeParameters>,
}

impl Default for Gemma3Args {
    fn default() -> Self {
        Gemma3Args {
            hidden_size: 1152,
            num_hidden_layers: 26,
            intermediate_size: 6912,
            num_attention_heads: 4,
            head_dim: 256,
            rms_norm_eps: 1e-6,
            vocab_size: 262_144,
            num_key_value_heads: 1,
            rope_theta: None,
            rope_local_base_freq: None,
            query_pre_attn_scalar: 256.0,
            sliding_window: 512,
            sliding_window_pattern: 6,
            max_position_embeddings: 32_768,
            rope_scaling: None,
            rope_parameters: None,
        }
    }
}

/// Gemma's RMSNorm scales by (1 + w); the sum is formed once, in w's dtype, as mlx-lm
/// forms it on every call.
fn gemma_norm(w: &mut Weights, prefix: &str, eps: f32) -> Result<RmsNorm, LoadError> {
    let mut norm = RmsNorm::load(w, prefix, eps)?;
    let one = Array::from_f32(1.0).as_dtype(norm.weight.dtype())?;
    norm.weight = one.add(&norm.weight)?;
    Ok(norm)
}

/// mlx-lm's `clip_residual`: a plain sum except in float16, where it is clipped to range.
fn clip_residual(x: &Array, y: &Array) -> R<Array> {
    if x.dtype() != Dtype::Float16 {
        return x.add(y);
    }
    let bound = Array::from_f32(65504.0);
    let sum = x
        .as_dtype(Dtype::Float32)?
        .add(y.as_dtype(Dtype::Float32)?)?;
    mlx_rs::ops::clip(&sum, (&bound.negative()?, &bound))?.as_dtype(Dtype::Float16)
}

struct Block {
    attn: Attention,
    /// `down(gelu_approx(gate) · up)`.
    mlp: Mlp,
    input_norm: RmsNorm,
    post_attn_norm: RmsNorm,
    pre_ffw_norm: RmsNorm,
    post_ffw_norm: RmsNorm,
    global: bool,
}

impl Block {
    fn forward(&self, h: &Array, mask: &crate::cache::Mask, cache: &mut dyn Cache) -> R<Array> {
        let r = self
            .attn
            .forward(&self.input_norm.forward(h)?, mask, cache)?;
        let h = clip_residual(h, &self.post_attn_norm.forward(&r)?)?;
        let r = self.mlp.forward(&self.pre_ffw_norm.forward(&h)?)?;
        clip_residual(&h, &self.post_ffw_norm.forward(&r)?)
    }
}

pub struct Gemma3 {
    args: Gemma3Args,
    embed: Embedding,
    blocks: Vec<Block>,
    head: OutputHead,
}

impl Gemma3 {
    pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Self, LoadError> {
        let a: Gemma3Args = config.parse()?;
        w.set_quantization(config.quantization.clone());
        let q_dims = a.num_attention_heads * a.head_dim;
        let mut blocks = Vec::new();
        for i in 0..a.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let global = i % a.sliding_window_pattern == a.sliding_window_pattern - 1;
            let params = a.rope_parameters.as_ref();
            let rope = if global {
                let (theta, scaling) = rope::settings(
                    a.rope_theta,
                    a.rope_scaling.as_ref(),
                    params,
                    "full_attention",
                    1_000_000.0,
                );
                let max = Some(a.max_position_embeddings);
                Rope::init(a.head_dim, theta, false, scaling.as_ref(), max)?
            } else {
                let (theta, scaling) = rope::settings(
                    a.rope_local_base_freq,
                    None,
                    params,
                    "sliding_attention",
                    1e4,
                );
                Rope::new(a.head_dim, theta, false, scaling.as_ref())?
            };
            let proj = |w: &mut Weights, name: &str, in_dims: i32| {
                Linear::load(w, &format!("{p}.{name}"), false, in_dims)
            };
            let attn = Attention {
                q_proj: proj(&mut w, "self_attn.q_proj", a.hidden_size)?,
                k_proj: proj(&mut w, "self_attn.k_proj", a.hidden_size)?,
                v_proj: proj(&mut w, "self_attn.v_proj", a.hidden_size)?,
                o_proj: proj(&mut w, "self_attn.o_proj", q_dims)?,
                q_norm: Some(gemma_norm(
                    &mut w,
                    &format!("{p}.self_attn.q_norm"),
                    a.rms_norm_eps,
                )?),
                k_norm: Some(gemma_norm(
                    &mut w,
                    &format!("{p}.self_attn.k_norm"),
                    a.rms_norm_eps,
                )?),
                n_heads: a.num_attention_heads,
                n_kv_heads: a.num_key_value_heads,
                scale: (a.query_pre_attn_scalar as f64).powf(-0.5) as f32,
                rope,
                norm_after_transpose: true,
            };
            let norm =
                |w: &mut Weights, name: &str| gemma_norm(w, &format!("{p}.{name}"), a.rms_norm_eps);
            blocks.push(Block {
                attn,
                mlp: Mlp::load(
                    &mut w,
                    &format!("{p}.mlp"),
                    false,
                    a.hidden_size,
                    a.intermediate_size,
                    Glu::GeluApprox,
                )?,
                input_norm: norm(&mut w, "input_layernorm")?,
                post_attn_norm: norm(&mut w, "post_attention_layernorm")?,
                pre_ffw_norm: norm(&mut w, "pre_feedforward_layernorm")?,
                post_ffw_norm: norm(&mut w, "post_feedforward_layernorm")?,
                global,
            });
        }
        let embed = Embedding::load(&mut w, "model.embed_tokens", a.hidden_size)?;
        let norm = gemma_norm(&mut w, "model.norm", a.rms_norm_eps)?;
        // mlx-lm's sanitize: no lm_head in the checkpoint means a tied head.
        let tied = !w.contains("lm_head.weight");
        let head = OutputHead::load(&mut w, norm, tied, a.hidden_size, None)?;
        w.ensure_consumed("gemma3_text", |_| false)?;
        Ok(Gemma3 {
            args: a,
            embed,
            blocks,
            head,
        })
    }
}

impl Gemma3 {
    /// embed(ids) · √hidden, the scale rounded through bf16 as mlx-lm rounds it.
    fn embed_scaled(&self, ids: &Array) -> R<Array> {
        let h = self.embed.forward(ids)?;
        let scale = Array::from_f32((self.args.hidden_size as f64).sqrt() as f32)
            .as_dtype(Dtype::Bfloat16)?
            .as_dtype(h.dtype())?;
        h.multiply(&scale)
    }
}

/// Segmented training: the cache-less forward in pieces (masks as `model(inputs)` makes
/// them with no cache).
impl super::Layered for Gemma3 {
    fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    fn embed_ids(&self, ids: &Array) -> R<Array> {
        self.embed_scaled(ids)
    }

    fn run_blocks(&self, h: &Array, range: std::ops::Range<usize>) -> R<Array> {
        use crate::cache::none::PassThrough;
        let n = h.shape()[1];
        let global_mask = PassThrough.make_mask(n, None)?;
        let sliding_mask = PassThrough.make_mask(n, Some(self.args.sliding_window))?;
        let mut h = h.clone();
        for block in &self.blocks[range] {
            let mask = if block.global {
                &global_mask
            } else {
                &sliding_mask
            };
            h = block.forward(&h, mask, &mut PassThrough)?;
        }
        Ok(h)
    }

    fn head_logits(&self, h: &Array) -> R<Array> {
        self.head.forward(&self.embed, h)
    }
}

impl LanguageModel for Gemma3 {
    fn model_type(&self) -> &str {
        "gemma3_text"
    }

    fn vocab_size(&self) -> usize {
        self.head.width(&self.embed)
    }

    fn activation_dtype(&self) -> mlx_rs::Dtype {
        self.embed.output_dtype()
    }

    fn linears(&self) -> Vec<(String, &Linear)> {
        block_linears(&self.blocks, |b| attn_mlp_linears(&b.attn, &b.mlp))
    }

    fn make_caches(&self) -> Vec<Box<dyn Cache>> {
        self.blocks
            .iter()
            .map(|b| layer_cache(b.global, self.args.sliding_window))
            .collect()
    }

    fn forward(&self, ids: &Array, caches: &mut [Box<dyn Cache>]) -> Result<Array, Exception> {
        let mut h = self.embed_scaled(ids)?;
        let n = ids.shape()[1];
        let pattern = self.args.sliding_window_pattern as usize;
        let global_mask = caches[pattern - 1].make_mask(n, None)?;
        let sliding_mask = if pattern > 1 {
            caches[0].make_mask(n, Some(self.args.sliding_window))?
        } else {
            crate::cache::Mask::None
        };
        for (block, cache) in self.blocks.iter().zip(caches.iter_mut()) {
            let mask = if block.global {
                &global_mask
            } else {
                &sliding_mask
            };
            h = block.forward(&h, mask, cache.as_mut())?;
        }
        self.head.forward(&self.embed, &h)
    }

    fn as_layered(&self) -> Option<&dyn super::Layered> {
        Some(self)
    }
}
