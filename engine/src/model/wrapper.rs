//! The multimodal wrappers `gemma3` and `gemma4` (Gemma 3 4B/12B/27B, Gemma 4 e4b/12B)
//! loaded for text, as mlx-lm 0.32.2's `gemma3.Model` / `gemma4.Model` load them: the
//! language model's settings are the config's `text_config` section, its weights are the
//! tensors under the language model's prefix, and the vision/audio towers are dropped.
//!
//!   text config = text_config + { vocab_size: the wrapper's (default 262208 / 262144),
//!                                 num_attention_heads: 8 if absent,
//!                                 num_key_value_heads: 4 (gemma3) / 1 (gemma4) if absent }
//!   gemma3 names: `vision_tower.…`, `multi_modal_projector.…` dropped;
//!                 `language_model.X` → X (X as the gemma3_text family names it)
//!   gemma4 names: a leading `model.` removed; then names starting `vision_tower`,
//!                 `multi_modal_projector`, `audio_tower`, `embed_audio`, `embed_vision`,
//!                 `vision_embedder` dropped; `model.language_model.X` → `model.X`
//!                 (Hugging Face's layout), `language_model.X` → X (mlx-community's)
//!
//! The text model is then the gemma3_text / gemma4_text family, unchanged. Anything else
//! left in the checkpoint is an error, as mlx-lm's strict load makes it one.

use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde_json::Value;

use super::gemma;
use super::gemma4;
use super::{AssistantTarget, LanguageModel, Layered};
use crate::cache::Cache;
use crate::load::config::{ModelConfig, QuantConfig};
use crate::load::weights::Weights;
use crate::load::LoadError;
use crate::plant::{self, Defect};

/// The language model's prefix after mlx-lm's sanitize, in both wrappers.
const LM: &str = "language_model.";

/// What one wrapper is: its text family and mlx-lm's `ModelArgs.__post_init__` defaults.
#[derive(Debug, Clone, Copy)]
struct Spec {
    model_type: &'static str,
    text_family: &'static str,
    vocab_size: i64,
    kv_heads: i64,
}

const GEMMA3: Spec = Spec {
    model_type: "gemma3",
    text_family: "gemma3_text",
    vocab_size: 262_208,
    kv_heads: 4,
};

const GEMMA4: Spec = Spec {
    model_type: "gemma4",
    text_family: "gemma4_text",
    vocab_size: 262_144,
    kv_heads: 1,
};

/// The wrappers this module loads.
pub const WRAPPERS: [&str; 2] = [GEMMA3.model_type, GEMMA4.model_type];

/// Where one checkpoint tensor goes.
enum Fate {
    /// Not part of the text model (a vision or audio tower, the projector).
    Dropped,
    /// The text family's name for it.
    Text(String),
    /// Neither: mlx-lm's strict load rejects it.
    Foreign,
}

/// gemma3.Model.sanitize: the `vision_tower` and `multi_modal_projector` subtrees popped,
/// the `language_model` subtree kept.
fn gemma3_fate(name: &str) -> Fate {
    if name.starts_with("vision_tower.") || name.starts_with("multi_modal_projector.") {
        return Fate::Dropped;
    }
    under_lm(name)
}

/// The towers and embedders gemma4.Model.sanitize drops (at load, and in convert).
pub(crate) const GEMMA4_TOWERS: [&str; 6] = [
    "vision_tower",
    "multi_modal_projector",
    "audio_tower",
    "embed_audio",
    "embed_vision",
    "vision_embedder",
];

/// gemma4.Model.sanitize, name by name.
fn gemma4_fate(name: &str) -> Fate {
    let stripped = name.strip_prefix("model.");
    let rest = stripped.unwrap_or(name);
    if GEMMA4_TOWERS.iter().any(|t| rest.starts_with(t)) {
        return Fate::Dropped;
    }
    match stripped {
        Some(rest) if rest.starts_with("language_model") => {
            under_lm(&rest.replace("language_model.", "language_model.model."))
        }
        Some(rest) => under_lm(rest),
        None => under_lm(name),
    }
}

/// A sanitized name: under the language model's prefix or foreign.
fn under_lm(name: &str) -> Fate {
    match name.strip_prefix(LM) {
        Some(_) if plant::is(Defect::WrapperPrefixKept) => Fate::Text(name.to_owned()),
        Some(rest) => Fate::Text(rest.to_owned()),
        None => Fate::Foreign,
    }
}

