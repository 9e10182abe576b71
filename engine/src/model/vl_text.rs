//! The multimodal checkpoints `mistral3` (Mistral Small 3.1, Ministral 3) and `qwen3_vl`
//! (Qwen3-VL) loaded for text, as mlx-lm 0.32.2's `mistral3.Model` / `qwen3_vl.Model` load
//! them: the language model is built from `text_config`, its tensors renamed from the
//! checkpoint's layout, the vision tower dropped; the text model is then an existing family.
//!
//!   mistral3: text family ministral3 when text_config.model_type says so, else llama
//!             (mistral4 refused); tie_word_embeddings defaults to false; names containing
//!             `vision_tower` / `multi_modal_projector` dropped, `model.language_model.X` →
//!             `model.X`, `language_model.X` → X, anything else kept
//!   qwen3_vl: text family qwen3, from text_config (or the whole config when it has none);
//!             top-level `visual.…` / `vision_tower.…` dropped; when the checkpoint has
//!             `model.language_model.…` that subtree replaces `model.…` (its `model.visual.…`
//!             goes with it); `language_model.X` → X, anything else kept. mlx-lm does not run
//!             qwen3's sanitize here, so a tied model's stored `lm_head.weight` is refused, as
//!             its strict load refuses it
//!
//! mlx-lm then prefixes every name with `language_model.`; LoRA's names carry it too.

use serde_json::Value;

use super::wrapper::{text_quantization, wrapped};
use super::{llama, ministral3, LanguageModel};
use crate::load::config::ModelConfig;
use crate::load::weights::Weights;
use crate::load::LoadError;

const LM: &str = "language_model.";

/// `mistral3.Model.sanitize`, one name (None: dropped).
fn mistral3_name(name: &str) -> Option<String> {
    if name.contains("vision_tower") || name.contains("multi_modal_projector") {
        return None;
    }
    Some(match name.strip_prefix("model.language_model.") {
        Some(rest) => format!("model.{rest}"),
        None => name.strip_prefix(LM).unwrap_or(name).to_owned(),
    })
}

/// `qwen3_vl.Model.sanitize`, one name (None: dropped); `nested` says whether the
/// checkpoint has a `model.language_model` subtree.
fn qwen3_vl_name(name: &str, nested: bool) -> Option<String> {
    let top = name.split('.').next().unwrap_or(name);
    if top == "visual" || top == "vision_tower" {
        return None;
    }
    let name = match (nested, name.strip_prefix("model.")) {
        (true, Some(rest)) => format!("model.{}", rest.strip_prefix(LM)?),
        (true, None) if name == "model" => return None,
        _ => name.to_owned(),
    };
    Some(name.strip_prefix(LM).map(str::to_owned).unwrap_or(name))
}

/// The wrapper's `text_config` (an object), or a config error naming what is missing.
fn text_section(config: &ModelConfig) -> Result<Option<serde_json::Map<String, Value>>, LoadError> {
    match config.raw.get("text_config") {
        None => Ok(None),
        Some(Value::Object(section)) => Ok(Some(section.clone())),
        Some(_) => Err(LoadError::Config {
            path: config.path.clone(),
            message: format!(
                "model_type `{}`: `text_config` is not an object",
                config.model_type
            ),
        }),
    }
}

fn text_model_config(
    config: &ModelConfig,
    text: serde_json::Map<String, Value>,
) -> Result<ModelConfig, LoadError> {
    let mut inner = ModelConfig::from_value(config.path.clone(), Value::Object(text))?;
    inner.quantization = text_quantization(config.quantization.as_ref());
    Ok(inner)
}

