//! OLMo 2 (`olmo2`) and OLMo 3 (`olmo3`) as mlx-lm 0.32.2's `models/olmo2.py` and
//! `models/olmo3.py` compute them, on the shared decoder with its post-norm layers:
//!
//!   h = embed(ids)
//!   each layer:  h = h + post_attn_norm(attn(h))
//!                h = h + post_ffw_norm(mlp(h))                  mlp = down(silu(gate) · up)
//!   attn:        q = q_norm(q_proj(h)), k = k_norm(k_proj(h))   (RMSNorms over the whole
//!                projection, before the heads are split), RoPE, SDPA (scale head_dim^-½)
//!   logits = head(norm(h))                                        (embedding.T when tied)
//!
//! OLMo 3 adds sliding windows: `layer_types` (default: every fourth layer full) says which
//! layers attend within `sliding_window` through a rotating cache (plain RoPE) and which
//! globally through a standard cache (RoPE with the scaling). OLMo 2's projections and MLP
//! take `attention_bias` / `mlp_bias`; OLMo 3's MLP has none.

use serde::Deserialize;

use super::decoder::{Decoder, Dims, Mixer, Style, Windowed};
use super::layers::{Attention, Glu, Mlp, RmsNorm, Rope};
use crate::load::config::{ModelConfig, RopeScaling};
use crate::load::weights::Weights;
use crate::load::LoadError;

fn theta() -> f32 {
    10_000.0
}

/// The fields of mlx-lm's `olmo2.ModelArgs` and `olmo3.ModelArgs` (olmo3 requires
/// `max_position_embeddings`, `sliding_window` and `rope_theta`; its tie default is false).
#[derive(Debug, Clone, Deserialize)]
pub struct OlmoArgs {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub head_dim: Option<i32>,
    pub max_position_embeddings: Option<i32>,
    pub num_key_value_heads: Option<i32>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    pub rope_theta: Option<f32>,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<RopeScaling>,
    pub tie_word_embeddings: Option<bool>,
    pub sliding_window: Option<i32>,
    pub layer_types: Option<Vec<String>>,
}

/// What a layer of either family needs beyond the args.
struct Kind {
    olmo3: bool,
    head_dim: i32,
    kv_heads: i32,
    /// OLMo 3: whether each layer is a sliding one, and the window.
    sliding: Vec<bool>,
    window: i32,
}

/// The model: post-norm layers (no norm before the mixer or the MLP), the whole-width q/k
/// norms, and for OLMo 3 the windowed layers.
pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Decoder, LoadError> {
    let a: OlmoArgs = config.parse()?;
    let olmo3 = config.model_type == "olmo3";
    let kind = kind(&a, olmo3)?;
    // olmo2's sanitize (olmo3 has none: such a tensor would be refused there as here).
    if !olmo3 {
        w.discard(|n| n.contains("self_attn.rotary_emb.inv_freq"));
    }
    let dims = Dims {
        layers: a.num_hidden_layers,
        hidden: a.hidden_size,
        vocab: a.vocab_size,
        rms_norm_eps: a.rms_norm_eps,
        tie_word_embeddings: a.tie_word_embeddings.unwrap_or(!olmo3),
        ffn_module: "mlp",
    };
    let style = Style {
        post_norms: true,
        ..Style::default()
    };
    Decoder::load_styled(config, w, dims, style, |w, p, i| {
        let attn = attention(&a, &kind, w, p, i)?;
        let mixer: Box<dyn Mixer> = match kind.sliding.get(i as usize) {
            Some(true) => Box::new(Windowed {
                mixer: attn,
                window: kind.window,
            }),
            _ => Box::new(attn),
        };
        let bias = a.mlp_bias && !olmo3;
        let (h, inter) = (a.hidden_size, a.intermediate_size);
        let mlp = Mlp::load(w, &format!("{p}.mlp"), bias, h, inter, Glu::Swiglu)?;
        Ok((mixer, Box::new(mlp)))
    })
}

/// `__post_init__`: KV heads default to the query heads; OLMo 3's layer types (default:
/// every fourth layer full), both kinds present as mlx-lm's `Olmo3Model` requires.
fn kind(a: &OlmoArgs, olmo3: bool) -> Result<Kind, LoadError> {
    let head_dim = a.head_dim.unwrap_or(a.hidden_size / a.num_attention_heads);
    let kv_heads = a.num_key_value_heads.unwrap_or(a.num_attention_heads);
    if !olmo3 {
        let (sliding, window) = (Vec::new(), 0);
        return Ok(Kind {
            olmo3,
            head_dim,
            kv_heads,
            sliding,
            window,
        });
    }
    let missing = |f: &str| LoadError::Unsupported(format!("olmo3: `{f}` is missing"));
    let window = a.sliding_window.ok_or_else(|| missing("sliding_window"))?;
    a.max_position_embeddings
        .ok_or_else(|| missing("max_position_embeddings"))?;
    a.rope_theta.ok_or_else(|| missing("rope_theta"))?;
    let types: Vec<String> = match &a.layer_types {
        Some(t) => t.clone(),
        None => (0..a.num_hidden_layers)
            .map(|i| match (i + 1) % 4 {
                0 => "full_attention".to_string(),
                _ => "sliding_attention".to_string(),
            })
            .collect(),
    };
    for needed in ["sliding_attention", "full_attention"] {
        if !types.iter().any(|t| t == needed) {
            return Err(LoadError::Unsupported(format!(
                "olmo3: layer_types has no `{needed}` layer (mlx-lm's Olmo3Model needs both)"
            )));
        }
    }
    let sliding = types.iter().map(|t| t != "full_attention").collect();
    Ok(Kind {
        olmo3,
        head_dim,
        kv_heads,
        sliding,
        window,
    })
}

/// Layer `i`'s attention: biased projections where `attention_bias` (o too), q/k RMSNorms
/// over the whole projection, RoPE by `initialize_rope` (an OLMo 3 sliding layer's plain).
fn attention(
    a: &OlmoArgs,
    k: &Kind,
    w: &mut Weights,
    p: &str,
    i: i32,
) -> Result<Attention, LoadError> {
    let hd = k.head_dim;
    let (q_dims, kv_dims) = (a.num_attention_heads * hd, k.kv_heads * hd);
    let norm = |w: &mut Weights, name: &str, dims: i32| {
        RmsNorm::load(w, &format!("{p}.self_attn.{name}"), dims, a.rms_norm_eps)
    };
    let sliding = k.sliding.get(i as usize) == Some(&true);
    let theta = a.rope_theta.unwrap_or(theta());
    let traditional = a.rope_traditional && !k.olmo3;
    let rope = match sliding {
        true => Rope::new(hd, theta, false, None)?,
        false => Rope::init(
            hd,
            theta,
            traditional,
            a.rope_scaling.as_ref(),
            a.max_position_embeddings,
        )?,
    };
    let attn = Attention::load_projections(
        w,
        &format!("{p}.self_attn"),
        a.attention_bias,
        a.hidden_size,
        a.num_attention_heads,
        k.kv_heads,
        hd,
    )?;
    Ok(Attention {
        q_norm: Some(norm(w, "q_norm", q_dims)?),
        k_norm: Some(norm(w, "k_norm", kv_dims)?),
        rope,
        ..attn
    })
}