impl Spec {
    fn of(model_type: &str) -> Option<Spec> {
        match model_type {
            "gemma3" => Some(GEMMA3),
            "gemma4" => Some(GEMMA4),
            _ => None,
        }
    }

    fn fate(&self, name: &str) -> Fate {
        match self.model_type {
            "gemma3" => gemma3_fate(name),
            _ => gemma4_fate(name),
        }
    }

    /// The text family's config: `text_config` with the wrapper's vocab size and head
    /// defaults, and the wrapper's quantization map on the text model's module paths.
    fn text_config(&self, config: &ModelConfig) -> Result<ModelConfig, LoadError> {
        let problem = |message: String| LoadError::Config {
            path: config.path.clone(),
            message,
        };
        let Some(Value::Object(section)) = config.raw.get("text_config") else {
            return Err(problem(format!(
                "model_type `{}` is a multimodal wrapper: its language model's settings are \
                 read from `text_config`, which this config lacks (or is not an object)",
                self.model_type
            )));
        };
        // gemma3_text's arguments have no default model_type; mlx-lm fails without it.
        if self.model_type == "gemma3" && !section.contains_key("model_type") {
            return Err(problem(
                "`text_config` lacks `model_type` (mlx-lm's gemma3_text arguments require it)"
                    .into(),
            ));
        }
        let mut text = section.clone();
        let vocab = config.raw.get("vocab_size").cloned();
        text.insert("vocab_size".into(), vocab.unwrap_or(self.vocab_size.into()));
        text.entry("num_attention_heads").or_insert(8.into());
        text.entry("num_key_value_heads")
            .or_insert(self.kv_heads.into());
        text.insert("model_type".into(), self.text_family.into());
        let mut inner = ModelConfig::from_value(config.path.clone(), Value::Object(text))?;
        inner.quantization = text_quantization(config.quantization.as_ref());
        Ok(inner)
    }

    /// Renames the checkpoint's tensors to the text family's names; errs where mlx-lm's
    /// sanitize or strict load would.
    fn sanitize(&self, config: &ModelConfig, w: &mut Weights) -> Result<(), LoadError> {
        let files = config.path.with_file_name("model*.safetensors");
        let names = w.remaining();
        if !names.iter().any(|n| matches!(self.fate(n), Fate::Text(_))) {
            let hint = if names.iter().any(|n| n.starts_with("model.language_model.")) {
                " (these are transformers' `model.language_model.…` names, which mlx-lm 0.32.2's \
                 gemma3 does not read either)"
            } else {
                ""
            };
            return Err(LoadError::Weights(format!(
                "{}: no tensor of the language model: a {} checkpoint keeps it under \
                 `language_model.` (e.g. `language_model.model.embed_tokens.weight`){hint}",
                files.display(),
                self.model_type
            )));
        }
        let foreign: Vec<&String> = names
            .iter()
            .filter(|n| matches!(self.fate(n), Fate::Foreign))
            .collect();
        if let Some(first) = foreign.first() {
            return Err(LoadError::Weights(format!(
                "{}: {} tensors are neither under the language model's prefix nor vision/audio \
                 weights a {} checkpoint drops, e.g. `{first}`",
                files.display(),
                foreign.len(),
                self.model_type
            )));
        }
        w.rename(|n| match self.fate(n) {
            Fate::Text(name) => Some(name),
            Fate::Dropped | Fate::Foreign => None,
        });
        Ok(())
    }
}

/// A wrapper's quantization map on its text model's module paths (the `language_model.`
/// prefix dropped, the paths outside it left out).
pub(super) fn text_quantization(q: Option<&QuantConfig>) -> Option<QuantConfig> {
    q.map(|q| QuantConfig {
        default: q.default,
        per_path: q
            .per_path
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix(LM)?.to_owned(), *v)))
            .collect(),
    })
}

/// A text model behind a wrapper's `language_model.` prefix (mistral3, qwen3_vl).
pub(super) fn wrapped(
    model_type: &'static str,
    inner: Box<dyn LanguageModel>,
) -> Box<dyn LanguageModel> {
    Box::new(Wrapped { model_type, inner })
}

