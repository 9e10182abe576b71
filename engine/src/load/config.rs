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
    /// MLX affine quantization, if the checkpoint is quantized.
    pub quantization: Option<QuantConfig>,
}

/// Affine quantization parameters of one module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantParams {
    pub group_size: i32,
    pub bits: i32,
}

/// MLX's default group size for affine quantization (`group_size=None`).
const AFFINE_DEFAULT_GROUP_SIZE: i32 = 64;

/// mlx-lm's `quantization` block: global `{group_size, bits, mode}` plus per-module
/// entries keyed by path, each either params or `false` (left unquantized).
#[derive(Debug, Clone, Default)]
pub struct QuantConfig {
    pub default: Option<QuantParams>,
    pub per_path: std::collections::HashMap<String, Option<QuantParams>>,
}

impl QuantConfig {
    fn parse(q: &Value) -> Result<Self, String> {
        let params = |v: &Value, at: &str| -> Result<QuantParams, String> {
            if let Some(mode) = v.get("mode").and_then(Value::as_str) {
                if mode != "affine" {
                    return Err(format!(
                        "quantization mode `{mode}` at {at} is not supported yet (only affine)"
                    ));
                }
            }
            let int = |k: &str| {
                v.get(k)
                    .and_then(Value::as_i64)
                    .map(|n| n as i32)
                    .ok_or_else(|| format!("quantization {at}: missing field `{k}`"))
            };
            // mlx_lm.convert's mixed recipes write `"group_size": null` when none was
            // asked for; MLX's quantize then takes the mode's default (affine: 64).
            let group_size = match v.get("group_size") {
                Some(Value::Null) => AFFINE_DEFAULT_GROUP_SIZE,
                _ => int("group_size")?,
            };
            Ok(QuantParams {
                group_size,
                bits: int("bits")?,
            })
        };
        let obj = q.as_object().ok_or("`quantization` must be an object")?;
        let mut cfg = QuantConfig {
            default: Some(params(q, "(global)")?),
            ..Default::default()
        };
        for (key, value) in obj {
            match value {
                Value::Bool(false) => {
                    cfg.per_path.insert(key.clone(), None);
                }
                Value::Object(_) => {
                    cfg.per_path.insert(key.clone(), Some(params(value, key)?));
                }
                _ => {} // group_size, bits, mode
            }
        }
        Ok(cfg)
    }
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
        let quantization = match raw.get("quantization") {
            Some(q) => Some(QuantConfig::parse(q).map_err(|message| LoadError::Config {
                path: path.clone(),
                message,
            })?),
            None if raw.get("quantization_config").is_some() => {
                return Err(LoadError::Unsupported(format!(
                    "{}: this checkpoint's `quantization_config` (GPTQ/AWQ/bitnet/fp8 style) is not \
                     supported; MLX affine quantization (`quantization` with group_size/bits, as \
                     written by mlx_lm.convert) is",
                    path.display()
                )))
            }
            None => None,
        };
        Ok(ModelConfig {
            path,
            raw,
            model_type,
            quantization,
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

/// `rope_scaling` as mlx-lm reads it (`type` or `rope_type`, plus the variant's numbers), or
/// transformers 5's `rope_parameters` (the same fields, with `rope_theta` among them).
/// Numbers stay f64, as Python floats do, until they meet an array.
#[derive(Debug, Clone, Deserialize, Default)]
pub struct RopeScaling {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub rope_type: Option<String>,
    pub factor: Option<f64>,
    pub low_freq_factor: Option<f64>,
    pub high_freq_factor: Option<f64>,
    pub original_max_position_embeddings: Option<f64>,
    pub rope_theta: Option<f32>,
    /// "proportional" (Gemma 4): the share of each head's dims that rotates.
    pub partial_rotary_factor: Option<f64>,
    /// "yarn": the correction range and the input scale's two halves.
    pub beta_fast: Option<f64>,
    pub beta_slow: Option<f64>,
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    /// "longrope" / "su": per-frequency factors (mlx-lm reads only the long ones).
    pub short_factor: Option<Factors>,
    pub long_factor: Option<Factors>,
    /// "mrope": mlx-lm checks there are 3 sections and rotates as the default RoPE.
    pub mrope_section: Option<Vec<i64>>,
}

/// transformers 5's `rope_parameters`: one set of RoPE settings, or one per layer type
/// (`full_attention`, `sliding_attention`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum RopeParameters {
    PerLayer(std::collections::HashMap<String, RopeScaling>),
    One(Box<RopeScaling>),
}

impl RopeParameters {
    /// The settings of layers of `kind` (the one set when not split by layer type).
    pub fn for_layer(&self, kind: &str) -> Option<&RopeScaling> {
        match self {
            RopeParameters::PerLayer(m) => m.get(kind),
            RopeParameters::One(s) => Some(s),
        }
    }
}

/// A longrope factor: one number or one per rotated frequency.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Factors {
    One(f64),
    Many(Vec<f64>),
}

impl Factors {
    /// The factors as f32 (`mx.array(factors, dtype=mx.float32)`).
    pub fn values(&self) -> Vec<f32> {
        match self {
            Factors::One(v) => vec![*v as f32],
            Factors::Many(v) => v.iter().map(|&x| x as f32).collect(),
        }
    }

    pub fn len(&self) -> i32 {
        match self {
            Factors::One(_) => 1,
            Factors::Many(v) => v.len() as i32,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl RopeScaling {
    pub fn variant(&self) -> &str {
        self.kind
            .as_deref()
            .or(self.rope_type.as_deref())
            .unwrap_or("default")
    }
}

#[cfg(test)]
mod quant_tests {
    use super::*;

    #[test]
    fn a_null_group_size_is_the_affine_default() {
        let q = serde_json::json!({
            "group_size": 32, "bits": 4, "mode": "affine",
            "model.layers.0.mlp.down_proj": {"group_size": null, "bits": 6},
        });
        let cfg = QuantConfig::parse(&q).unwrap();
        assert_eq!(
            cfg.default,
            Some(QuantParams {
                group_size: 32,
                bits: 4
            })
        );
        assert_eq!(
            cfg.per_path["model.layers.0.mlp.down_proj"],
            Some(QuantParams {
                group_size: 64,
                bits: 6
            })
        );
        // Absent is still an error (mlx-lm would raise a KeyError there too).
        let q = serde_json::json!({"group_size": 32, "bits": 4, "m": {"bits": 6}});
        assert!(QuantConfig::parse(&q)
            .unwrap_err()
            .contains("missing field `group_size`"));
    }
}
