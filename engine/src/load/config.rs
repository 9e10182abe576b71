//! `config.json`: the raw JSON (kept whole: families read what they need, unknown fields are
//! tolerated) plus the fields every family shares. A missing required field is an error that
//! names it.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

use super::{read_json, LoadError};

/// The parsed `config.json` of a model directory.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub path: PathBuf,
    pub raw: Value,
    pub model_type: String,
}

impl ModelConfig {
    pub fn read(dir: &Path) -> Result<Self, LoadError> {
        let path = dir.join("config.json");
        if !path.is_file() {
            return Err(LoadError::Config {
                path,
                message: "missing: a model directory needs config.json (Hugging Face layout)"
                    .into(),
            });
        }
        let raw = read_json(&path)?;
        Self::from_value(path, raw)
    }

    pub fn from_value(path: PathBuf, raw: Value) -> Result<Self, LoadError> {
        let model_type = raw
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| LoadError::Config {
                path: path.clone(),
                message: "missing field `model_type`".into(),
            })?
            .to_owned();
        if raw.get("quantization").is_some() || raw.get("quantization_config").is_some() {
            return Err(LoadError::Unsupported(format!(
                "{}: quantized models are not supported yet (config has `quantization`); \
                 use an unquantized (bf16/f16/f32) checkpoint",
                path.display()
            )));
        }
        Ok(ModelConfig {
            path,
            raw,
            model_type,
        })
    }

    /// Deserializes a family's typed arguments from the raw JSON. serde's message names the
    /// missing or mistyped field; we prefix the file.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, LoadError> {
        T::deserialize(&self.raw).map_err(|e| LoadError::Config {
            path: self.path.clone(),
            message: e.to_string(),
        })
    }
}

/// `rope_scaling` as mlx-lm reads it (`type` or `rope_type`, plus the variant's numbers).
#[derive(Debug, Clone, Deserialize, Default)]
pub struct RopeScaling {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub rope_type: Option<String>,
    pub factor: Option<f32>,
    pub low_freq_factor: Option<f32>,
    pub high_freq_factor: Option<f32>,
    pub original_max_position_embeddings: Option<f32>,
    pub rope_theta: Option<f32>,
}

impl RopeScaling {
    pub fn variant(&self) -> &str {
        self.kind
            .as_deref()
            .or(self.rope_type.as_deref())
            .unwrap_or("default")
    }
}