/// The text model behind a wrapper: everything is the text family's, except the name and
/// the layer paths LoRA reports, which carry the language model's prefix as mlx-lm's
/// module tree does (`language_model.model.layers.…`).
pub struct Wrapped {
    model_type: &'static str,
    inner: Box<dyn LanguageModel>,
}

/// Builds a wrapper's text model (`config.model_type` is `gemma3` or `gemma4`).
pub fn build(config: &ModelConfig, mut w: Weights) -> Result<Box<dyn LanguageModel>, LoadError> {
    let spec = Spec::of(&config.model_type).ok_or_else(|| {
        LoadError::Unsupported(format!(
            "model_type `{}` is not a wrapper this engine loads ({})",
            config.model_type,
            WRAPPERS.join(", ")
        ))
    })?;
    let text = spec.text_config(config)?;
    match w.is_probe() {
        // A probe lists the text model's tensors as an MLX checkpoint of the wrapper names
        // them: under the language model's prefix.
        true => w.set_probe_prefix(LM),
        false => spec.sanitize(config, &mut w)?,
    }
    let inner: Box<dyn LanguageModel> = match spec.model_type {
        "gemma3" => Box::new(gemma::load(&text, w)?),
        _ => Box::new(gemma4::load(&text, w)?),
    };
    Ok(Box::new(Wrapped {
        model_type: spec.model_type,
        inner,
    }))
}

/// gemma3's language model as the bare `Decoder`, with this wrapper's text config and
/// sanitize (the vision path, `vision::gemma3_tower`, runs it from merged embeddings).
pub(crate) fn gemma3_decoder(
    config: &ModelConfig,
    mut w: Weights,
) -> Result<super::decoder::Decoder, LoadError> {
    let text = GEMMA3.text_config(config)?;
    GEMMA3.sanitize(config, &mut w)?;
    gemma::load(&text, w)
}

/// gemma4's language model as the bare `Decoder`, with this wrapper's text config and
/// sanitize (the vision path, `vision::gemma4_tower`, runs it from merged embeddings).
pub(crate) fn gemma4_decoder(
    config: &ModelConfig,
    mut w: Weights,
) -> Result<super::decoder::Decoder, LoadError> {
    let text = GEMMA4.text_config(config)?;
    GEMMA4.sanitize(config, &mut w)?;
    gemma4::load(&text, w)
}

impl LanguageModel for Wrapped {
    fn model_type(&self) -> &str {
        self.model_type
    }

    fn activation_dtype(&self) -> mlx_rs::Dtype {
        self.inner.activation_dtype()
    }

    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    fn make_caches(&self) -> Vec<Box<dyn Cache>> {
        self.inner.make_caches()
    }

    fn forward(&self, ids: &Array, caches: &mut [Box<dyn Cache>]) -> Result<Array, Exception> {
        self.inner.forward(ids, caches)
    }

    fn linears(&self) -> Vec<(String, &super::layers::Linear)> {
        let inner = self.inner.linears().into_iter();
        inner.map(|(n, l)| (format!("{LM}{n}"), l)).collect()
    }

    fn switch_linears(&self) -> Vec<(String, &super::moe::SwitchLinear)> {
        let inner = self.inner.switch_linears().into_iter();
        inner.map(|(n, l)| (format!("{LM}{n}"), l)).collect()
    }

    /// The text model's (gemma3_text has it; its adapter names carry the prefix here too).
    fn final_hidden(&self, ids: &Array, caches: &mut [Box<dyn Cache>]) -> Result<Array, Exception> {
        self.inner.final_hidden(ids, caches)
    }

    fn as_layered(&self) -> Option<&dyn Layered> {
        self.inner.as_layered()
    }

