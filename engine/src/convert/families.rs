//! The convert rules of the families issue 38 added to `engine convert` (the dense
//! decoders beyond llama's layout, the multimodal wrappers converted for text, the
//! mixtures of experts and DeepSeek V3's latent attention): each model class's `sanitize`
//! as mlx-lm 0.32.2 runs it at convert time, its modules' `__init__` order, its
//! `nn.Linear` / `SwitchLinear` / `MultiLinear` modules beyond the common ones, and its
//! `cast_predicate` / `quant_predicate`. `family.rs` asks here for a `model_type` it does
//! not know itself.

use std::collections::BTreeMap;

use anyhow::{bail, Context, Result};
use mlx_rs::Array;
use serde_json::Value;

use crate::load::weights::Weights;
use crate::model::mla::split_kv_b_proj;
use crate::plant::{self, Defect};

/// A module's attribute names in `__init__` order, by the parent's attribute name (as in
/// `family.rs`); a parent not listed takes the common order.
pub type Children = &'static [(&'static str, &'static [&'static str])];

/// DeepSeek V3 (and its aliases): MLA's projections (q_proj without a query LoRA), then
/// GLM-4-MoE's MLPs.
const DEEPSEEK_V3: Children = &[
    (
        "self_attn",
        &[
            "q_proj",
            "q_a_proj",
            "q_a_layernorm",
            "q_b_proj",
            "kv_a_proj_with_mqa",
            "kv_a_layernorm",
            "embed_q",
            "unembed_out",
            "o_proj",
        ],
    ),
    GLM4_MOE[0],
    GLM4_MOE[1],
    GLM4_MOE[2],
    GLM4_MOE[3],
];

/// DeepSeek V3.2: V3's, its attention ending with the sparse-attention indexer.
const DEEPSEEK_V32: Children = &[
    (
        "self_attn",
        &[
            "q_proj",
            "q_a_proj",
            "q_a_layernorm",
            "q_b_proj",
            "kv_a_proj_with_mqa",
            "kv_a_layernorm",
            "embed_q",
            "unembed_out",
            "o_proj",
            "indexer",
        ],
    ),
    ("indexer", &["wq_b", "wk", "k_norm", "weights_proj"]),
    GLM4_MOE[0],
    GLM4_MOE[1],
    GLM4_MOE[2],
    GLM4_MOE[3],
];

/// Kimi K2.5: DeepSeek V3's text model under `language_model.`.
const KIMI_K25: Children = &[
    ("", &["language_model"]),
    ("language_model", &["model", "lm_head"]),
    DEEPSEEK_V3[0],
    GLM4_MOE[0],
    GLM4_MOE[1],
    GLM4_MOE[2],
    GLM4_MOE[3],
];

/// MiniCPM 3: latent attention without absorption (`kv_b_proj` kept), MLP gate, up, down.
const MINICPM3: Children = &[
    (
        "self_attn",
        &[
            "q_a_proj",
            "q_a_layernorm",
            "q_b_proj",
            "kv_a_proj_with_mqa",
            "kv_a_layernorm",
            "kv_b_proj",
            "o_proj",
        ],
    ),
    ("mlp", &["gate_proj", "up_proj", "down_proj"]),
];

/// GLM-4-MoE (its attention llama's with q/k norms): the dense MLP and the sparse block
/// (SwitchGLU, the MoEGate router, shared experts), each MLP gate, up, down.
const GLM4_MOE: Children = &[
    (
        "mlp",
        &[
            "gate_proj",
            "up_proj",
            "down_proj",
            "switch_mlp",
            "gate",
            "shared_experts",
        ],
    ),
    ("switch_mlp", &["gate_proj", "up_proj", "down_proj"]),
    ("gate", &["weight", "e_score_correction_bias"]),
    ("shared_experts", &["gate_proj", "up_proj", "down_proj"]),
];