/// `mistral3`: ministral3 or llama behind the wrapper.
pub fn build_mistral3(
    config: &ModelConfig,
    mut w: Weights,
) -> Result<Box<dyn LanguageModel>, LoadError> {
    let mut text = text_section(config)?.ok_or_else(|| LoadError::Config {
        path: config.path.clone(),
        message: "model_type `mistral3` is a multimodal wrapper: its language model's \
                  settings are read from `text_config`, which this config lacks"
            .into(),
    })?;
    text.entry("tie_word_embeddings").or_insert(false.into());
    let family = match text.get("model_type").and_then(Value::as_str) {
        Some("ministral3") => "ministral3",
        Some("mistral4") => {
            return Err(LoadError::Unsupported(
                "mistral3 with a `mistral4` text model is not supported yet".into(),
            ))
        }
        _ => "llama",
    };
    text.insert("model_type".into(), family.into());
    let inner_config = text_model_config(config, text)?;
    // A probe lists the text model's names as Hugging Face's layout reads once renamed.
    if !w.is_probe() {
        w.rename(mistral3_name);
    }
    let inner: Box<dyn LanguageModel> = match family {
        "ministral3" => Box::new(ministral3::load(&inner_config, w)?),
        _ => Box::new(llama::load(&inner_config, w)?),
    };
    Ok(wrapped("mistral3", inner))
}

/// `qwen3_vl`: qwen3 behind the wrapper.
pub fn build_qwen3_vl(
    config: &ModelConfig,
    mut w: Weights,
) -> Result<Box<dyn LanguageModel>, LoadError> {
    let mut text = match text_section(config)? {
        Some(text) => text,
        None => config.raw.as_object().cloned().unwrap_or_default(),
    };
    text.insert("model_type".into(), "qwen3".into());
    let tied = text.get("tie_word_embeddings").and_then(Value::as_bool);
    let inner_config = text_model_config(config, text)?;
    if !w.is_probe() {
        let nested = w
            .remaining()
            .iter()
            .any(|n| n.starts_with("model.language_model."));
        w.rename(|n| qwen3_vl_name(n, nested));
        if tied == Some(true) && w.contains("lm_head.weight") {
            return Err(LoadError::Weights(
                "qwen3_vl: a tied model stores `lm_head.weight`, which mlx-lm 0.32.2's \
                 qwen3_vl does not drop (its strict load refuses the checkpoint)"
                    .into(),
            ));
        }
    }
    Ok(wrapped(
        "qwen3_vl",
        Box::new(llama::load(&inner_config, w)?),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mistral3_names_as_its_sanitize() {
        let cases = [
            (
                "model.language_model.layers.0.mlp.up_proj.weight",
                Some("model.layers.0.mlp.up_proj.weight"),
            ),
            (
                "language_model.model.norm.weight",
                Some("model.norm.weight"),
            ),
            ("language_model.lm_head.weight", Some("lm_head.weight")),
            ("lm_head.weight", Some("lm_head.weight")),
            ("model.vision_tower.patch_conv.weight", None),
            ("multi_modal_projector.linear_1.weight", None),
        ];
        for (name, want) in cases {
            assert_eq!(mistral3_name(name).as_deref(), want, "{name}");
        }
    }

    #[test]
    fn qwen3_vl_names_as_its_sanitize() {
        let nested = [
            (
                "model.language_model.layers.1.self_attn.q_norm.weight",
                Some("model.layers.1.self_attn.q_norm.weight"),
            ),
            ("model.visual.blocks.0.attn.qkv.weight", None),
            ("lm_head.weight", Some("lm_head.weight")),
            ("visual.merger.weight", None),
        ];
        for (name, want) in nested {
            assert_eq!(qwen3_vl_name(name, true).as_deref(), want, "{name}");
        }
        let flat = [
            (
                "model.layers.0.mlp.up_proj.weight",
                Some("model.layers.0.mlp.up_proj.weight"),
            ),
            (
                "language_model.model.norm.weight",
                Some("model.norm.weight"),
            ),
            ("vision_tower.x.weight", None),
            ("visual.x.weight", None),
        ];
        for (name, want) in flat {
            assert_eq!(qwen3_vl_name(name, false).as_deref(), want, "{name}");
        }
    }
}
