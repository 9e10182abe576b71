//! `ministral3` as mlx-lm 0.32.2 implements it (Ministral 3, and the text model of the
//! `mistral3` wrapper): Llama's pre-norm layers whose queries are scaled, after RoPE, by a
//! factor that grows with the position (Llama 4's attention temperature):
//!
//!   s(p) = 1 + β · log(1 + floor(p / original_max_position_embeddings))   (float32, then
//!          cast to the activations' dtype; β = rope_parameters.llama_4_scaling_beta)
//!   attn(x) = sdpa(rope(q) · s(positions), rope(k), v, scale head_dim^-½)
//!
//! RoPE comes from `rope_parameters` (its `rope_theta`, its kind: yarn in the released
//! checkpoints); layers named `sliding_attention` in `layer_types` attend within
//! `sliding_window` through a rotating cache. Mirrors `ministral3.py`'s `Attention`,
//! `_get_llama_4_attn_scale` and `Model.sanitize` (rotary tables dropped, tied head dropped).

use mlx_rs::error::Exception;
use mlx_rs::ops::{arange, floor, log};
use mlx_rs::{Array, Dtype};
use serde::Deserialize;

use super::decoder::{kv_cache, Decoder, Dims, Mixer, Windowed};
use super::layers::{Attention, Glu, Linear, Mlp, Rope};
use super::shard::Part;
use crate::cache::{kv_of, Cache, Mask, RopeOffset};
use crate::load::config::{ModelConfig, RopeScaling};
use crate::load::weights::Weights;
use crate::load::LoadError;

type R<T> = Result<T, Exception>;

fn yes() -> bool {
    true
}

/// mlx-lm's `ministral3.ModelArgs`.
#[derive(Debug, Clone, Deserialize)]
pub struct Ministral3Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub head_dim: Option<i32>,
    pub max_position_embeddings: Option<i32>,
    pub num_key_value_heads: Option<i32>,
    /// mlx-lm indexes it unconditionally (theta, the scaling kind, Llama 4's β).
    pub rope_parameters: RopeScaling,
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
    pub layer_types: Option<Vec<String>>,
    pub sliding_window: Option<i32>,
}

/// The two `rope_parameters` entries the query scale reads (not RoPE settings).
#[derive(Debug, Clone, Copy, Deserialize)]
struct Llama4Scaling {
    llama_4_scaling_beta: f64,
    original_max_position_embeddings: f64,
}

#[derive(Deserialize)]
struct ScalingOf {
    rope_parameters: Llama4Scaling,
}

impl Llama4Scaling {
    /// `_get_llama_4_attn_scale(L, offset, β, original_max)`: [L, 1] for one offset,
    /// [B, 1, L, 1] for one per row; in float32, cast to `dtype`.
    fn scale(&self, len: i32, offset: &RopeOffset, dtype: Dtype) -> R<Array> {
        let steps = arange::<_, i32>(None, len, None)?;
        let (positions, batched) = match offset {
            RopeOffset::Int(o) => (steps.add(Array::from_int(*o))?, false),
            RopeOffset::Array(o) if o.ndim() > 0 => (steps.add(o.expand_dims(-1)?)?, true),
            RopeOffset::Array(o) => (steps.add(o)?, false),
        };
        let span = Array::from_f32(self.original_max_position_embeddings as f32);
        let one = Array::from_f32(1.0);
        let grown = floor(positions.as_dtype(Dtype::Float32)?.divide(&span)?)?;
        let beta = Array::from_f32(self.llama_4_scaling_beta as f32);
        let scaling = one.add(beta.multiply(log(one.add(grown)?)?)?)?;
        let scaling = match batched {
            true => {
                let (b, l) = (scaling.shape()[0], scaling.shape()[1]);
                scaling.reshape(&[b, 1, l, 1])?
            }
            false => scaling.expand_dims(1)?,
        };
        scaling.as_dtype(dtype)
    }
}

/// Llama's attention with the position-dependent query scale.
pub struct ScaledAttention {
    attn: Attention,
    scaling: Llama4Scaling,
}

