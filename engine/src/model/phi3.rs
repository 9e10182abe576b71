//! `phi3` as mlx-lm 0.32.2 implements it (Phi-3, Phi-3.5, Phi-4-mini): the Llama block with
//! fused projections and SuScaled (longrope) RoPE on a share of each head.
//!
//!   q, k, v = split(qkv_proj(x))          gate, up = split(gate_up_proj(x))
//!   attn = o_proj(sdpa(rope(q), rope(k), v))    mlp = down_proj(silu(gate) · up)
//!   for each layer:  h = h + attn(rms_norm(h));  h = h + mlp(rms_norm(h))
//!   logits = head(rms_norm(h))

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::Array;
use serde::Deserialize;

use super::decoder::{kv_cache, Decoder, Dims, FeedForward, Mixer};
use super::layers::{swiglu, Linear, Rope};
use super::rope;
use super::shard::Part;
use crate::cache::{kv_of, Cache, Mask};
use crate::load::config::{ModelConfig, RopeParameters, RopeScaling};
use crate::load::weights::Weights;
use crate::load::LoadError;

type R<T> = Result<T, Exception>;

fn max_positions() -> i32 {
    131_072
}

/// mlx-lm's `phi3.ModelArgs` (defaults included), plus transformers 5's rope_parameters.
#[derive(Debug, Clone, Deserialize)]
pub struct Phi3Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub num_key_value_heads: Option<i32>,
    /// mlx-lm's default 10000 when neither the top level nor rope_parameters has it.
    pub rope_theta: Option<f32>,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<RopeScaling>,
    /// transformers 5 (mlx-lm 0.32.2 ignores it for phi3; we read it as transformers does).
    pub rope_parameters: Option<RopeParameters>,
    pub partial_rotary_factor: Option<f64>,
    #[serde(default = "max_positions")]
    pub max_position_embeddings: i32,
    pub original_max_position_embeddings: Option<f64>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

impl Phi3Args {
    /// phi3's Attention.rope: SuScaledRoPE for longrope / su, nn.RoPE for linear or none,
    /// on the first `head_dim · partial_rotary_factor` dims.
    fn rope(&self, head_dim: i32) -> Result<Rope, LoadError> {
        let params = self.rope_parameters.as_ref();
        let nested = params.and_then(|p| p.for_layer("full_attention"));
        let (theta, scaling) = rope::settings(
            self.rope_theta,
            self.rope_scaling.as_ref(),
            params,
            "full_attention",
            10_000.0,
        );
        let partial = self
            .partial_rotary_factor
            .or(nested.and_then(|p| p.partial_rotary_factor))
            .unwrap_or(1.0);
        let dims = (head_dim as f64 * partial) as i32;
        let Some(s) = scaling else {
            return Rope::new(dims, theta, self.rope_traditional, None);
        };
        match s.variant() {
            "longrope" | "su" => {
                // mlx-lm reads the top level's original_max_position_embeddings (default 4096).
                let orig = self
                    .original_max_position_embeddings
                    .or(nested.and_then(|p| p.original_max_position_embeddings))
                    .unwrap_or(4096.0);
                rope::su_scaled(dims, theta, &s, self.max_position_embeddings as f64, orig)
            }
            "linear" | "default" => Rope::new(dims, theta, self.rope_traditional, Some(&s)),
            other => Err(LoadError::Unsupported(format!(
                "phi3 rope_scaling type `{other}` is not supported (supported: longrope, su, linear)"
            ))),
        }
    }
}

/// Phi-3's attention: one fused q/k/v projection, RoPE on a share of each head.
struct Phi3Attention {
    qkv_proj: Linear,
    o_proj: Linear,
    rope: Rope,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
}

