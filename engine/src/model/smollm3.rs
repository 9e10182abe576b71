//! `smollm3` as mlx-lm 0.32.2 implements it (SmolLM 3): Llama's decoder where some layers
//! attend without positions — their RoPE is mlx-lm's `NoPE`, the identity.
//!
//!   for each layer i:  h = h + attn_i(rms_norm(h));  h = h + mlp(rms_norm(h))
//!   attn_i rotates q and k iff no_rope_layers[i] = 1
//!                      (default: every layer but each `no_rope_layer_interval`-th)

use serde::Deserialize;

use super::decoder::Decoder;
use super::llama::{self, LlamaArgs};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;

fn four() -> i32 {
    4
}

/// mlx-lm's `smollm3.ModelArgs`: llama's, plus which layers rotate.
#[derive(Debug, Clone, Deserialize)]
pub struct SmolLm3Args {
    #[serde(flatten)]
    pub llama: LlamaArgs,
    #[serde(default = "four")]
    pub no_rope_layer_interval: i32,
    /// One flag per layer: 1 = RoPE, 0 = none (the name is SmolLM 3's).
    pub no_rope_layers: Option<Vec<i32>>,
}

impl SmolLm3Args {
    /// `__post_init__`: the flags given, or one per layer from the interval.
    fn rotating_layers(&self) -> Result<Vec<bool>, LoadError> {
        let layers = self.llama.num_hidden_layers;
        match &self.no_rope_layers {
            Some(flags) if flags.len() != layers as usize => Err(LoadError::Unsupported(format!(
                "smollm3: no_rope_layers has {} entries for {layers} layers (it needs one \
                     per layer)",
                flags.len()
            ))),
            Some(flags) => Ok(flags.iter().map(|&f| f != 0).collect()),
            None if self.no_rope_layer_interval <= 0 => Err(LoadError::Unsupported(format!(
                "smollm3: no_rope_layer_interval must be positive, got {}",
                self.no_rope_layer_interval
            ))),
            None => Ok((0..layers)
                .map(|i| (i + 1) % self.no_rope_layer_interval != 0)
                .collect()),
        }
    }
}

/// The model: Llama's layers (and sanitize), RoPE only where the flags say.
pub fn load(config: &ModelConfig, w: Weights) -> Result<Decoder, LoadError> {
    let args: SmolLm3Args = config.parse()?;
    let rotates = args.rotating_layers()?;
    let shape = llama::llama_shape(args.llama)?;
    llama::build(config, w, &shape, |i| rotates[i as usize])
}
