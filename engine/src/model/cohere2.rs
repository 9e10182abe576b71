//! Cohere 2 (`cohere2`, Command R7B) as mlx-lm 0.32.2's `models/cohere2.py` computes it, on
//! the shared decoder:
//!
//!   each layer:  x = layer_norm(h);  h = (attn(x) + mlp(x)) + h      (one norm, parallel)
//!   logits = embedᵀ(layer_norm(h)) · logit_scale                     (always tied)
//!
//! LayerNorms (mean-centered, bias with `layer_norm_bias`). Every `sliding_window_pattern`-th
//! layer attends globally without positions (standard cache); the others within
//! `sliding_window` (rotating cache) with traditional RoPE. Attention runs in float32 when
//! the activations are float16 (mlx-lm's cast around its SDPA). The layer is one block in
//! the mixer's place: its norm, attention and MLP; the decoder adds the block's sum to `h`
//! (a float sum is commutative, so `h + (a + f)` is mlx-lm's `a + f + h` bit for bit).

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};
use serde::Deserialize;

use super::decoder::{kv_cache, Built, Decoder, Dims, Mixer, Names, Style, Windowed};
use super::layers::{Attention, Glu, Linear, Mlp, RmsNorm, Rope};
use super::shard::Part;
use crate::cache::{kv_of, Cache, Mask};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;

/// mlx-lm's `cohere2.ModelArgs`, defaults included.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct Cohere2Args {
    pub hidden_size: i32,
    pub head_dim: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: i32,
    pub rope_theta: f32,
    pub vocab_size: i32,
    pub layer_norm_eps: f32,
    pub logit_scale: f64,
    pub attention_bias: bool,
    pub layer_norm_bias: bool,
    pub sliding_window: i32,
    pub sliding_window_pattern: i32,
}

impl Default for Cohere2Args {
    fn default() -> Self {
        Cohere2Args {
            hidden_size: 4096,
            head_dim: 128,
            num_hidden_layers: 32,
            intermediate_size: 14336,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            rope_theta: 50000.0,
            vocab_size: 256_000,
            layer_norm_eps: 1e-5,
            logit_scale: 0.0625,
            attention_bias: false,
            layer_norm_bias: false,
            sliding_window: 4096,
            sliding_window_pattern: 4,
        }
    }
}

/// One Cohere layer in the mixer's place: `attn(ln(h)) + mlp(ln(h))`.
pub struct ParallelBlock {
    input_layernorm: RmsNorm,
    attn: Attention,
    mlp: Mlp,
}

impl Mixer for ParallelBlock {
    fn forward(&self, h: &Array, mask: &Mask, cache: &mut dyn Cache) -> Result<Array, Exception> {
        let x = self.input_layernorm.forward(h)?;
        let a = &self.attn;
        let attn = a.forward_with(&x, kv_of(cache)?, |q, _, kv| {
            let q_dtype = q.dtype();
            let q = match q_dtype {
                Dtype::Float16 => q.as_dtype(Dtype::Float32)?,
                _ => q.clone(),
            };
            super::sdpa::attend(&q, kv, a.scale, mask)?.as_dtype(q_dtype)
        })?;
        attn.add(self.mlp.forward(&x)?)
    }

    fn make_cache(&self) -> Box<dyn Cache> {
        kv_cache(&self.attn.rope)
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let mut all: Vec<(&'static str, &Linear)> = self.attn.named_linears().into();
        all.extend(self.mlp.named_linears());
        all
    }

    fn shard(&mut self, _part: Part, layer: &str) -> Result<(), LoadError> {
        Err(LoadError::Unsupported(format!(
            "{layer}: cohere2 is not split across ranks"
        )))
    }
}

/// The model: parallel blocks, the LayerNorm head, the logit scale.
pub fn load(config: &ModelConfig, w: Weights) -> Result<Decoder, LoadError> {
    let a: Cohere2Args = config.parse()?;
    if a.head_dim * a.num_attention_heads != a.hidden_size {
        return Err(LoadError::Unsupported(format!(
            "cohere2: hidden_size must be divisible by num_heads (got `hidden_size`: {} and \
             `num_heads`: {})",
            a.hidden_size, a.num_attention_heads
        )));
    }
    let dims = Dims {
        layers: a.num_hidden_layers,
        hidden: a.hidden_size,
        vocab: a.vocab_size,
        rms_norm_eps: a.layer_norm_eps,
        tie_word_embeddings: true,
        ffn_module: "mlp",
    };
    let style = Style {
        norm: RmsNorm::load_layer_norm,
        // The block norms itself: no norm before it, none after.
        names: Names {
            input: "",
            post: "",
            ..Names::default()
        },
        logits_multiplier: Some(a.logit_scale),
        ..Style::default()
    };
    Decoder::load_styled(config, w, dims, style, |w, p, i| {
        let global = i % a.sliding_window_pattern == a.sliding_window_pattern - 1;
        let h = a.hidden_size;
        let block = ParallelBlock {
            attn: attention(&a, w, p, global)?,
            mlp: Mlp::load(
                w,
                &format!("{p}.mlp"),
                false,
                h,
                a.intermediate_size,
                Glu::Swiglu,
            )?,
            input_layernorm: RmsNorm::load_layer_norm(
                w,
                &format!("{p}.input_layernorm"),
                h,
                a.layer_norm_eps,
            )?,
        };
        let mixer: Box<dyn Mixer> = match global {
            true => Box::new(block),
            false => Box::new(Windowed {
                mixer: block,
                window: a.sliding_window,
            }),
        };
        Ok(Built::mixer_only(mixer))
    })
}

/// Layer attention: biases on all four projections with `attention_bias`; traditional
/// RoPE on a sliding layer, none on a global one.
fn attention(
    a: &Cohere2Args,
    w: &mut Weights,
    p: &str,
    global: bool,
) -> Result<Attention, LoadError> {
    let hd = a.head_dim;
    let rope = match global {
        true => Rope::None,
        false => Rope::new(hd, a.rope_theta, true, None)?,
    };
    Ok(Attention {
        rope,
        ..Attention::load_projections(
            w,
            &format!("{p}.self_attn"),
            a.attention_bias,
            a.hidden_size,
            a.num_attention_heads,
            a.num_key_value_heads,
            hd,
        )?
    })
}