/// ERNIE 4.5 MoE: the dense MLP gate, down, up; the sparse block's nn.Linear router first.
const ERNIE4_5_MOE: Children = &[
    (
        "mlp",
        &[
            "gate_proj",
            "down_proj",
            "up_proj",
            "gate",
            "switch_mlp",
            "shared_experts",
        ],
    ),
    ("switch_mlp", &["gate_proj", "up_proj", "down_proj"]),
    ("shared_experts", &["gate_proj", "down_proj", "up_proj"]),
];

/// Mixtral, PhiMoE, MiniMax: `block_sparse_moe` (the router, the SwitchGLU, MiniMax's
/// `e_score_correction_bias`) where llama has its MLP.
const BLOCK_SPARSE: Children = &[
    (
        "layers",
        &[
            "self_attn",
            "block_sparse_moe",
            "input_layernorm",
            "post_attention_layernorm",
        ],
    ),
    (
        "block_sparse_moe",
        &["gate", "switch_mlp", "e_score_correction_bias"],
    ),
    ("switch_mlp", &["gate_proj", "up_proj", "down_proj"]),
];

/// Qwen3-MoE: a block declares its norms before its MLP (sparse, or dense in
/// `mlp_only_layers`).
const QWEN3_MOE: Children = &[
    (
        "layers",
        &[
            "self_attn",
            "input_layernorm",
            "post_attention_layernorm",
            "mlp",
        ],
    ),
    (
        "mlp",
        &["gate", "switch_mlp", "gate_proj", "down_proj", "up_proj"],
    ),
    ("switch_mlp", &["gate_proj", "up_proj", "down_proj"]),
];

/// Qwen2-MoE: the router, the SwitchGLU, the shared expert and its gate.
const QWEN2_MOE: Children = &[
    (
        "mlp",
        &["gate", "switch_mlp", "shared_expert", "shared_expert_gate"],
    ),
    ("switch_mlp", &["gate_proj", "up_proj", "down_proj"]),
];

/// MLPs declared gate, up, down (minicpm, cohere2).
const GATE_UP_DOWN: Children = &[("mlp", &["gate_proj", "up_proj", "down_proj"])];

/// Hunyuan dense: its q/k norms are `query_layernorm` / `key_layernorm`.
const HUNYUAN: Children = &[(
    "self_attn",
    &[
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "query_layernorm",
        "key_layernorm",
    ],
)];

/// Cohere 2: one norm a block, MLP gate, up, down.
const COHERE2: Children = &[
    ("layers", &["self_attn", "mlp", "input_layernorm"]),
    ("mlp", &["gate_proj", "up_proj", "down_proj"]),
];

/// Llama 4 text: the head is `output`, the feed-forward `feed_forward` (gate, up, down).
const LLAMA4_TEXT: Children = &[
    ("", &["model", "output"]),
    (
        "layers",
        &[
            "self_attn",
            "feed_forward",
            "input_layernorm",
            "post_attention_layernorm",
        ],
    ),
    ("feed_forward", &["gate_proj", "up_proj", "down_proj"]),
];

/// Llama 4 (the multimodal wrapper): its text model under `language_model.`, the
/// feed-forward a SwiGLU or the sparse block (experts, router, shared expert).
const LLAMA4: Children = &[
    ("", &["language_model"]),
    ("language_model", &["model", "lm_head"]),
    (
        "layers",
        &[
            "self_attn",
            "feed_forward",
            "input_layernorm",
            "post_attention_layernorm",
        ],
    ),
    (
        "feed_forward",
        &[
            "gate_proj",
            "down_proj",
            "up_proj",
            "experts",
            "router",
            "shared_expert",
        ],
    ),
    ("experts", &["gate_proj", "up_proj", "down_proj"]),
];

/// gpt-oss: the model sets its norm before its layers, attention its sinks first, the MLP
/// its experts before the router.
const GPT_OSS: Children = &[
    ("model", &["embed_tokens", "norm", "layers"]),
    (
        "self_attn",
        &["sinks", "q_proj", "k_proj", "v_proj", "o_proj"],
    ),
    ("mlp", &["experts", "router"]),
    ("experts", &["gate_proj", "up_proj", "down_proj"]),
];

