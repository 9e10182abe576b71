//! What mlx_lm.convert does per model family before saving: the model class's `sanitize`
//! (tensors it drops), the order of the model's parameters (`tree_flatten(model.parameters())`:
//! each module's attributes in the order its `__init__` sets them, which is the order the
//! arrays reach `mx.save_safetensors`), and which modules are `nn.Linear` / `nn.Embedding`
//! (the ones `nn.quantize` quantizes).

use std::collections::BTreeMap;
use std::path::PathBuf;

use mlx_rs::Array;
use serde_json::{json, Value};

use super::families;
use super::quant::Params;
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::model::{
    falcon_h1, granitemoehybrid, lfm2, mamba2, nemotron_h, qwen3_5, qwen3_next, registry,
};
use crate::plant::{self, Defect};

/// The attribute names of the supported families' modules, each module's in its
/// `__init__` order. A name's rank orders siblings; names of different modules never meet.
const ORDER: &[&str] = &[
    // Model
    "model",
    "lm_head",
    // LlamaModel / Qwen3Model / Gemma3Model / Gemma4TextModel
    "embed_tokens",
    "layers",
    "norm",
    "embed_tokens_per_layer",
    "per_layer_model_projection",
    "per_layer_projection_norm",
    // decoder layer
    "self_attn",
    "mlp",
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "per_layer_input_gate",
    "per_layer_projection",
    "post_per_layer_input_norm",
    "layer_scalar",
    // attention
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_norm",
    "k_norm",
    // MLP
    "gate_proj",
    "down_proj",
    "up_proj",
    // Linear / QuantizedLinear / Embedding / norms
    "weight",
    "scales",
    "biases",
    "bias",
];

/// `nn.Linear` modules (by attribute name).
const LINEAR: &[&str] = &[
    "lm_head",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "down_proj",
    "up_proj",
    "per_layer_model_projection",
    "per_layer_input_gate",
    "per_layer_projection",
];

/// `nn.Embedding` modules.
const EMBEDDING: &[&str] = &["embed_tokens", "embed_tokens_per_layer", "embeddings"];

/// A module's attribute names in its `__init__` order, for a parent whose children the
/// common [`ORDER`] does not rank (the hybrids' modules), by the parent's attribute name.
/// Modules of one name in one family merge into one list (their children never meet).
type Children = &'static [(&'static str, &'static [&'static str])];

/// Qwen 3.5 (dense and MoE, under `language_model.`) and Qwen3-Next: decoder layers, gated
/// delta nets (split or fused projections), the sparse block and its SwitchGLU.
const QWEN3_5_CHILDREN: Children = &[
    ("", &["language_model", "model", "lm_head"]),
    (
        "layers",
        &[
            "linear_attn",
            "self_attn",
            "input_layernorm",
            "post_attention_layernorm",
            "mlp",
        ],
    ),
    (
        "linear_attn",
        &[
            "conv1d",
            "in_proj_qkvz",
            "in_proj_ba",
            "in_proj_qkv",
            "in_proj_z",
            "in_proj_b",
            "in_proj_a",
            "dt_bias",
            "A_log",
            "norm",
            "out_proj",
        ],
    ),
    (
        "mlp",
        &[
            "gate",
            "switch_mlp",
            "shared_expert",
            "shared_expert_gate",
            "gate_proj",
            "down_proj",
            "up_proj",
        ],
    ),
    ("switch_mlp", &["gate_proj", "up_proj", "down_proj"]),
];

/// LFM2 and LFM2-MoE: layers of attention (`out_proj`, q/k layernorms first) or a short
/// convolution (`conv.conv` is the Conv1d: its weight and bias share the `conv` list); the
/// feed-forward lfm2's w1/w3/w2, lfm2_moe's dense MLP or its sparse block (router `gate`,
/// SwitchGLU, `expert_bias`).
const LFM2_CHILDREN: Children = &[
    ("", &["model"]),
    ("model", &["embed_tokens", "layers", "embedding_norm"]),
    (
        "layers",
        &[
            "self_attn",
            "conv",
            "feed_forward",
            "operator_norm",
            "ffn_norm",
        ],
    ),
    (
        "self_attn",
        &[
            "q_layernorm",
            "k_layernorm",
            "q_proj",
            "k_proj",
            "v_proj",
            "out_proj",
        ],
    ),
    ("conv", &["conv", "in_proj", "out_proj", "weight", "bias"]),
    (
        "feed_forward",
        &[
            "w1",
            "w3",
            "w2",
            "gate_proj",
            "up_proj",
            "down_proj",
            "gate",
            "switch_mlp",
            "expert_bias",
        ],
    ),
    ("switch_mlp", &["gate_proj", "up_proj", "down_proj"]),
];

