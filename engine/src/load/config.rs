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
    /// MLX quantization (any mode), if the checkpoint is quantized.
    pub quantization: Option<QuantConfig>,
}

/// MLX's quantization modes (`mx.quantize(..., mode=...)`): affine (scales and biases in
/// the weights' float dtype) and the floating-point formats, whose uint8 scales come alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantMode {
    Affine,
    Mxfp4,
    Nvfp4,
    Mxfp8,
}

impl QuantMode {
    pub const ALL: [QuantMode; 4] = [Self::Affine, Self::Mxfp4, Self::Nvfp4, Self::Mxfp8];

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }

    pub fn name(self) -> &'static str {
        self.c_name().to_str().unwrap_or("affine")
    }

    /// The name as mlx-c takes it.
    pub fn c_name(self) -> &'static std::ffi::CStr {
        match self {
            Self::Affine => c"affine",
            Self::Mxfp4 => c"mxfp4",
            Self::Nvfp4 => c"nvfp4",
            Self::Mxfp8 => c"mxfp8",
        }
    }

    /// `nn.quantize`'s defaults for the mode (`_defaults_for_mode`): (group size, bits).
    pub fn defaults(self) -> (i32, i32) {
        match self {
            Self::Affine => (64, 4),
            Self::Mxfp4 => (32, 4),
            Self::Nvfp4 => (16, 4),
            Self::Mxfp8 => (32, 8),
        }
    }

    /// The (group size, bits) MLX's quantized kernels accept in this mode, with MLX's
    /// own wording when they are not.
    pub fn check(self, group_size: i32, bits: i32) -> Result<(), String> {
        if self == Self::Affine {
            if ![32, 64, 128].contains(&group_size) {
                return Err(format!(
                    "affine group size {group_size} is not supported (MLX supports 32, 64 and 128)"
                ));
            }
            if ![2, 3, 4, 5, 6, 8].contains(&bits) {
                return Err(format!(
                    "affine bits {bits} are not supported (MLX supports 2, 3, 4, 5, 6 and 8)"
                ));
            }
            return Ok(());
        }
        let (g, b) = self.defaults();
        if (group_size, bits) != (g, b) {
            return Err(format!(
                "{} quantization requires group size {g} and {b} bits, got group size \
                 {group_size} and {bits} bits",
                self.name()
            ));
        }
        Ok(())
    }
}

/// How one module is quantized: group size, bits and mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantParams {
    pub group_size: i32,
    pub bits: i32,
    pub mode: QuantMode,
}

impl QuantParams {
    pub const fn affine(group_size: i32, bits: i32) -> Self {
        QuantParams {
            group_size,
            bits,
            mode: QuantMode::Affine,
        }
    }
}

/// mlx-lm's `quantization` block: global `{group_size, bits, mode}` plus per-module
/// entries keyed by path, each either params or `false` (left unquantized).
#[derive(Debug, Clone, Default)]
pub struct QuantConfig {
    pub default: Option<QuantParams>,
    pub per_path: std::collections::HashMap<String, Option<QuantParams>>,
}

/// One `{group_size, bits, mode}` entry as `to_quantized(**entry)` reads it: a missing
/// `mode` is affine (the keyword's default, also for a per-module entry under a global
/// mxfp4: qwen3_moe's router entries carry none); a `null` group size or bits is the
/// mode's default; a missing group size or bits is an error, as mlx-lm's KeyError.
/// `global` is the global entry's mode (planted: a per-module entry without one takes it).
fn entry_params(v: &Value, at: &str, global: Option<QuantMode>) -> Result<QuantParams, String> {
    let unnamed = match global {
        Some(g) if crate::plant::is(crate::plant::Defect::QuantEntryTakesGlobalMode) => g,
        _ => QuantMode::Affine,
    };
    let mode = match v.get("mode") {
        None | Some(Value::Null) => unnamed,
        Some(m) => {
            let name = m.as_str().unwrap_or("?");
            QuantMode::parse(name).ok_or_else(|| {
                format!(
                    "quantization {at}: unknown mode `{name}` (MLX's modes are affine, mxfp4, \
                     nvfp4 and mxfp8)"
                )
            })?
        }
    };
    if v.get("quantize_input").and_then(Value::as_bool) == Some(true) {
        return Err(format!(
            "quantization {at}: `quantize_input` (nn.QQLinear, quantized activations) is not \
             supported"
        ));
    }
    let (default_group_size, default_bits) = mode.defaults();
    let int = |k: &str, default: i32| match v.get(k) {
        Some(Value::Null) => Ok(default),
        Some(n) => n
            .as_i64()
            .map(|n| n as i32)
            .ok_or_else(|| format!("quantization {at}: `{k}` must be an integer or null")),
        None => Err(format!("quantization {at}: missing field `{k}`")),
    };
    let params = QuantParams {
        group_size: int("group_size", default_group_size)?,
        bits: int("bits", default_bits)?,
        mode,
    };
    mode.check(params.group_size, params.bits)
        .map_err(|e| format!("quantization {at}: {e}"))?;
    Ok(params)
}

