//! What mlx_lm.convert does per model family before saving: the model class's `sanitize`
//! (tensors it drops), the order of the model's parameters (`tree_flatten(model.parameters())`:
//! each module's attributes in the order its `__init__` sets them, which is the order the
//! arrays reach `mx.save_safetensors`), and which modules are `nn.Linear` / `nn.Embedding`
//! (the ones `nn.quantize` quantizes).

use std::collections::BTreeMap;

use mlx_rs::Array;
use serde_json::Value;

use crate::model::registry;

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
const EMBEDDING: &[&str] = &["embed_tokens", "embed_tokens_per_layer"];

/// The refusal for a `model_type` the registry does not mark convertible, or a variant of one that convert
/// does not lay out yet (the mixture-of-experts Gemma 4: expert stacks, router order).
pub fn check_supported(model_type: &str, config: &Value) -> anyhow::Result<()> {
    if !registry::has(model_type, |f| f.convert) {
        anyhow::bail!(
            "engine convert does not support model_type `{model_type}` (supported: {})",
            registry::names(|f| f.convert)
        )
    }
    if flag(config, "enable_moe_block") {
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

/// The model class's `sanitize`: the tensors mlx-lm drops before loading.
pub fn sanitize(model_type: &str, config: &Value, weights: &mut BTreeMap<String, Array>) {
    match model_type {
        "llama" | "mistral" | "qwen2" => {
            weights.retain(|k, _| !k.contains("self_attn.rotary_emb.inv_freq"));
            if flag(config, "tie_word_embeddings") {
                weights.remove("lm_head.weight");
            }
        }
        "qwen3" if flag(config, "tie_word_embeddings") => {
            weights.remove("lm_head.weight");
        }
        "gemma4_text" => sanitize_gemma4(config, weights),
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
/// by number, attribute names by their `__init__` rank. Unknown names are an error.
pub fn order_key(path: &str) -> anyhow::Result<Vec<usize>> {
    path.split('.')
        .map(|seg| match seg.parse::<usize>() {
            Ok(i) => Ok(i),
            Err(_) => ORDER.iter().position(|n| *n == seg).ok_or_else(|| {
                anyhow::anyhow!(
                    "engine convert: tensor `{path}` is not a parameter of the model (unknown name `{seg}`)"
                )
            }),
        })
        .collect()
}

/// Whether the module at `module_path` is an `nn.Linear` or `nn.Embedding` (what
/// `nn.quantize` turns into a quantized layer).
pub fn quantizable(module_path: &str) -> bool {
    let name = module_path.rsplit('.').next().unwrap_or(module_path);
    LINEAR.contains(&name) || EMBEDDING.contains(&name)
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
        names.sort_by_key(|n| order_key(n).unwrap());
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
        assert!(order_key("model.vision_tower.weight").is_err());
        assert!(check_supported("phi3", &Value::Null).is_err());
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
        sanitize("llama", &tied, &mut llama);
        assert_eq!(names(&llama).len(), 4);
        assert!(!llama.contains_key("lm_head.weight"));
        let gemma4 = serde_json::json!({"num_hidden_layers": 2, "num_kv_shared_layers": 1});
        sanitize("gemma4_text", &gemma4, &mut w);
        assert_eq!(
            names(&w),
            [
                "lm_head.weight",
                "model.layers.0.self_attn.k_proj.weight",
                "model.layers.1.self_attn.q_proj.weight"
            ]
        );
        assert!(check_supported("phi3", &Value::Null)
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