    fn as_assistant_target(&self) -> Option<&dyn AssistantTarget> {
        self.inner.as_assistant_target()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::config::QuantParams;

    fn text(fate: Fate) -> Option<String> {
        match fate {
            Fate::Text(name) => Some(name),
            Fate::Dropped => Some("<dropped>".into()),
            Fate::Foreign => None,
        }
    }

    #[test]
    fn gemma3_names_as_its_sanitize() {
        let cases = [
            (
                "language_model.model.embed_tokens.weight",
                Some("model.embed_tokens.weight"),
            ),
            ("language_model.lm_head.weight", Some("lm_head.weight")),
            (
                "vision_tower.vision_model.post_layernorm.weight",
                Some("<dropped>"),
            ),
            (
                "multi_modal_projector.mm_input_projection_weight",
                Some("<dropped>"),
            ),
            // transformers' in-memory names: mlx-lm's gemma3 has no rule for them.
            ("model.language_model.layers.0.mlp.up_proj.weight", None),
            ("lm_head.weight", None),
        ];
        for (name, want) in cases {
            assert_eq!(text(gemma3_fate(name)).as_deref(), want, "{name}");
        }
    }

    #[test]
    fn gemma4_names_as_its_sanitize() {
        let cases = [
            (
                "model.language_model.layers.3.self_attn.k_proj.weight",
                Some("model.layers.3.self_attn.k_proj.weight"),
            ),
            (
                "language_model.model.norm.weight",
                Some("model.norm.weight"),
            ),
            ("language_model.lm_head.weight", Some("lm_head.weight")),
            (
                "model.vision_tower.encoder.layers.0.x.weight",
                Some("<dropped>"),
            ),
            (
                "model.embed_audio.embedding_projection.weight",
                Some("<dropped>"),
            ),
            ("audio_tower.layers.0.x.weight", Some("<dropped>")),
            (
                "embed_vision.embedding_projection.weight",
                Some("<dropped>"),
            ),
            ("vision_embedder.patch.weight", Some("<dropped>")),
            ("model.multi_modal_projector.x.weight", Some("<dropped>")),
            ("model.embed_tokens.weight", None),
            ("lm_head.weight", None),
        ];
        for (name, want) in cases {
            assert_eq!(text(gemma4_fate(name)).as_deref(), want, "{name}");
        }
    }

    fn config(raw: Value) -> ModelConfig {
        ModelConfig::from_value("config.json".into(), raw).unwrap()
    }

    #[test]
    fn text_config_takes_the_wrappers_vocab_and_head_defaults() {
        let bare = serde_json::json!({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "vocab_size": 7}});
        let t = GEMMA3.text_config(&config(bare)).unwrap();
        assert_eq!(t.model_type, "gemma3_text");
        assert_eq!(t.raw["vocab_size"], 262_208);
        assert_eq!(t.raw["num_attention_heads"], 8);
        assert_eq!(t.raw["num_key_value_heads"], 4);
        let given = serde_json::json!({"model_type": "gemma4", "vocab_size": 1024,
            "text_config": {"num_attention_heads": 2, "num_key_value_heads": 2}});
        let t = GEMMA4.text_config(&config(given)).unwrap();
        assert_eq!(t.model_type, "gemma4_text");
        assert_eq!(t.raw["vocab_size"], 1024);
        assert_eq!(t.raw["num_attention_heads"], 2);
        let t = GEMMA4
            .text_config(&config(
                serde_json::json!({"model_type": "gemma4", "text_config": {}}),
            ))
            .unwrap();
        assert_eq!(
            (
                t.raw["vocab_size"].clone(),
                t.raw["num_key_value_heads"].clone()
            ),
            (262_144.into(), 1.into())
        );
    }

    #[test]
    fn quantization_paths_lose_the_language_model_prefix() {
        let raw = serde_json::json!({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"},
            "quantization": {"group_size": 32, "bits": 4,
                "language_model.model.layers.0.mlp.down_proj": false,
                "language_model.lm_head": {"group_size": 64, "bits": 8},
                "vision_tower.vision_model.x": false}});
        let q = GEMMA3
            .text_config(&config(raw))
            .unwrap()
            .quantization
            .unwrap();
        assert_eq!(q.default, Some(QuantParams::affine(32, 4)));
        assert_eq!(q.per_path.len(), 2);
        assert_eq!(q.per_path["model.layers.0.mlp.down_proj"], None);
        assert_eq!(q.per_path["lm_head"], Some(QuantParams::affine(64, 8)));
    }

    #[test]
    fn a_gemma3_text_config_needs_its_model_type() {
        let raw = serde_json::json!({"model_type": "gemma3", "text_config": {"hidden_size": 8}});
        let err = GEMMA3.text_config(&config(raw)).err().unwrap().to_string();
        assert!(err.contains("`text_config` lacks `model_type`"), "{err}");
        let raw = serde_json::json!({"model_type": "gemma4"});
        let err = GEMMA4.text_config(&config(raw)).err().unwrap().to_string();
        assert!(
            err.starts_with("config.json: model_type `gemma4` is a multimodal wrapper"),
            "{err}"
        );
    }
}