impl Mixer for Phi3Attention {
    fn forward(&self, x: &Array, mask: &Mask, cache: &mut dyn Cache) -> R<Array> {
        let cache = kv_of(cache)?;
        let (n, l) = (x.shape()[0], x.shape()[1]);
        let qkv = self.qkv_proj.forward(x)?;
        let q_end = self.heads * self.head_dim;
        let k_end = q_end + self.kv_heads * self.head_dim;
        let heads = |t: Array, h: i32| t.reshape(&[n, l, h, -1])?.transpose_axes(&[0, 2, 1, 3]);
        let q = heads(qkv.index((Ellipsis, ..q_end)), self.heads)?;
        let k = heads(qkv.index((Ellipsis, q_end..k_end)), self.kv_heads)?;
        let v = heads(qkv.index((Ellipsis, k_end..)), self.kv_heads)?;
        let offset = cache.rope_offset();
        let q = self.rope.forward(&q, &offset)?;
        let k = self.rope.forward(&k, &offset)?;
        let kv = cache.update_and_fetch(k, v)?;
        let scale = (self.head_dim as f32).powf(-0.5);
        let out = super::sdpa::attend(&q, &kv, scale, mask)?;
        self.o_proj
            .forward(&out.transpose_axes(&[0, 2, 1, 3])?.reshape(&[n, l, -1])?)
    }

    fn make_cache(&self) -> Box<dyn Cache> {
        kv_cache(&self.rope)
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        vec![
            ("self_attn.qkv_proj", &self.qkv_proj),
            ("self_attn.o_proj", &self.o_proj),
        ]
    }

    fn shard(&mut self, _part: Part, layer: &str) -> Result<(), LoadError> {
        Err(unsharded(layer))
    }
}

/// Phi-3's MLP: one fused gate/up projection.
struct Phi3Mlp {
    gate_up_proj: Linear,
    down_proj: Linear,
}

impl FeedForward for Phi3Mlp {
    fn forward(&self, x: &Array) -> R<Array> {
        let gu = self.gate_up_proj.forward(x)?;
        let half = gu.shape()[gu.ndim() - 1] / 2;
        let gate = gu.index((Ellipsis, ..half));
        let up = gu.index((Ellipsis, half..));
        self.down_proj.forward(&swiglu(&gate, &up)?)
    }

    fn linears(&self, module: &str) -> Vec<(String, &Linear)> {
        vec![
            (format!("{module}.gate_up_proj"), &self.gate_up_proj),
            (format!("{module}.down_proj"), &self.down_proj),
        ]
    }

    fn shard(&mut self, _part: Part, prefix: &str) -> Result<(), LoadError> {
        Err(unsharded(prefix))
    }
}

/// mlx-lm 0.32.2's phi3 has no `shard` (the registry refuses it before any layer).
fn unsharded(what: &str) -> LoadError {
    LoadError::Unsupported(format!("{what}: phi3 cannot run tensor parallel"))
}

/// The model: the decoder with Phi-3's layers.
pub fn load(config: &ModelConfig, w: Weights) -> Result<Decoder, LoadError> {
    let a: Phi3Args = config.parse()?;
    let heads = a.num_attention_heads;
    let kv_heads = a.num_key_value_heads.unwrap_or(heads);
    let head_dim = a.hidden_size / heads;
    let hidden = a.hidden_size;
    let dims = Dims {
        layers: a.num_hidden_layers,
        hidden,
        vocab: a.vocab_size,
        rms_norm_eps: a.rms_norm_eps,
        tie_word_embeddings: a.tie_word_embeddings,
        ffn_module: "mlp",
    };
    // The fused projections: q, k and v stacked; gate and up stacked.
    let qkv_dims = (heads + 2 * kv_heads) * head_dim;
    let inter = a.intermediate_size;
    Decoder::load(config, w, dims, |w, p, _| {
        let lin = |w: &mut Weights, name: &str, out_in: [i32; 2]| {
            Linear::load(w, &format!("{p}.{name}"), false, out_in)
        };
        let mixer: Box<dyn Mixer> = Box::new(Phi3Attention {
            qkv_proj: lin(w, "self_attn.qkv_proj", [qkv_dims, hidden])?,
            o_proj: lin(w, "self_attn.o_proj", [hidden, heads * head_dim])?,
            rope: a.rope(head_dim)?,
            heads,
            kv_heads,
            head_dim,
        });
        let ffn = Phi3Mlp {
            gate_up_proj: lin(w, "mlp.gate_up_proj", [2 * inter, hidden])?,
            down_proj: lin(w, "mlp.down_proj", [hidden, inter])?,
        };
        Ok((mixer, Box::new(ffn)))
    })
}
