//! Gemma 3 text (`gemma3_text`) as mlx-lm 0.32.2 implements it, on the shared decoder
//! (`decoder.rs`):
//!
//!   h = embed(ids) · √hidden (the scale rounded through bf16)
//!   each layer:  h = h + post_attn_norm(attn(input_norm(h)))
//!                h = h + post_ffw_norm(mlp(pre_ffw_norm(h)))     mlp = down(gelu_tanh(gate) · up)
//!   logits = head(norm(h))                                        (tied when no lm_head)
//!
//! RMSNorms scale by (1 + w); the residual sums are mlx-lm's `clip_residual` (clipped in
//! float16). Every `sliding_window_pattern`-th layer attends globally (standard cache,
//! rope_theta); the others attend within `sliding_window` through a rotating cache
//! (rope_local_base_freq).

use mlx_rs::Dtype;
use serde::Deserialize;

use super::decoder::{Built, Decoder, Dims, EmbedScale, Mixer, Residual, Style, Windowed};
use super::layers::{Attention, Glu, Mlp, RmsNorm, Rope};
use super::rope;
use crate::load::config::{ModelConfig, RopeParameters, RopeScaling};
use crate::load::weights::Weights;
use crate::load::LoadError;

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

/// The model: the decoder with Gemma's style — (1 + w) norms, sandwich norms, clipped
/// residuals, the embedding scale — and its layers.
pub fn load(config: &ModelConfig, w: Weights) -> Result<Decoder, LoadError> {
    let a: Gemma3Args = config.parse()?;
    // mlx-lm's sanitize: no lm_head in the checkpoint means a tied head.
    let tied = !w.contains("lm_head.weight");
    let dims = Dims {
        layers: a.num_hidden_layers,
        hidden: a.hidden_size,
        vocab: a.vocab_size,
        rms_norm_eps: a.rms_norm_eps,
        tie_word_embeddings: tied,
        ffn_module: "mlp",
    };
    let style = Style {
        norm: RmsNorm::load_one_plus,
        sandwich: true,
        residual: Residual::ClipF16,
        // `mx.array(hidden_size**0.5, mx.bfloat16)`.
        embed_scale: Some(EmbedScale {
            scale: (a.hidden_size as f64).sqrt() as f32,
            through: Some(Dtype::Bfloat16),
        }),
        ..Style::default()
    };
    Decoder::load_styled(config, w, dims, style, |w, p, i| layer(&a, w, p, i))
}

/// Layer `i`: attention (global every `sliding_window_pattern`-th layer, windowed
/// otherwise) and the gelu-tanh MLP.
fn layer(a: &Gemma3Args, w: &mut Weights, p: &str, i: i32) -> Result<Built, LoadError> {
    let global = i % a.sliding_window_pattern == a.sliding_window_pattern - 1;
    let norm = |w: &mut Weights, name: &str| {
        let prefix = format!("{p}.self_attn.{name}");
        RmsNorm::load_one_plus(w, &prefix, a.head_dim, a.rms_norm_eps)
    };
    let (q_norm, k_norm) = (norm(w, "q_norm")?, norm(w, "k_norm")?);
    let attn = Attention {
        q_norm: Some(q_norm),
        k_norm: Some(k_norm),
        scale: (a.query_pre_attn_scalar as f64).powf(-0.5) as f32,
        rope: a.rope(global)?,
        norm_after_transpose: true,
        ..Attention::load_projections(
            w,
            &format!("{p}.self_attn"),
            false,
            a.hidden_size,
            a.num_attention_heads,
            a.num_key_value_heads,
            a.head_dim,
        )?
    };
    let mlp = Mlp::load(
        w,
        &format!("{p}.mlp"),
        false,
        a.hidden_size,
        a.intermediate_size,
        Glu::GeluApprox,
    )?;
    let mixer: Box<dyn Mixer> = match global {
        true => Box::new(attn),
        false => Box::new(Windowed {
            mixer: attn,
            window: a.sliding_window,
        }),
    };
    Ok((mixer, Box::new(mlp)).into())
}

impl Gemma3Args {
    /// A global layer's RoPE (rope_theta, the scaling, max positions) or a sliding one's
    /// (rope_local_base_freq, unscaled but for rope_parameters).
    fn rope(&self, global: bool) -> Result<Rope, LoadError> {
        let params = self.rope_parameters.as_ref();
        if global {
            let (theta, scaling) = rope::settings(
                self.rope_theta,
                self.rope_scaling.as_ref(),
                params,
                "full_attention",
                1_000_000.0,
            );
            let max = Some(self.max_position_embeddings);
            Rope::init(self.head_dim, theta, false, scaling.as_ref(), max)
        } else {
            let (theta, scaling) = rope::settings(
                self.rope_local_base_freq,
                None,
                params,
                "sliding_attention",
                1e4,
            );
            Rope::new(self.head_dim, theta, false, scaling.as_ref())
        }
    }
}