/// Mamba-2: `backbone.`, residual blocks of a mixer and then its norm.
const MAMBA2_CHILDREN: Children = &[
    ("", &["backbone", "lm_head"]),
    ("backbone", &["embeddings", "layers", "norm_f"]),
    ("layers", &["mixer", "norm"]),
    (
        "mixer",
        &[
            "conv1d", "in_proj", "dt_bias", "A_log", "D", "norm", "out_proj",
        ],
    ),
];

/// Nemotron-H: `backbone.`, blocks of a norm and a mixer (Mamba-2, attention, MLP, or
/// Nemotron 3's mixture of experts: SwitchMLP, the router `gate` — a plain module with its
/// `weight` and `e_score_correction_bias` — the shared expert, the latent projections).
const NEMOTRON_H_CHILDREN: Children = &[
    ("", &["backbone", "lm_head"]),
    ("backbone", &["embeddings", "layers", "norm_f"]),
    ("layers", &["norm", "mixer"]),
    (
        "mixer",
        &[
            "conv1d",
            "in_proj",
            "dt_bias",
            "A_log",
            "D",
            "norm",
            "out_proj",
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "up_proj",
            "down_proj",
            "switch_mlp",
            "gate",
            "shared_experts",
            "fc1_latent_proj",
            "fc2_latent_proj",
        ],
    ),
    ("switch_mlp", &["fc1", "fc2"]),
    ("gate", &["weight", "e_score_correction_bias"]),
    ("shared_experts", &["up_proj", "down_proj"]),
];

/// Granite 4.0-H: layers of a Mamba-2 mixer or attention, then the shared MLP and the sparse
/// block (SwitchGLU, then the router's `layer`), or a dense `mlp`.
const GRANITE_H_CHILDREN: Children = &[
    ("", &["model", "lm_head"]),
    ("model", &["embed_tokens", "layers", "norm"]),
    (
        "layers",
        &[
            "input_layernorm",
            "mamba",
            "self_attn",
            "shared_mlp",
            "block_sparse_moe",
            "mlp",
            "post_attention_layernorm",
        ],
    ),
    (
        "mamba",
        &[
            "conv1d", "in_proj", "dt_bias", "A_log", "D", "norm", "out_proj",
        ],
    ),
    ("shared_mlp", &["input_linear", "output_linear"]),
    ("block_sparse_moe", &["switch_mlp", "router"]),
    ("switch_mlp", &["gate_proj", "up_proj", "down_proj"]),
    ("router", &["layer"]),
];

/// Falcon-H1: layers of the SwiGLU feed-forward (gate, up, down), the Mamba-2 mixer (its
/// optional gated `norm` before `D`), attention and the two norms.
const FALCON_H1_CHILDREN: Children = &[
    ("", &["model", "lm_head"]),
    ("model", &["embed_tokens", "layers", "final_layernorm"]),
    (
        "layers",
        &[
            "feed_forward",
            "mamba",
            "self_attn",
            "input_layernorm",
            "pre_ff_layernorm",
        ],
    ),
    ("feed_forward", &["gate_proj", "up_proj", "down_proj"]),
    (
        "mamba",
        &[
            "conv1d", "in_proj", "dt_bias", "A_log", "norm", "D", "out_proj",
        ],
    ),
];

/// Gemma 2: a block declares its post-attention norm last.
const GEMMA2_CHILDREN: Children = &[(
    "layers",
    &[
        "self_attn",
        "mlp",
        "input_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
        "post_attention_layernorm",
    ],
)];