/// Gemma 3n: the text model under `model.language_model.`, AltUp and Laurel in each layer.
const GEMMA3N: Children = &[
    ("model", &["language_model"]),
    (
        "language_model",
        &[
            "embed_tokens",
            "layers",
            "embed_tokens_per_layer",
            "per_layer_model_projection",
            "per_layer_projection_norm",
            "altup_projections",
            "altup_unembed_projections",
            "norm",
        ],
    ),
    (
        "layers",
        &[
            "self_attn",
            "mlp",
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "altup",
            "laurel",
            "per_layer_input_gate",
            "per_layer_projection",
            "post_per_layer_input_norm",
        ],
    ),
    ("mlp", &["gate_proj", "up_proj", "down_proj"]),
    (
        "altup",
        &[
            "correct_output_scale",
            "correction_coefs",
            "prediction_coefs",
            "modality_router",
            "router_norm",
        ],
    ),
    (
        "laurel",
        &["linear_left", "linear_right", "post_laurel_norm"],
    ),
];

/// Phi-3: fused projections.
const PHI3: Children = &[
    ("self_attn", &["qkv_proj", "o_proj"]),
    ("mlp", &["gate_up_proj", "down_proj"]),
];

/// The multimodal wrappers converted for text (mistral3, qwen3_vl): the text model under
/// `language_model.`.
const WRAPPER: Children = &[
    ("", &["language_model"]),
    ("language_model", &["model", "lm_head"]),
];

/// The family's children table (None: not one of these families).
pub fn children(model_type: &str) -> Option<Children> {
    Some(match model_type {
        "deepseek_v3" | "kimi_k2" | "joyai_llm_flash" | "glm4_moe_lite" => DEEPSEEK_V3,
        "deepseek_v32" => DEEPSEEK_V32,
        "kimi_k25" => KIMI_K25,
        "minicpm3" => MINICPM3,
        "glm4_moe" => GLM4_MOE,
        "ernie4_5_moe" => ERNIE4_5_MOE,
        "mixtral" | "phimoe" | "minimax" | "minimax_m2" => BLOCK_SPARSE,
        "qwen3_moe" => QWEN3_MOE,
        "qwen2_moe" => QWEN2_MOE,
        "minicpm" => GATE_UP_DOWN,
        "cohere2" => COHERE2,
        "hunyuan_v1_dense" => HUNYUAN,
        "llama4_text" => LLAMA4_TEXT,
        "llama4" => LLAMA4,
        "gpt_oss" => GPT_OSS,
        "gemma3n" => GEMMA3N,
        "phi3" => PHI3,
        "mistral3" | "qwen3_vl" | "gemma3" | "gemma4" => WRAPPER,
        "ministral3" | "olmo3" | "seed_oss" | "exaone4" => &[],
        _ => return None,
    })
}

/// The family's `nn.Linear` / `SwitchLinear` / `MultiLinear` modules beyond the common
/// ones (DeepSeek's and GLM's MoEGate is a plain module, not among them).
pub fn extra_linears(model_type: &str) -> &'static [&'static str] {
    match model_type {
        "deepseek_v3" | "kimi_k2" | "joyai_llm_flash" | "glm4_moe_lite" | "kimi_k25" => &[
            "q_a_proj",
            "q_b_proj",
            "kv_a_proj_with_mqa",
            "embed_q",
            "unembed_out",
        ],
        "deepseek_v32" => &[
            "q_a_proj",
            "q_b_proj",
            "kv_a_proj_with_mqa",
            "embed_q",
            "unembed_out",
            "wq_b",
            "wk",
            "weights_proj",
        ],
        "minicpm3" => &["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"],
        "ernie4_5_moe" | "mixtral" | "phimoe" | "minimax" | "minimax_m2" | "qwen3_moe" => &["gate"],
        "qwen2_moe" => &["gate", "shared_expert_gate"],
        "llama4_text" => &["output"],
        "llama4" | "gpt_oss" => &["router"],
        "gemma3n" => &[
            "correction_coefs",
            "prediction_coefs",
            "modality_router",
            "linear_left",
            "linear_right",
            "altup_projections",
            "altup_unembed_projections",
        ],
        "phi3" => &["qkv_proj", "gate_up_proj"],
        _ => &[],
    }
}

