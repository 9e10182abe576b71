//! mlx-lm's `gemma4_text.ModelArgs` as the engine reads it: the fields, their defaults, and
//! what they mean per layer (attention kind, RoPE parameters).

use std::collections::HashMap;

use serde::Deserialize;

use crate::load::config::RopeScaling;
use crate::load::LoadError;

/// mlx-lm's `gemma4_text.ModelArgs`, defaults included.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct Gemma4Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub head_dim: i32,
    pub global_head_dim: Option<i32>,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub vocab_size_per_layer_input: i32,
    pub num_key_value_heads: i32,
    pub num_global_key_value_heads: Option<i32>,
    pub num_kv_shared_layers: i32,
    pub hidden_size_per_layer_input: Option<i32>,
    pub rope_traditional: bool,
    pub rope_parameters: Option<HashMap<String, RopeScaling>>,
    /// initialize_rope's max_position_embeddings (dynamic, longrope).
    pub max_position_embeddings: i32,
    pub sliding_window: i32,
    pub sliding_window_pattern: i32,
    pub attention_k_eq_v: bool,
    pub final_logit_softcapping: Option<f32>,
    pub use_double_wide_mlp: bool,
    pub enable_moe_block: bool,
    /// The mixture-of-experts block (`enable_moe_block`): experts, how many route each
    /// token, and each expert's hidden width. mlx-lm has no defaults for them.
    pub num_experts: Option<i32>,
    pub top_k_experts: Option<i32>,
    pub moe_intermediate_size: Option<i32>,
    pub layer_types: Option<Vec<String>>,
    pub tie_word_embeddings: bool,
}

impl Default for Gemma4Args {
    fn default() -> Self {
        Gemma4Args {
            hidden_size: 1536,
            num_hidden_layers: 35,
            intermediate_size: 6144,
            num_attention_heads: 8,
            head_dim: 256,
            global_head_dim: Some(512),
            rms_norm_eps: 1e-6,
            vocab_size: 262_144,
            vocab_size_per_layer_input: 262_144,
            num_key_value_heads: 1,
            num_global_key_value_heads: None,
            num_kv_shared_layers: 20,
            hidden_size_per_layer_input: Some(256),
            rope_traditional: false,
            rope_parameters: None,
            max_position_embeddings: 131_072,
            sliding_window: 512,
            sliding_window_pattern: 5,
            attention_k_eq_v: false,
            final_logit_softcapping: Some(30.0),
            use_double_wide_mlp: true,
            enable_moe_block: false,
            num_experts: None,
            top_k_experts: None,
            moe_intermediate_size: None,
            layer_types: None,
            tie_word_embeddings: true,
        }
    }
}

impl Gemma4Args {
    /// Whether each layer attends globally (`layer_types`, else the sliding pattern).
    pub(super) fn full_attention(&self) -> Result<Vec<bool>, LoadError> {
        let n = self.num_hidden_layers as usize;
        match &self.layer_types {
            Some(types) => {
                if types.len() < n {
                    return Err(LoadError::Unsupported(format!(
                        "layer_types names {} layers, num_hidden_layers is {n}",
                        types.len()
                    )));
                }
                types[..n]
                    .iter()
                    .map(|t| match t.as_str() {
                        "full_attention" => Ok(true),
                        "sliding_attention" => Ok(false),
                        other => Err(LoadError::Unsupported(format!(
                            "layer type `{other}` (supported: full_attention, sliding_attention)"
                        ))),
                    })
                    .collect()
            }
            None => {
                let p = self.sliding_window_pattern.max(1) as usize;
                Ok((0..n).map(|i| i % p == p - 1).collect())
            }
        }
    }

    /// The RoPE parameters of one layer kind (mlx-lm's defaults when the config has none).
    pub(super) fn rope_for(&self, full: bool) -> RopeScaling {
        let key = if full {
            "full_attention"
        } else {
            "sliding_attention"
        };
        match &self.rope_parameters {
            Some(params) => params.get(key).cloned().unwrap_or_default(),
            None if full => RopeScaling {
                rope_type: Some("proportional".into()),
                rope_theta: Some(1_000_000.0),
                partial_rotary_factor: Some(0.25),
                ..Default::default()
            },
            None => RopeScaling {
                rope_type: Some("default".into()),
                rope_theta: Some(10_000.0),
                partial_rotary_factor: Some(1.0),
                ..Default::default()
            },
        }
    }
}