fn children(model_type: &str) -> Children {
    if let Some(table) = families::children(model_type) {
        return table;
    }
    match model_type {
        "gemma2" => GEMMA2_CHILDREN,
        "qwen3_5" | "qwen3_5_moe" | "qwen3_next" => QWEN3_5_CHILDREN,
        "lfm2" | "lfm2_moe" => LFM2_CHILDREN,
        "nemotron_h" => NEMOTRON_H_CHILDREN,
        "granitemoehybrid" => GRANITE_H_CHILDREN,
        "falcon_h1" => FALCON_H1_CHILDREN,
        "mamba2" => MAMBA2_CHILDREN,
        _ => &[],
    }
}

/// The family's `nn.Linear` / `SwitchLinear` modules beyond [`LINEAR`].
fn extra_linears(model_type: &str) -> &'static [&'static str] {
    match model_type {
        "qwen3_5" | "qwen3_5_moe" | "qwen3_next" => &[
            "in_proj_qkvz",
            "in_proj_ba",
            "in_proj_qkv",
            "in_proj_z",
            "in_proj_b",
            "in_proj_a",
            "out_proj",
            "gate",
            "shared_expert_gate",
        ],
        "lfm2" => &["in_proj", "out_proj", "w1", "w2", "w3"],
        "lfm2_moe" => &["in_proj", "out_proj", "gate"],
        "granitemoehybrid" => &[
            "in_proj",
            "out_proj",
            "input_linear",
            "output_linear",
            "layer",
        ],
        "nemotron_h" => &[
            "in_proj",
            "out_proj",
            "fc1",
            "fc2",
            "fc1_latent_proj",
            "fc2_latent_proj",
        ],
        "falcon_h1" | "mamba2" => &["in_proj", "out_proj"],
        _ => families::extra_linears(model_type),
    }
}

/// The refusal for a `model_type` the registry does not mark convertible, or a variant of one that convert
/// does not lay out yet (the mixture-of-experts Gemma 4: expert stacks, router order).
pub fn check_supported(model_type: &str, config: &Value) -> anyhow::Result<()> {
    if !registry::has(model_type, |f| f.convert) {
        anyhow::bail!(
            "{}",
            registry::refusal(model_type, registry::Capability::Convert)
        )
    }
    let text = config.get("text_config").unwrap_or(&Value::Null);
    if flag(config, "enable_moe_block") || flag(text, "enable_moe_block") {
        anyhow::bail!(
            "engine convert does not support {model_type} with `enable_moe_block` (the \
             mixture-of-experts Gemma 4) yet; convert it with `mlx_lm.convert` — the engine \
             loads its output"
        )
    }
    Ok(())
}

fn flag(config: &Value, key: &str) -> bool {
    config.get(key).and_then(Value::as_bool).unwrap_or(false)
}

/// A loader's sanitize, over a checkpoint's tensors.
type Sanitize = fn(&ModelConfig, &mut Weights) -> Result<(), LoadError>;

/// The model class's `sanitize`: the tensors mlx-lm drops before loading; for the hybrids
/// the engine loader's own sanitize (kernels moved, norms offset, experts stacked, names
/// as mlx-lm's model holds them).
pub fn sanitize(
    model_type: &str,
    config: &Value,
    weights: &mut BTreeMap<String, Array>,
) -> anyhow::Result<()> {
    let hybrid: Option<Sanitize> = match model_type {
        "qwen3_5" | "qwen3_5_moe" => Some(qwen3_5::convert_sanitize),
        "qwen3_next" => Some(qwen3_next::convert_sanitize),
        "lfm2" | "lfm2_moe" => Some(lfm2::convert_sanitize),
        "nemotron_h" => Some(nemotron_h::convert_sanitize),
        "granitemoehybrid" => Some(granitemoehybrid::convert_sanitize),
        "falcon_h1" => Some(falcon_h1::convert_sanitize),
        "mamba2" => Some(|_, w| mamba2::sanitize_conv(w)),
        _ => None,
    };
    if families::sanitize(model_type, config, weights)? {
        return Ok(());
    }
    if let Some(f) = hybrid {
        let cfg = ModelConfig::from_value(PathBuf::from("config.json"), config.clone())?;
        let mut w = Weights::from_tensors(std::mem::take(weights));
        f(&cfg, &mut w)?;
        weights.extend(w.into_tensors());
        return Ok(());
    }
    sanitize_plain(model_type, config, weights);
    Ok(())
}