/// The `cast_predicate`s: DeepSeek V3's, GLM-4-MoE's and MiniMax's keep
/// `e_score_correction_bias` in its dtype.
pub fn keeps_dtype(model_type: &str, path: &str) -> bool {
    matches!(
        model_type,
        "deepseek_v3"
            | "kimi_k2"
            | "joyai_llm_flash"
            | "glm4_moe"
            | "glm4_moe_lite"
            | "deepseek_v32"
            | "kimi_k25"
            | "minimax"
            | "minimax_m2"
    ) && path.contains("e_score_correction_bias")
}

/// The `quant_predicate`s: the router at 8 bits (MiniMax's `block_sparse_moe.gate`,
/// Qwen3-MoE's `mlp.gate`, gpt-oss's `mlp.router`).
pub fn router_at_8_bits(model_type: &str, path: &str) -> bool {
    match model_type {
        "minimax" | "minimax_m2" => path.ends_with("block_sparse_moe.gate"),
        "qwen3_moe" => path.ends_with("mlp.gate"),
        "gpt_oss" => path.ends_with("router"),
        _ => false,
    }
}

fn int(config: &Value, key: &str) -> i64 {
    config.get(key).and_then(Value::as_i64).unwrap_or(0)
}

fn flag(config: &Value, key: &str) -> bool {
    config.get(key).and_then(Value::as_bool).unwrap_or(false)
}

/// The fp8 / compressed-tensors checkpoints mlx-lm dequantizes in its sanitize, refused.
fn refuse_fp8(model_type: &str, weights: &BTreeMap<String, Array>) -> Result<()> {
    if let Some(k) = weights
        .keys()
        .find(|k| k.contains("weight_scale_inv") || k.ends_with("weight_shape"))
    {
        bail!(
            "engine convert: {model_type}: `{k}`: fp8 block-scaled and compressed-tensors int4 \
             checkpoints are not converted here (mlx-lm dequantizes them in its sanitize); \
             convert this checkpoint with `mlx_lm.convert`"
        );
    }
    Ok(())
}

/// `mx.stack` of `<prefix>.experts.{e}.<from>.<k>` for e in 0..experts into
/// `<prefix>.switch_mlp.<to>.<k>`, for k in weight, scales, biases, where expert 0 has it.
fn stack_experts(
    weights: &mut BTreeMap<String, Array>,
    prefix: &str,
    names: &[(&str, &str)],
    experts: i64,
) -> Result<()> {
    for &(from, to) in names {
        // The plant stacks the gate's experts from the up projection's and the reverse.
        let from = match (plant::is(Defect::ConvertExpertsGateUpSwapped), to) {
            (true, "gate_proj") => names
                .iter()
                .find(|n| n.1 == "up_proj")
                .map_or(from, |n| n.0),
            (true, "up_proj") => names
                .iter()
                .find(|n| n.1 == "gate_proj")
                .map_or(from, |n| n.0),
            _ => from,
        };
        for k in ["weight", "scales", "biases"] {
            if !weights.contains_key(&format!("{prefix}.experts.0.{from}.{k}")) {
                continue;
            }
            let parts = (0..experts)
                .map(|e| {
                    let name = format!("{prefix}.experts.{e}.{from}.{k}");
                    weights
                        .remove(&name)
                        .with_context(|| format!("engine convert: `{name}` is missing"))
                })
                .collect::<Result<Vec<_>>>()?;
            let stacked = mlx_rs::ops::stack(&parts, 0)?;
            weights.insert(format!("{prefix}.switch_mlp.{to}.{k}"), stacked);
        }
    }
    Ok(())
}

