//! `mamba2` as mlx-lm 0.32.2 implements it: a pure state-space model, each layer one
//! Mamba-2 mixer (`ssm.rs`) on its own residual branch, no feed-forward:
//!
//!   for each layer:  h = h + mixer(rms_norm(h))            (the blocks' norms: eps 1e-5)
//!   logits = head(norm_f(h))                               (eps layer_norm_epsilon)
//!
//! Names are the `backbone.` ones (`backbone.embeddings`, `backbone.layers.{i}.mixer`,
//! `backbone.norm_f`); Hugging Face's [C, 1, K] conv kernels are moved to MLX's layout as
//! mlx-lm's sanitize does. `time_step_rank` is read but unused, as in mlx-lm.

use serde::Deserialize;

use super::decoder::{Built, Decoder, Dims, Names, Style};
use super::ssm::{GatedNorm, Mamba2Mixer, SsmShape};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;

/// mlx-lm's `mamba2.ModelArgs` (the fields this engine reads).
#[derive(Debug, Clone, Deserialize)]
pub struct Mamba2Args {
    pub num_heads: i32,
    pub head_dim: i32,
    pub hidden_size: i32,
    pub vocab_size: i32,
    pub state_size: i32,
    pub ssm_state_size: Option<i32>,
    pub num_hidden_layers: i32,
    pub layer_norm_epsilon: f32,
    pub conv_kernel: i32,
    pub n_groups: i32,
    pub use_bias: bool,
    pub use_conv_bias: bool,
    pub tie_word_embeddings: bool,
    /// Python's `json` writes the upper bound as `Infinity` (read as the largest double).
    pub time_step_limit: (f64, f64),
}

/// mlx-lm's `sanitize`: depthwise conv kernels in MLX's [C, K, 1] layout.
pub fn sanitize_conv(w: &mut Weights) -> Result<(), LoadError> {
    w.transform(
        |n, a| match n.contains("conv1d.weight") && a.shape().last() != Some(&1) {
            true => Ok(Some(mlx_rs::ops::move_axis(a, 2, 1)?)),
            false => Ok(None),
        },
    )
}

pub fn load(config: &ModelConfig, mut w: Weights) -> Result<Decoder, LoadError> {
    let a: Mamba2Args = config.parse()?;
    sanitize_conv(&mut w)?;
    let shape = SsmShape {
        hidden: a.hidden_size,
        heads: a.num_heads,
        head_dim: a.head_dim,
        groups: a.n_groups,
        state: a.ssm_state_size.unwrap_or(a.state_size),
        conv_kernel: a.conv_kernel,
        use_bias: a.use_bias,
        use_conv_bias: a.use_conv_bias,
        eps: a.layer_norm_epsilon,
        limits: (a.time_step_limit.0 as f32, a.time_step_limit.1 as f32),
        out_bias: a.use_bias,
        norm: GatedNorm::AfterGate,
        cast_d: false,
        scan_lengths: true,
    };
    let dims = Dims {
        layers: a.num_hidden_layers,
        hidden: a.hidden_size,
        vocab: a.vocab_size,
        rms_norm_eps: a.layer_norm_epsilon,
        tie_word_embeddings: a.tie_word_embeddings,
        ffn_module: "mlp",
    };
    let style = Style {
        names: Names::BACKBONE,
        // `nn.RMSNorm(hidden_size)`: the default eps.
        layer_norm_eps: Some(1e-5),
        ..Style::default()
    };
    Decoder::load_styled(config, w, dims, style, |w, p, _| {
        let mixer = Mamba2Mixer::load(w, &format!("{p}.mixer"), "mixer", shape)?;
        Ok(Built::mixer_only(Box::new(mixer)))
    })
}