/// The other families' sanitize: what they drop.
fn sanitize_plain(model_type: &str, config: &Value, weights: &mut BTreeMap<String, Array>) {
    match model_type {
        "llama" | "mistral" | "qwen2" => {
            weights.retain(|k, _| !k.contains("self_attn.rotary_emb.inv_freq"));
            if flag(config, "tie_word_embeddings") {
                weights.remove("lm_head.weight");
            }
        }
        "olmo2" => weights.retain(|k, _| !k.contains("self_attn.rotary_emb.inv_freq")),
        "qwen3" if flag(config, "tie_word_embeddings") => {
            weights.remove("lm_head.weight");
        }
        "gemma4_text" => sanitize_gemma4(config, weights),
        "gemma4" => {
            // The wrapper: `model.` dropped, the towers and embedders dropped,
            // `model.language_model.X` → `language_model.model.X`, then gemma4_text's
            // sanitize by `text_config`.
            let mut renamed = BTreeMap::new();
            for (k, v) in std::mem::take(weights) {
                let Some(rest) = k.strip_prefix("model.") else {
                    if !crate::model::wrapper::GEMMA4_TOWERS
                        .iter()
                        .any(|t| k.starts_with(t))
                    {
                        renamed.insert(k, v);
                    }
                    continue;
                };
                if crate::model::wrapper::GEMMA4_TOWERS
                    .iter()
                    .any(|t| rest.starts_with(t))
                {
                    continue;
                }
                let k = if rest.starts_with("language_model") {
                    rest.replace("language_model.", "language_model.model.")
                } else {
                    rest.to_string()
                };
                renamed.insert(k, v);
            }
            *weights = renamed;
            sanitize_gemma4(config.get("text_config").unwrap_or(&Value::Null), weights);
        }
        // gemma3_text: a missing lm_head ties it (nothing dropped).
        _ => {}
    }
}

/// gemma4_text: rotary tables and activation ranges go, and the KV-shared layers' K/V
/// projections and K norm (they read an earlier layer's cache).
fn sanitize_gemma4(config: &Value, weights: &mut BTreeMap<String, Array>) {
    let int = |key: &str| config.get(key).and_then(Value::as_i64).unwrap_or(0);
    let first_shared = int("num_hidden_layers") - int("num_kv_shared_layers");
    const DROP: &[&str] = &[
        "self_attn.rotary_emb",
        "input_max",
        "input_min",
        "output_max",
        "output_min",
    ];
    const SHARED: &[&str] = &[
        ".self_attn.k_proj",
        ".self_attn.v_proj",
        ".self_attn.k_norm",
    ];
    weights.retain(|k, _| {
        if DROP.iter().any(|s| k.contains(s)) {
            return false;
        }
        if SHARED.iter().any(|s| k.contains(s)) {
            let layer = k
                .split_once("layers.")
                .and_then(|(_, rest)| rest.split('.').next())
                .and_then(|i| i.parse::<i64>().ok());
            if layer.is_some_and(|i| i >= first_shared) {
                return false;
            }
        }
        true
    });
}

/// A parameter path's sort key in `tree_flatten(model.parameters())` order: list indices
/// by number, attribute names by their `__init__` rank (among the family's children of
/// their parent, else in [`ORDER`]). Unknown names are an error.
pub fn order_key(model_type: &str, path: &str) -> anyhow::Result<Vec<usize>> {
    let table = children(model_type);
    let mut parent = "";
    path.split('.')
        .map(|seg| {
            if let Ok(i) = seg.parse::<usize>() {
                return Ok(i);
            }
            let rank = match table.iter().find(|(p, _)| *p == parent) {
                Some((_, names)) => names.iter().position(|n| *n == seg),
                None => ORDER.iter().position(|n| *n == seg),
            };
            parent = seg;
            rank.ok_or_else(|| {
                anyhow::anyhow!(
                    "engine convert: tensor `{path}` is not a parameter of the model (unknown name `{seg}`)"
                )
            })
        })
        .collect()
}