const W123: &[(&str, &str)] = &[("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")];
const GATE_DOWN_UP: &[(&str, &str)] = &[
    ("gate_proj", "gate_proj"),
    ("down_proj", "down_proj"),
    ("up_proj", "up_proj"),
];
const UP_DOWN_GATE: &[(&str, &str)] = &[
    ("up_proj", "up_proj"),
    ("down_proj", "down_proj"),
    ("gate_proj", "gate_proj"),
];

/// Drops `lm_head.weight` where the embedding is tied.
fn drop_tied_head(config: &Value, weights: &mut BTreeMap<String, Array>) {
    if flag(config, "tie_word_embeddings") {
        weights.remove("lm_head.weight");
    }
}

/// The model class's `sanitize` at convert time; false when `model_type` is not one of
/// these families.
pub fn sanitize(
    model_type: &str,
    config: &Value,
    weights: &mut BTreeMap<String, Array>,
) -> Result<bool> {
    match model_type {
        "ministral3" => sanitize_ministral3(config, weights)?,
        "seed_oss" | "hunyuan_v1_dense" => drop_tied_head(config, weights),
        "minicpm" => {
            if !weights.contains_key("lm_head.weight") {
                let embed = weights
                    .get("model.embed_tokens.weight")
                    .context("engine convert: minicpm: `model.embed_tokens.weight` is missing")?
                    .clone();
                weights.insert("lm_head.weight".into(), embed);
            }
        }
        "mistral3" => sanitize_mistral3(config, weights)?,
        "qwen3_vl" => sanitize_qwen3_vl(weights),
        "gemma3n" => {
            const TOWERS: [&str; 4] =
                ["vision_tower", "audio_tower", "embed_audio", "embed_vision"];
            weights.retain(|k, _| {
                let mut segs = k.split('.');
                !(segs.next() == Some("model") && segs.next().is_some_and(|s| TOWERS.contains(&s)))
            });
        }
        "gemma3" => {
            // The towers dropped; gemma3_text's sanitize drops nothing.
            weights.retain(|k, _| {
                !matches!(
                    k.split('.').next(),
                    Some("vision_tower" | "multi_modal_projector")
                )
            });
            if !weights.keys().any(|k| k.starts_with("language_model.")) {
                bail!(
                    "engine convert: gemma3: no `language_model.` tensors (mlx-lm 0.32.2's gemma3 \
                     reads its text model from there only)"
                );
            }
        }
        "olmo3" | "exaone4" | "cohere2" | "llama4_text" | "phi3" | "minicpm3" => {}
        _ => return sanitize_moe(model_type, config, weights),
    }
    Ok(true)
}

/// [`stack_experts`] under `model.layers.{l}.<module>` for each of `layers`.
fn stack_layers(
    weights: &mut BTreeMap<String, Array>,
    layers: impl IntoIterator<Item = i64>,
    module: &str,
    names: &[(&str, &str)],
    experts: i64,
) -> Result<()> {
    for l in layers {
        stack_experts(
            weights,
            &format!("model.layers.{l}.{module}"),
            names,
            experts,
        )?;
    }
    Ok(())
}

