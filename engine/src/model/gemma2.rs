//! Gemma 2 (`gemma2`) as mlx-lm 0.32.2's `models/gemma2.py` computes it, on the shared
//! decoder:
//!
//!   h = embed(ids) · √hidden                                   (a Python float: weak)
//!   each layer:  h = h + post_attn_norm(attn(input_norm(h)))
//!                h = h + post_ffw_norm(mlp(pre_ffw_norm(h)))     mlp = down(gelu_tanh(gate) · up)
//!   attn:        s = (q · query_pre_attn_scalar^-½) · kᵀ,  s = tanh(s / a) · a,  softmax(s)·v
//!   logits = tanh(embedᵀ(norm(h)) / f) · f                       (always tied)
//!
//! RMSNorms scale by (1 + w), the residual sums are plain adds, and every layer attends
//! over all earlier positions through a standard cache: mlx-lm 0.32.2's gemma2 reads no
//! `sliding_window` (nor does it compile the softcaps), so neither do we. `a` is
//! `attn_logit_softcapping`, `f` `final_logit_softcapping`.

use serde::Deserialize;

use super::decoder::{Decoder, Dims, EmbedScale, Mixer, SoftcappedAttention, Style};
use super::layers::{Attention, Glu, Mlp, RmsNorm, Rope, Softcap};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;

fn theta() -> f32 {
    10_000.0
}
fn attn_cap() -> f32 {
    50.0
}
fn final_cap() -> f32 {
    30.0
}
fn pre_attn_scalar() -> f32 {
    144.0
}

/// mlx-lm's `gemma2.ModelArgs`, defaults included.
#[derive(Debug, Clone, Deserialize)]
pub struct Gemma2Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub head_dim: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub num_key_value_heads: i32,
    #[serde(default = "theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub rope_traditional: bool,
    #[serde(default = "attn_cap")]
    pub attn_logit_softcapping: f32,
    #[serde(default = "final_cap")]
    pub final_logit_softcapping: f32,
    #[serde(default = "pre_attn_scalar")]
    pub query_pre_attn_scalar: f32,
}

/// The model: Gemma's (1 + w) sandwich norms, the weak embedding scale, the eager final
/// softcap, and softcapped attention in every layer.
pub fn load(config: &ModelConfig, w: Weights) -> Result<Decoder, LoadError> {
    let a: Gemma2Args = config.parse()?;
    let dims = Dims {
        layers: a.num_hidden_layers,
        hidden: a.hidden_size,
        vocab: a.vocab_size,
        rms_norm_eps: a.rms_norm_eps,
        // `embed_tokens.as_linear`: mlx-lm's gemma2 has no lm_head.
        tie_word_embeddings: true,
        ffn_module: "mlp",
    };
    let style = Style {
        norm: RmsNorm::load_one_plus,
        sandwich: true,
        embed_scale: Some(EmbedScale {
            scale: (a.hidden_size as f64).sqrt() as f32,
            through: None,
        }),
        logit_softcap: Some(Softcap::Eager(a.final_logit_softcapping)),
        ..Style::default()
    };
    Decoder::load_styled(config, w, dims, style, |w, p, _| {
        let mixer: Box<dyn Mixer> = Box::new(SoftcappedAttention {
            attn: attention(&a, w, p)?,
            cap: a.attn_logit_softcapping,
        });
        let mlp = Mlp::load(
            w,
            &format!("{p}.mlp"),
            false,
            a.hidden_size,
            a.intermediate_size,
            Glu::GeluApprox,
        )?;
        Ok((mixer, Box::new(mlp)))
    })
}

/// A layer's projections (no biases, no q/k norms) and RoPE; scale
/// `1 / √query_pre_attn_scalar` formed in double precision as Python does.
fn attention(a: &Gemma2Args, w: &mut Weights, p: &str) -> Result<Attention, LoadError> {
    Ok(Attention {
        scale: (1.0 / (a.query_pre_attn_scalar as f64).sqrt()) as f32,
        rope: Rope::new(a.head_dim, a.rope_theta, a.rope_traditional, None)?,
        ..Attention::load_projections(
            w,
            &format!("{p}.self_attn"),
            false,
            a.hidden_size,
            a.num_attention_heads,
            a.num_key_value_heads,
            a.head_dim,
        )?
    })
}
