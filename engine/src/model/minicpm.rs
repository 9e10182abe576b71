//! MiniCPM (`minicpm`) as mlx-lm 0.32.2's `models/minicpm.py` computes it, on the shared
//! decoder:
//!
//!   h = embed(ids) · scale_emb                                   (Python floats: weak)
//!   each layer:  h = h + attn(rms_norm(h)) · s;  h = h + mlp(rms_norm(h)) · s
//!                s = scale_depth / √num_hidden_layers
//!   logits = lm_head(norm(h) / (hidden_size / dim_model_base))
//!
//! Llama's attention (head_dim = hidden / heads, RoPE by `initialize_rope`) and SwiGLU MLP.
//! mlx-lm's sanitize gives a checkpoint without `lm_head` the embedding as its head (still
//! behind the division). A tied config is refused: mlx-lm 0.32.2's sanitize then adds an
//! `lm_head` the model has no place for, and its load fails.

use serde::Deserialize;

use super::decoder::{Decoder, Dims, EmbedScale, Mixer, Residual, Style};
use super::layers::{Attention, Glu, Mlp, Rope};
use crate::load::config::{ModelConfig, RopeScaling};
use crate::load::weights::Weights;
use crate::load::LoadError;

fn theta() -> f32 {
    1_000_000.0
}

/// mlx-lm's `minicpm.ModelArgs`.
#[derive(Debug, Clone, Deserialize)]
pub struct MiniCpmArgs {
    pub hidden_size: i32,
    pub dim_model_base: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub num_key_value_heads: i32,
    pub scale_depth: f64,
    pub scale_emb: f64,
    pub max_position_embeddings: Option<i32>,
    #[serde(default = "theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

/// The model: the scaled embedding, the depth-scaled residual branches, the divided head.
pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Decoder, LoadError> {
    let a: MiniCpmArgs = config.parse()?;
    if a.tie_word_embeddings {
        return Err(LoadError::Unsupported(
            "minicpm with tie_word_embeddings: mlx-lm 0.32.2's sanitize adds an lm_head the \
             tied model has no place for, so it cannot load it either"
                .into(),
        ));
    }
    // mlx-lm's sanitize: no lm_head means the embedding's table is the head.
    if !w.is_probe() && !w.contains("lm_head.weight") {
        let table = w.take("model.embed_tokens.weight")?;
        w.insert("lm_head.weight".into(), table.clone());
        w.insert("model.embed_tokens.weight".into(), table);
    }
    let dims = Dims {
        layers: a.num_hidden_layers,
        hidden: a.hidden_size,
        vocab: a.vocab_size,
        rms_norm_eps: a.rms_norm_eps,
        tie_word_embeddings: false,
        ffn_module: "mlp",
    };
    let depth = a.scale_depth / (a.num_hidden_layers as f64).sqrt();
    let style = Style {
        embed_scale: Some(EmbedScale {
            scale: a.scale_emb as f32,
            through: None,
        }),
        residual: Residual::Scaled(depth as f32),
        head_input_divisor: Some(a.hidden_size as f64 / a.dim_model_base as f64),
        ..Style::default()
    };
    Decoder::load_styled(config, w, dims, style, |w, p, _| {
        let mixer: Box<dyn Mixer> = Box::new(attention(&a, w, p)?);
        let (h, inter) = (a.hidden_size, a.intermediate_size);
        let mlp = Mlp::load(w, &format!("{p}.mlp"), false, h, inter, Glu::Swiglu)?;
        Ok((mixer, Box::new(mlp)))
    })
}

/// Llama's attention without biases; head_dim = hidden / heads.
fn attention(a: &MiniCpmArgs, w: &mut Weights, p: &str) -> Result<Attention, LoadError> {
    let h = a.hidden_size;
    let hd = h / a.num_attention_heads;
    Ok(Attention {
        rope: Rope::init(
            hd,
            a.rope_theta,
            a.rope_traditional,
            a.rope_scaling.as_ref(),
            a.max_position_embeddings,
        )?,
        ..Attention::load_projections(
            w,
            &format!("{p}.self_attn"),
            false,
            h,
            a.num_attention_heads,
            a.num_key_value_heads,
            hd,
        )?
    })
}