/// The mixtures of experts' sanitizes; false for another `model_type`.
fn sanitize_moe(
    model_type: &str,
    config: &Value,
    weights: &mut BTreeMap<String, Array>,
) -> Result<bool> {
    let layers = int(config, "num_hidden_layers");
    match model_type {
        "deepseek_v3" | "kimi_k2" | "joyai_llm_flash" => sanitize_deepseek_v3(config, weights)?,
        "glm4_moe_lite" | "deepseek_v32" => {
            // Every layer past the decoder's (the MTP layers) first.
            weights.retain(|k, _| {
                let parts: Vec<&str> = k.split('.').collect();
                let index = parts.get(2).and_then(|i| i.parse::<i64>().ok());
                !(parts.len() >= 3 && parts[1] == "layers" && index.is_some_and(|i| i >= layers))
            });
            if model_type == "deepseek_v32" {
                refuse_fp8(model_type, weights)?;
            }
            stack_and_split(config, weights)?;
        }
        "kimi_k25" => sanitize_kimi_k25(config, weights)?,
        "llama4" => sanitize_llama4(config, weights)?,
        "gpt_oss" => {
            // mlx-lm leaves a checkpoint with `gate_proj.weight` names as it is; Hugging
            // Face's fused, interleaved `gate_up_proj` layout is not converted here yet.
            if !weights.keys().any(|k| k.contains("gate_proj.weight")) {
                bail!(
                    "engine convert: gpt_oss: Hugging Face's fused `gate_up_proj` expert layout \
                     is not converted here yet (only checkpoints already in SwitchGLU's \
                     `gate_proj` / `up_proj` / `down_proj` layout); convert this one with \
                     `mlx_lm.convert`"
                );
            }
        }
        "glm4_moe" => {
            let experts = int(config, "n_routed_experts");
            stack_layers(weights, 0..layers, "mlp", GATE_DOWN_UP, experts)?;
            // The multi-token-prediction layer (a plain prefix test, as mlx-lm's).
            let mtp = format!("model.layers.{layers}");
            weights.retain(|k, _| !k.starts_with(&mtp));
        }
        "ernie4_5_moe" => {
            use crate::model::ernie4_5_moe::DROPPED;
            weights.retain(|k, _| !DROPPED.iter().any(|p| k.contains(p)));
            // mlx-lm stacks the weights only: a source with expert scales is quantized
            // already, refused before this.
            let experts = int(config, "moe_num_experts");
            stack_layers(weights, 0..layers, "mlp", GATE_DOWN_UP, experts)?;
        }
        "minimax" | "minimax_m2" | "mixtral" | "phimoe" => {
            if matches!(model_type, "minimax" | "minimax_m2") {
                refuse_fp8(model_type, weights)?;
            }
            if model_type == "mixtral" {
                drop_tied_head(config, weights);
            }
            let experts = int(config, "num_local_experts");
            if weights.contains_key("model.layers.0.block_sparse_moe.experts.0.w1.weight") {
                stack_layers(weights, 0..layers, "block_sparse_moe", W123, experts)?;
            }
        }
        "qwen3_moe" => {
            drop_tied_head(config, weights);
            let experts = int(config, "num_experts");
            let mut moe: Vec<i64> = weights
                .keys()
                .filter(|k| {
                    k.starts_with("model.layers.") && k.ends_with(".mlp.experts.0.up_proj.weight")
                })
                .filter_map(|k| k.split('.').nth(2)?.parse().ok())
                .collect();
            moe.sort_unstable();
            stack_layers(weights, moe, "mlp", UP_DOWN_GATE, experts)?;
        }
        "qwen2_moe" => {
            let experts = int(config, "num_experts");
            if weights.contains_key("model.layers.0.mlp.experts.0.up_proj.weight") {
                stack_layers(weights, 0..layers, "mlp", UP_DOWN_GATE, experts)?;
            }
        }
        _ => return Ok(false),
    }
    Ok(true)
}

