//! `lfm2` as mlx-lm 0.32.2 implements it (Liquid's LFM2): a plain pre-norm decoder whose
//! layers mix either by full attention or by a gated short convolution (`short_conv.rs`):
//!
//!   for each layer:  h = h + mixer(operator_norm(h))     mixer = attention | short conv
//!                    h = h + w2(swiglu(w1(x), w3(x))),  x = ffn_norm(h)
//!   logits = embed.T · embedding_norm(h)                  (always tied)
//!
//! Attention normalizes q and k per head (`q_layernorm`, `k_layernorm`) before RoPE, scale
//! head_dim^-½. The feed-forward width is `block_ff_dim`, auto-adjusted as mlx-lm does
//! (⅔, times the multiplier, rounded up to `block_multiple_of`). Which layers attend:
//! `full_attn_idxs`, else `layer_types`' `full_attention` entries.

use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;

use super::decoder::{kv_cache, Decoder, Dims, FeedForward, Mixer, Names, Style};
use super::layers::{Attention, Glu, Linear, Mlp, RmsNorm, Rope};
use super::shard::Part;
use super::short_conv::ShortConv;
use crate::cache::{kv_of, Cache, Mask};
use crate::load::config::{ModelConfig, RopeParameters};
use crate::load::weights::Weights;
use crate::load::LoadError;

type R<T> = Result<T, Exception>;

fn default_theta() -> f32 {
    1_000_000.0
}

/// mlx-lm's `lfm2.ModelArgs` (the fields this engine reads).
#[derive(Debug, Clone, Deserialize)]
pub struct Lfm2Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: Option<i32>,
    pub max_position_embeddings: i32,
    pub norm_eps: f32,
    pub conv_bias: bool,
    #[serde(rename = "conv_L_cache")]
    pub conv_l_cache: i32,
    pub block_dim: i32,
    pub block_multiple_of: i32,
    pub block_ffn_dim_multiplier: Option<f32>,
    pub block_auto_adjust_ff_dim: bool,
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
            let k = self.block_multiple_of;
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

/// Attention under LFM2's names (`out_proj`, `q_layernorm`, `k_layernorm`).
struct Lfm2Attention(Attention);

impl Mixer for Lfm2Attention {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        self.0.forward(x, mask, kv_of(cache)?)
    }

    fn make_cache(&self) -> Box<dyn Cache> {
        kv_cache(&self.0.rope)
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let a = &self.0;
        vec![
            ("self_attn.q_proj", &a.q_proj),
            ("self_attn.k_proj", &a.k_proj),
            ("self_attn.v_proj", &a.v_proj),
            ("self_attn.out_proj", &a.o_proj),
        ]
    }

    fn shard(&mut self, _part: Part, layer: &str) -> Result<(), LoadError> {
        Err(not_sharded(layer))
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
pub fn load(config: &ModelConfig, w: Weights) -> Result<Decoder, LoadError> {
    let a: Lfm2Args = config.parse()?;
    let attends = a.attends()?;
    let ff = a.ff_dim()?;
    let heads = a.num_attention_heads;
    let kv_heads = a.num_key_value_heads.unwrap_or(heads);
    let head_dim = a.hidden_size / heads;
    let dims = Dims {
        layers: a.num_hidden_layers,
        hidden: a.hidden_size,
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
                let lin = |w: &mut Weights, n: &str, in_dims: i32| {
                    Linear::load(w, &format!("{p}.self_attn.{n}"), false, in_dims)
                };
                let norm = |w: &mut Weights, n: &str| {
                    RmsNorm::load(w, &format!("{p}.self_attn.{n}"), a.norm_eps)
                };
                Box::new(Lfm2Attention(Attention {
                    q_proj: lin(w, "q_proj", a.hidden_size)?,
                    k_proj: lin(w, "k_proj", a.hidden_size)?,
                    v_proj: lin(w, "v_proj", a.hidden_size)?,
                    o_proj: lin(w, "out_proj", heads * head_dim)?,
                    q_norm: Some(norm(w, "q_layernorm")?),
                    k_norm: Some(norm(w, "k_layernorm")?),
                    n_heads: heads,
                    n_kv_heads: kv_heads,
                    scale: (head_dim as f32).powf(-0.5),
                    norm_after_transpose: false,
                    rope: Rope::init(head_dim, a.theta(), false, None, None)?,
                }))
            }
            false => Box::new(ShortConv::load(
                w,
                &format!("{p}.conv"),
                a.hidden_size,
                a.conv_l_cache,
                a.conv_bias,
            )?),
        };
        let mut ffn = |n: &str, in_dims: i32| {
            Linear::load(w, &format!("{p}.feed_forward.{n}"), false, in_dims)
        };
        let mlp = Mlp {
            gate_proj: ffn("w1", a.block_dim)?,
            up_proj: ffn("w3", a.block_dim)?,
            down_proj: ffn("w2", ff)?,
            glu: Glu::Swiglu,
        };
        Ok((mixer, Box::new(Lfm2Mlp(mlp))))
    })
}