impl QuantConfig {
    fn parse(q: &Value) -> Result<Self, String> {
        let obj = q.as_object().ok_or("`quantization` must be an object")?;
        let default = entry_params(q, "(global)", None)?;
        let mut cfg = QuantConfig {
            default: Some(default),
            ..Default::default()
        };
        for (key, value) in obj {
            match value {
                Value::Bool(false) => {
                    cfg.per_path.insert(key.clone(), None);
                }
                Value::Object(_) => {
                    cfg.per_path.insert(
                        key.clone(),
                        Some(entry_params(value, key, Some(default.mode))?),
                    );
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
        assert_eq!(cfg.default, Some(QuantParams::affine(32, 4)));
        assert_eq!(
            cfg.per_path["model.layers.0.mlp.down_proj"],
            Some(QuantParams::affine(64, 6))
        );
        // Absent is still an error (mlx-lm would raise a KeyError there too).
        let q = serde_json::json!({"group_size": 32, "bits": 4, "m": {"bits": 6}});
        assert!(QuantConfig::parse(&q)
            .unwrap_err()
            .contains("missing field `group_size`"));
    }

    #[test]
    fn modes_and_their_defaults_are_read_as_mlx_lm_reads_them() {
        let q = serde_json::json!({
            "group_size": 32, "bits": 4, "mode": "mxfp4",
            "lm_head": {"group_size": null, "bits": null, "mode": "mxfp8"},
            "model.embed_tokens": {"group_size": 32, "bits": 4},
            "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
            "model.layers.0.self_attn.q_proj": {"group_size": null, "bits": 4, "mode": "nvfp4"},
        });
        let cfg = QuantConfig::parse(&q).unwrap();
        let mx = |g, b, mode| {
            Some(QuantParams {
                group_size: g,
                bits: b,
                mode,
            })
        };
        assert_eq!(cfg.default, mx(32, 4, QuantMode::Mxfp4));
        assert_eq!(cfg.per_path["lm_head"], mx(32, 8, QuantMode::Mxfp8));
        // An entry without a mode is affine, whatever the global mode.
        assert_eq!(
            cfg.per_path["model.embed_tokens"],
            Some(QuantParams::affine(32, 4))
        );
        assert_eq!(
            cfg.per_path["model.layers.0.mlp.gate"],
            Some(QuantParams::affine(64, 8))
        );
        assert_eq!(
            cfg.per_path["model.layers.0.self_attn.q_proj"],
            mx(16, 4, QuantMode::Nvfp4)
        );
        let refused = |q: Value| QuantConfig::parse(&q).unwrap_err();
        assert_eq!(
            refused(serde_json::json!({"group_size": 32, "bits": 4, "mode": "fp4"})),
            "quantization (global): unknown mode `fp4` (MLX's modes are affine, mxfp4, nvfp4 \
             and mxfp8)"
        );
        assert_eq!(
            refused(serde_json::json!({"group_size": 16, "bits": 8, "mode": "nvfp4"})),
            "quantization (global): nvfp4 quantization requires group size 16 and 4 bits, got \
             group size 16 and 8 bits"
        );
        assert_eq!(
            refused(
                serde_json::json!({"group_size": 64, "bits": 4, "m": {"group_size": 16, "bits": 4}})
            ),
            "quantization m: affine group size 16 is not supported (MLX supports 32, 64 and 128)"
        );
        assert_eq!(
            refused(serde_json::json!({"group_size": 64, "bits": 7})),
            "quantization (global): affine bits 7 are not supported (MLX supports 2, 3, 4, 5, 6 \
             and 8)"
        );
    }
}