/// Llama 4: the vision model and projector dropped; each layer's fused experts
/// (`gate_up_proj` [E, D, 2·I] split on its last axis, `down_proj` [E, I, D]) moved to
/// SwitchGLU's layout, each transposed to [E, out, in].
fn sanitize_llama4(config: &Value, weights: &mut BTreeMap<String, Array>) -> Result<()> {
    weights.retain(|k, _| !k.contains("vision_model") && !k.contains("multi_modal_projector"));
    let text = config.get("text_config").unwrap_or(&Value::Null);
    for l in 0..int(text, "num_hidden_layers") {
        let prefix = format!("language_model.model.layers.{l}.feed_forward.experts");
        if let Some(v) = weights.remove(&format!("{prefix}.gate_up_proj")) {
            let mut halves = mlx_rs::ops::split_equal(&v, 2, -1)?;
            if plant::is(Defect::ConvertExpertsGateUpSwapped) {
                halves.swap(0, 1);
            }
            weights.insert(
                format!("{prefix}.gate_proj.weight"),
                halves[0].swap_axes(1, 2)?,
            );
            weights.insert(
                format!("{prefix}.up_proj.weight"),
                halves[1].swap_axes(1, 2)?,
            );
        }
        if let Some(v) = weights.remove(&format!("{prefix}.down_proj")) {
            weights.insert(format!("{prefix}.down_proj.weight"), v.swap_axes(1, 2)?);
        }
    }
    Ok(())
}

/// DeepSeek V3: fp8 / int4 refused, experts stacked, `kv_b_proj` split into `embed_q` /
/// `unembed_out`, then layer 61 (V3's MTP layer, by that literal prefix) and the rotary
/// tables dropped.
fn sanitize_deepseek_v3(config: &Value, weights: &mut BTreeMap<String, Array>) -> Result<()> {
    refuse_fp8("deepseek_v3", weights)?;
    stack_and_split(config, weights)?;
    weights.retain(|k, _| !k.starts_with("model.layers.61") && !k.contains("rotary_emb.inv_freq"));
    Ok(())
}

/// Kimi K2.5: the towers and projectors dropped, the text model's weights sanitized as
/// DeepSeek V3's (by `text_config`) under `language_model.`.
fn sanitize_kimi_k25(config: &Value, weights: &mut BTreeMap<String, Array>) -> Result<()> {
    const TOWERS: [&str; 4] = [
        "vision_tower",
        "vision_model",
        "multi_modal_projector",
        "mm_projector",
    ];
    weights.retain(|k, _| !TOWERS.contains(&k.split('.').next().unwrap_or("")));
    let mut lm = BTreeMap::new();
    for k in weights.keys().cloned().collect::<Vec<_>>() {
        if let Some(rest) = k.strip_prefix("language_model.") {
            let v = weights.remove(&k).expect("a listed key");
            lm.insert(rest.to_string(), v);
        }
    }
    let text = config.get("text_config").unwrap_or(config);
    sanitize_deepseek_v3(text, &mut lm)?;
    weights.extend(
        lm.into_iter()
            .map(|(k, v)| (format!("language_model.{k}"), v)),
    );
    Ok(())
}

/// DeepSeek V3's and its successors' experts stacked and `kv_b_proj` split, layer by layer.
fn stack_and_split(config: &Value, weights: &mut BTreeMap<String, Array>) -> Result<()> {
    let layers = int(config, "num_hidden_layers");
    let experts = int(config, "n_routed_experts");
    let heads = int(config, "num_attention_heads") as i32;
    let nope = int(config, "qk_nope_head_dim") as i32;
    let v = int(config, "v_head_dim") as i32;
    stack_layers(weights, 0..layers, "mlp", GATE_DOWN_UP, experts)?;
    let mut w = Weights::from_tensors(std::mem::take(weights));
    for l in 0..layers {
        split_kv_b_proj(
            &mut w,
            &format!("model.layers.{l}.self_attn"),
            heads,
            nope,
            v,
        )?;
    }
    weights.extend(w.into_tensors());
    Ok(())
}

/// Ministral 3: rotary tables and a tied head dropped; its fp8 checkpoints refused (mlx-lm
/// multiplies their scales in), their `activation_scale`s dropped.
fn sanitize_ministral3(config: &Value, weights: &mut BTreeMap<String, Array>) -> Result<()> {
    weights.retain(|k, _| !k.contains("self_attn.rotary_emb.inv_freq"));
    drop_tied_head(config, weights);
    refuse_fp8("ministral3", weights)?;
    weights.retain(|k, _| !k.contains("activation_scale"));
    Ok(())
}