/// Whether the module at `module_path` is an `nn.Linear`, `SwitchLinear` or `nn.Embedding`
/// (what `nn.quantize` turns into a quantized layer: it has `to_quantized`; a Conv1d has not).
pub fn quantizable(model_type: &str, module_path: &str) -> bool {
    // A list's item (gemma3n's `altup_projections.0`) by the list's name.
    let name = module_path
        .rsplit('.')
        .find(|s| s.parse::<usize>().is_err())
        .unwrap_or(module_path);
    LINEAR.contains(&name) || EMBEDDING.contains(&name) || extra_linears(model_type).contains(&name)
}

/// The model class's `cast_predicate`: parameters `--dtype` leaves in their dtype
/// (qwen3_5's and nemotron_h's `A_log`, nemotron_h's `e_score_correction_bias`, lfm2_moe's
/// `expert_bias`; Qwen3-Next, granitemoehybrid and falcon_h1 have no predicate and cast all).
pub fn keeps_dtype(model_type: &str, path: &str) -> bool {
    match model_type {
        "qwen3_5" | "qwen3_5_moe" => path.ends_with("A_log"),
        "lfm2_moe" => path.contains("expert_bias"),
        "nemotron_h" => path.contains("A_log") || path.contains("e_score_correction_bias"),
        _ => families::keeps_dtype(model_type, path),
    }
}

/// The model class's `quant_predicate` (used when no mixed recipe is given) for the module
/// at `path`: its own parameters and their config entry, where they are not the top-level
/// ones. The sparse Qwens keep their routers (`mlp.gate`, `shared_expert_gate`) at 8 bits
/// in groups of 64 — affine, `to_quantized`'s default, as the entry names no mode — and so
/// do lfm2_moe (`feed_forward.gate`) and a granitemoehybrid with experts (`router.layer`).
pub fn model_quant_params(model_type: &str, config: &Value, path: &str) -> Option<(Params, Value)> {
    let text = config.get("text_config").unwrap_or(config);
    let experts = text.get("num_experts").and_then(Value::as_i64).unwrap_or(0);
    let router = match model_type {
        "qwen3_5" | "qwen3_5_moe" | "qwen3_next" => {
            let sparse = model_type == "qwen3_next" || experts > 0;
            sparse && (path.ends_with("mlp.gate") || path.ends_with("shared_expert_gate"))
        }
        "lfm2_moe" => path.ends_with("feed_forward.gate"),
        // `use_moe`: `bool(num_local_experts)`.
        "granitemoehybrid" => {
            let local = text.get("num_local_experts").and_then(Value::as_i64);
            local.unwrap_or(0) != 0 && path.ends_with("router.layer")
        }
        _ => families::router_at_8_bits(model_type, path),
    };
    // The plant quantizes the routers with the top-level parameters.
    if !router || plant::is(Defect::ConvertRouterAtTopBits) {
        return None;
    }
    let params = Params {
        group_size: Some(64),
        bits: 8,
        mode: "affine".into(),
    };
    Some((params, json!({"group_size": 64, "bits": 8})))
}