impl Mixer for ScaledAttention {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        let (len, dtype) = (x.shape()[1], x.dtype());
        let a = &self.attn;
        a.forward_with(x, kv_of(cache)?, |q, offset, kv| {
            let q = q.multiply(self.scaling.scale(len, offset, dtype)?)?;
            crate::model::sdpa::attend(&q, kv, a.scale, mask)
        })
    }

    fn make_cache(&self) -> Box<dyn Cache> {
        kv_cache(&self.attn.rope)
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        self.attn.named_linears().into()
    }

    fn shard(&mut self, part: Part, layer: &str) -> Result<(), LoadError> {
        self.attn.shard(part, layer)
    }
}

/// `Model.sanitize`: precomputed rotary tables dropped, the head too when tied; FP8
/// checkpoints (`weight_scale_inv`) are refused rather than dequantized.
fn sanitize(w: &mut Weights, tied: bool) -> Result<(), LoadError> {
    w.discard(|n| n.contains("self_attn.rotary_emb.inv_freq"));
    if tied {
        w.discard(|n| n == "lm_head.weight");
    }
    let fp8 = w.remaining();
    if let Some(name) = fp8.iter().find(|n| n.contains("weight_scale_inv")) {
        return Err(LoadError::Unsupported(format!(
            "ministral3: `{name}` is an FP8 block scale; this engine reads bf16 / f32 or \
             MLX-quantized checkpoints (convert the FP8 one with mlx_lm.convert first)"
        )));
    }
    Ok(())
}

/// Which layers slide (`layer_types`), checked as mlx-lm's constructor needs them.
fn sliding_layers(a: &Ministral3Args) -> Result<Vec<bool>, LoadError> {
    let n = a.num_hidden_layers as usize;
    let types = a
        .layer_types
        .clone()
        .unwrap_or_else(|| vec!["full_attention".into(); n]);
    if types.len() != n || !types.iter().any(|t| t == "full_attention") {
        return Err(LoadError::Unsupported(format!(
            "ministral3: layer_types needs one entry per layer ({n}) and at least one \
             `full_attention` (mlx-lm takes the full mask from the first), got {types:?}"
        )));
    }
    let sliding: Vec<bool> = types.iter().map(|t| t == "sliding_attention").collect();
    if sliding.iter().any(|&s| s) && a.sliding_window.is_none() {
        return Err(LoadError::Unsupported(
            "ministral3: sliding_attention layers need `sliding_window`".into(),
        ));
    }
    Ok(sliding)
}

/// The model: Llama's decoder with the scaled attention, sliding where `layer_types` says.
pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Decoder, LoadError> {
    let a: Ministral3Args = config.parse()?;
    let scaling = config.parse::<ScalingOf>()?.rope_parameters;
    let theta = a.rope_parameters.rope_theta.ok_or_else(|| {
        LoadError::Unsupported("ministral3: rope_parameters lacks rope_theta".into())
    })?;
    let sliding = sliding_layers(&a)?;
    sanitize(&mut w, a.tie_word_embeddings)?;
    let heads = a.num_attention_heads;
    let kv_heads = a.num_key_value_heads.unwrap_or(heads);
    let head_dim = a.head_dim.unwrap_or(a.hidden_size / heads);
    let h = a.hidden_size;
    let dims = Dims {
        layers: a.num_hidden_layers,
        hidden: h,
        vocab: a.vocab_size,
        rms_norm_eps: a.rms_norm_eps,
        tie_word_embeddings: a.tie_word_embeddings,
        ffn_module: "mlp",
    };
    Decoder::load(config, w, dims, |w, p, i| {
        let attn = Attention {
            scale: (head_dim as f32).powf(-0.5),
            rope: Rope::init(
                head_dim,
                theta,
                false,
                Some(&a.rope_parameters),
                a.max_position_embeddings,
            )?,
            ..Attention::load_projections(
                w,
                &format!("{p}.self_attn"),
                false,
                h,
                heads,
                kv_heads,
                head_dim,
            )?
        };
        let mixer = ScaledAttention { attn, scaling };
        let mixer: Box<dyn Mixer> = match (sliding[i as usize], a.sliding_window) {
            (true, Some(window)) => Box::new(Windowed { mixer, window }),
            _ => Box::new(mixer),
        };
        let mlp = Mlp::load(
            w,
            &format!("{p}.mlp"),
            false,
            h,
            a.intermediate_size,
            Glu::Swiglu,
        )?;
        Ok((mixer, Box::new(mlp) as _))
    })
}