/// Mistral 3: the towers dropped, the text weights' names as the text model's (ministral3's
/// or llama's), sanitized by it, and put under `language_model.`.
fn sanitize_mistral3(config: &Value, weights: &mut BTreeMap<String, Array>) -> Result<()> {
    let text = config.get("text_config").cloned().unwrap_or(Value::Null);
    let text_type = text
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    if text_type == "mistral4" {
        bail!(
            "engine convert does not support mistral3 with a mistral4 text model yet; convert \
             it with `mlx_lm.convert`"
        );
    }
    let mut lm = BTreeMap::new();
    for (k, v) in std::mem::take(weights) {
        if k.contains("vision_tower") || k.contains("multi_modal_projector") {
            continue;
        }
        let k = match k.strip_prefix("model.language_model.") {
            Some(rest) => format!("model.{rest}"),
            None => k.strip_prefix("language_model.").unwrap_or(&k).to_string(),
        };
        lm.insert(k, v);
    }
    // `ModelArgs.__post_init__` sets a missing text tie to False.
    let mut text = text;
    if let Value::Object(t) = &mut text {
        t.entry("tie_word_embeddings").or_insert(Value::Bool(false));
    }
    if text_type == "ministral3" {
        sanitize_ministral3(&text, &mut lm)?;
    } else {
        lm.retain(|k, _| !k.contains("self_attn.rotary_emb.inv_freq"));
        drop_tied_head(&text, &mut lm);
    }
    weights.extend(
        lm.into_iter()
            .map(|(k, v)| (format!("language_model.{k}"), v)),
    );
    Ok(())
}

/// Qwen3-VL: the `visual` / `vision_tower` trees dropped; a nested `model.language_model`
/// becomes the whole `model` tree; every name under `language_model.`.
fn sanitize_qwen3_vl(weights: &mut BTreeMap<String, Array>) {
    let top = |k: &str| k.split('.').next().unwrap_or("").to_string();
    weights.retain(|k, _| !matches!(top(k).as_str(), "visual" | "vision_tower"));
    let nested = weights
        .keys()
        .any(|k| k.starts_with("model.language_model."));
    let mut out = BTreeMap::new();
    for (k, v) in std::mem::take(weights) {
        let k = if nested && top(&k) == "model" {
            match k.strip_prefix("model.language_model.") {
                Some(rest) => format!("model.{rest}"),
                None => continue,
            }
        } else {
            k
        };
        let k = if k.starts_with("language_model.") {
            k
        } else {
            format!("language_model.{k}")
        };
        out.insert(k, v);
    }
    *weights = out;
}

/// What building mlx-lm's model args does to the config it saves: mistral3's sets a
/// missing `text_config.tie_word_embeddings` to false; gemma3's and gemma4's set
/// `text_config.vocab_size` to the top-level one (default 262208 / 262144) and missing head
/// counts to 8 and 4 / 1 (K/V).
pub fn fix_config(model_type: &str, config: &mut serde_json::Map<String, Value>) {
    let default_vocab = if model_type == "gemma4" {
        262144
    } else {
        262208
    };
    let vocab = config
        .get("vocab_size")
        .cloned()
        .unwrap_or(Value::from(default_vocab));
    let Some(Value::Object(t)) = config.get_mut("text_config") else {
        return;
    };
    match model_type {
        "mistral3" => {
            t.entry("tie_word_embeddings").or_insert(Value::Bool(false));
        }
        "gemma3" | "gemma4" => {
            t.insert("vocab_size".into(), vocab);
            t.entry("num_attention_heads").or_insert(Value::from(8));
            let kv = if model_type == "gemma4" { 1 } else { 4 };
            t.entry("num_key_value_heads").or_insert(Value::from(kv));
        }
        _ => {}
    }
}
