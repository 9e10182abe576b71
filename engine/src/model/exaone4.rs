//! EXAONE 4 (`exaone4`) as mlx-lm 0.32.2's `models/exaone4.py` computes it, on the shared
//! decoder with its post-norm layers:
//!
//!   each layer:  h = h + post_attn_norm(attn(h));  h = h + post_ffw_norm(mlp(h))
//!   attn:        q/k RMSNorms per head (before the heads move forward), RoPE, SDPA
//!   logits = head(norm(h))                                       (embedding.T when tied)
//!
//! With a `sliding_window_pattern` (e.g. "LLLG", repeated over the layers) an `L` layer
//! attends within `sliding_window` through a rotating cache with RoPE, a `G` layer
//! globally through a standard cache without positions (NoPE). Without one every layer is
//! global and rotates.

use serde::Deserialize;

use super::decoder::{Decoder, Dims, Mixer, Style, Windowed};
use super::layers::{Attention, Glu, Mlp, RmsNorm, Rope};
use crate::load::config::{ModelConfig, RopeScaling};
use crate::load::weights::Weights;
use crate::load::LoadError;

/// mlx-lm's `exaone4.ModelArgs` (every field required there; the sliding ones may be null).
#[derive(Debug, Clone, Deserialize)]
pub struct Exaone4Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub num_key_value_heads: i32,
    pub max_position_embeddings: i32,
    pub rope_theta: f32,
    pub head_dim: i32,
    pub tie_word_embeddings: bool,
    pub rope_scaling: Option<RopeScaling>,
    pub sliding_window: Option<i32>,
    pub sliding_window_pattern: Option<String>,
}

impl Exaone4Args {
    /// Layer `i`'s kind: Some(true) local, Some(false) global, None without a pattern.
    fn local(&self, i: i32) -> Option<bool> {
        let pattern = self.sliding_window_pattern.as_deref()?.as_bytes();
        Some(pattern[i as usize % pattern.len()] == b'L')
    }
}

/// The model: post-norm layers, per-head q/k norms, local / global layers by the pattern.
pub fn load(config: &ModelConfig, w: Weights) -> Result<Decoder, LoadError> {
    let a: Exaone4Args = config.parse()?;
    let window = check_pattern(&a)?;
    let dims = Dims {
        layers: a.num_hidden_layers,
        hidden: a.hidden_size,
        vocab: a.vocab_size,
        rms_norm_eps: a.rms_norm_eps,
        tie_word_embeddings: a.tie_word_embeddings,
        ffn_module: "mlp",
    };
    let style = Style {
        post_norms: true,
        ..Style::default()
    };
    Decoder::load_styled(config, w, dims, style, |w, p, i| {
        let local = a.local(i);
        let attn = attention(&a, w, p, local)?;
        let mixer: Box<dyn Mixer> = match local {
            Some(true) => Box::new(Windowed {
                mixer: attn,
                window,
            }),
            _ => Box::new(attn),
        };
        let (h, inter) = (a.hidden_size, a.intermediate_size);
        let mlp = Mlp::load(w, &format!("{p}.mlp"), false, h, inter, Glu::Swiglu)?;
        Ok((mixer, Box::new(mlp)))
    })
}

/// A pattern needs both kinds (mlx-lm looks up the first `L` and the first `G`) and a
/// window; the window (0 without a pattern).
fn check_pattern(a: &Exaone4Args) -> Result<i32, LoadError> {
    let Some(pattern) = &a.sliding_window_pattern else {
        return Ok(0);
    };
    if !(pattern.contains('L') && pattern.contains('G')) {
        return Err(LoadError::Unsupported(format!(
            "exaone4: sliding_window_pattern `{pattern}` needs an `L` and a `G` (as mlx-lm's)"
        )));
    }
    a.sliding_window.ok_or_else(|| {
        LoadError::Unsupported("exaone4: a sliding_window_pattern needs a sliding_window".into())
    })
}

/// Layer attention: no biases, q/k norms per head, RoPE by `initialize_rope` unless the
/// layer is a global one of a pattern.
fn attention(
    a: &Exaone4Args,
    w: &mut Weights,
    p: &str,
    local: Option<bool>,
) -> Result<Attention, LoadError> {
    let hd = a.head_dim;
    let norm = |w: &mut Weights, name: &str| {
        RmsNorm::load(w, &format!("{p}.self_attn.{name}"), hd, a.rms_norm_eps)
    };
    let rope = match local {
        Some(false) => Rope::None,
        _ => Rope::init(
            hd,
            a.rope_theta,
            false,
            a.rope_scaling.as_ref(),
            Some(a.max_position_embeddings),
        )?,
    };
    let attn = Attention::load_projections(
        w,
        &format!("{p}.self_attn"),
        false,
        a.hidden_size,
        a.num_attention_heads,
        a.num_key_value_heads,
        hd,
    )?;
    Ok(Attention {
        q_norm: Some(norm(w, "q_norm")?),
        k_norm: Some(norm(w, "k_norm")?),
        rope,
        ..attn
    })
}