/// What building mlx-lm's model args does to the config it saves: qwen3_5's
/// `__post_init__` renames its `rope_parameters`' `rope_type` to `type` in place (the args
/// hold the config's own dict).
pub fn fix_config(model_type: &str, config: &mut serde_json::Map<String, Value>) {
    families::fix_config(model_type, config);
    if !matches!(model_type, "qwen3_5" | "qwen3_5_moe") {
        return;
    }
    let nested = matches!(config.get("text_config"), Some(Value::Object(_)));
    let text = if nested {
        match config.get_mut("text_config") {
            Some(Value::Object(t)) => t,
            _ => return,
        }
    } else {
        config
    };
    if let Some(Value::Object(rope)) = text.get_mut("rope_parameters") {
        if !rope.contains_key("type") {
            if let Some(t) = rope.shift_remove("rope_type") {
                rope.insert("type".into(), t);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_follows_the_modules() {
        let mut names = vec![
            "lm_head.weight",
            "model.norm.weight",
            "model.layers.10.mlp.up_proj.weight",
            "model.layers.2.self_attn.q_proj.bias",
            "model.layers.2.self_attn.q_proj.weight",
            "model.embed_tokens.weight",
        ];
        names.sort_by_key(|n| order_key("llama", n).unwrap());
        assert_eq!(
            names,
            [
                "model.embed_tokens.weight",
                "model.layers.2.self_attn.q_proj.weight",
                "model.layers.2.self_attn.q_proj.bias",
                "model.layers.10.mlp.up_proj.weight",
                "model.norm.weight",
                "lm_head.weight",
            ]
        );
        assert!(order_key("llama", "model.vision_tower.weight").is_err());
        assert!(check_supported("kimi_k2", &Value::Null).is_err());
    }

    #[test]
    fn hybrids_order_cast_and_quantize_as_their_classes() {
        let mut names = vec![
            "language_model.lm_head.weight",
            "language_model.model.layers.0.mlp.down_proj.weight",
            "language_model.model.layers.0.input_layernorm.weight",
            "language_model.model.layers.0.linear_attn.out_proj.weight",
            "language_model.model.layers.0.linear_attn.A_log",
            "language_model.model.layers.0.linear_attn.conv1d.weight",
            "language_model.model.embed_tokens.weight",
        ];
        names.sort_by_key(|n| order_key("qwen3_5", n).unwrap());
        assert_eq!(
            names,
            [
                "language_model.model.embed_tokens.weight",
                "language_model.model.layers.0.linear_attn.conv1d.weight",
                "language_model.model.layers.0.linear_attn.A_log",
                "language_model.model.layers.0.linear_attn.out_proj.weight",
                "language_model.model.layers.0.input_layernorm.weight",
                "language_model.model.layers.0.mlp.down_proj.weight",
                "language_model.lm_head.weight",
            ]
        );
        let mut lfm2 = vec![
            "model.layers.0.conv.conv.weight",
            "model.layers.0.operator_norm.weight",
            "model.layers.0.feed_forward.w2.weight",
            "model.layers.0.feed_forward.w3.weight",
            "model.layers.0.conv.in_proj.weight",
        ];
        lfm2.sort_by_key(|n| order_key("lfm2", n).unwrap());
        assert_eq!(
            lfm2,
            [
                "model.layers.0.conv.conv.weight",
                "model.layers.0.conv.in_proj.weight",
                "model.layers.0.feed_forward.w3.weight",
                "model.layers.0.feed_forward.w2.weight",
                "model.layers.0.operator_norm.weight",
            ]
        );
        assert!(order_key(
            "nemotron_h",
            "backbone.layers.0.mixer.experts.0.up_proj.weight"
        )
        .is_err());
        assert!(quantizable("qwen3_next", "model.layers.0.mlp.gate"));
        assert!(!quantizable(
            "qwen3_next",
            "model.layers.0.linear_attn.conv1d"
        ));
        assert!(!quantizable(
            "llama",
            "model.layers.0.linear_attn.in_proj_qkv"
        ));
        assert!(keeps_dtype(
            "qwen3_5",
            "language_model.model.layers.0.linear_attn.A_log"
        ));
        assert!(!keeps_dtype(
            "qwen3_next",
            "model.layers.0.linear_attn.A_log"
        ));
        let moe = serde_json::json!({"text_config": {"num_experts": 8}});
        let gate = model_quant_params(
            "qwen3_5_moe",
            &moe,
            "language_model.model.layers.0.mlp.gate",
        );
        assert_eq!(
            gate.unwrap().1,
            serde_json::json!({"group_size": 64, "bits": 8})
        );
        let dense = serde_json::json!({"num_experts": 0});
        assert!(model_quant_params("qwen3_5", &dense, "model.layers.0.mlp.gate").is_none());
    }

    #[test]
    fn moe_hybrids_order_cast_and_quantize_as_their_classes() {
        let mut nemotron = vec![
            "backbone.layers.1.mixer.shared_experts.down_proj.weight",
            "backbone.layers.1.mixer.gate.e_score_correction_bias",
            "backbone.layers.1.mixer.shared_experts.up_proj.weight",
            "backbone.layers.1.mixer.gate.weight",
            "backbone.layers.1.mixer.switch_mlp.fc2.weight",
            "backbone.layers.1.mixer.switch_mlp.fc1.scales",
            "backbone.layers.1.mixer.switch_mlp.fc1.weight",
        ];
        nemotron.sort_by_key(|n| order_key("nemotron_h", n).unwrap());
        assert_eq!(
            nemotron,
            [
                "backbone.layers.1.mixer.switch_mlp.fc1.weight",
                "backbone.layers.1.mixer.switch_mlp.fc1.scales",
                "backbone.layers.1.mixer.switch_mlp.fc2.weight",
                "backbone.layers.1.mixer.gate.weight",
                "backbone.layers.1.mixer.gate.e_score_correction_bias",
                "backbone.layers.1.mixer.shared_experts.up_proj.weight",
                "backbone.layers.1.mixer.shared_experts.down_proj.weight",
            ]
        );
        // The router is a plain module (no `to_quantized`), the expert stacks SwitchLinears.
        assert!(!quantizable("nemotron_h", "backbone.layers.1.mixer.gate"));
        assert!(quantizable(
            "nemotron_h",
            "backbone.layers.1.mixer.switch_mlp.fc1"
        ));
        assert!(keeps_dtype(
            "nemotron_h",
            "backbone.layers.1.mixer.gate.e_score_correction_bias"
        ));
        // Falcon-H1's mixer sets its gated norm before D.
        let mut falcon = vec![
            "model.layers.0.mamba.D",
            "model.layers.0.mamba.norm.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.feed_forward.down_proj.weight",
            "model.layers.0.feed_forward.up_proj.weight",
        ];
        falcon.sort_by_key(|n| order_key("falcon_h1", n).unwrap());
        assert_eq!(
            falcon,
            [
                "model.layers.0.feed_forward.up_proj.weight",
                "model.layers.0.feed_forward.down_proj.weight",
                "model.layers.0.mamba.norm.weight",
                "model.layers.0.mamba.D",
                "model.layers.0.self_attn.q_proj.weight",
            ]
        );
        assert!(keeps_dtype(
            "lfm2_moe",
            "model.layers.1.feed_forward.expert_bias"
        ));
        let eight = serde_json::json!({"group_size": 64, "bits": 8});
        let lfm2_moe =
            model_quant_params("lfm2_moe", &Value::Null, "model.layers.1.feed_forward.gate");
        assert_eq!(lfm2_moe.unwrap().1, eight);
        let router = "model.layers.0.block_sparse_moe.router.layer";
        let moe = serde_json::json!({"num_local_experts": 8});
        assert_eq!(
            model_quant_params("granitemoehybrid", &moe, router)
                .unwrap()
                .1,
            eight
        );
        let dense = serde_json::json!({"num_local_experts": null});
        assert!(model_quant_params("granitemoehybrid", &dense, router).is_none());
    }

    #[test]
    fn sanitize_drops_what_mlx_lm_drops() {
        let a = || Array::from_slice(&[0f32], &[1]);
        let names = |w: &BTreeMap<String, Array>| w.keys().cloned().collect::<Vec<_>>();
        let mut w: BTreeMap<String, Array> = [
            "lm_head.weight",
            "model.layers.0.self_attn.rotary_emb.inv_freq",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.1.self_attn.k_proj.weight",
            "model.layers.1.self_attn.k_norm.weight",
            "model.layers.1.self_attn.q_proj.weight",
        ]
        .into_iter()
        .map(|k| (k.to_string(), a()))
        .collect();
        let tied = serde_json::json!({"tie_word_embeddings": true});
        let mut llama = w.clone();
        sanitize("llama", &tied, &mut llama).unwrap();
        assert_eq!(names(&llama).len(), 4);
        assert!(!llama.contains_key("lm_head.weight"));
        let gemma4 = serde_json::json!({"num_hidden_layers": 2, "num_kv_shared_layers": 1});
        sanitize("gemma4_text", &gemma4, &mut w).unwrap();
        assert_eq!(
            names(&w),
            [
                "lm_head.weight",
                "model.layers.0.self_attn.k_proj.weight",
                "model.layers.1.self_attn.q_proj.weight"
            ]
        );
        assert!(check_supported("kimi_k2", &Value::Null)
            .unwrap_err()
            .to_string()
            .contains("llama, mistral"));
        let moe = serde_json::json!({"enable_moe_block": true});
        assert!(check_supported("gemma4_text", &moe)
            .unwrap_err()
            .to_string()
            .contains("mlx_lm.convert"));
    }
}
