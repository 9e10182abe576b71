//! Loading a model directory in Hugging Face layout: config, weights, tokenizer, chat template.

pub mod config;
pub mod hub;
pub mod template;
pub mod tokenizer;
pub mod weights;

/// The streaming detokenizers belong to the tokenizer; `load::detok` still names them.
pub use tokenizer::detok;

use std::path::{Path, PathBuf};

/// Errors from reading a model directory. Each names the file and, where possible, the fix.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {message}")]
    Json { path: PathBuf, message: String },
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("{path}: not a valid safetensors file: {message}")]
    Safetensors { path: PathBuf, message: String },
    #[error("{0}")]
    Unsupported(String),
    #[error("weights: {0}")]
    Weights(String),
    #[error("tokenizer {path}: {message}")]
    Tokenizer { path: PathBuf, message: String },
    #[error("chat template: {0}")]
    Template(String),
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
    #[error("distributed: {0}")]
    Distributed(#[from] crate::dist::DistError),
}

pub(crate) fn read_json(path: &Path) -> Result<serde_json::Value, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|source| LoadError::Io {
        path: path.to_owned(),
        source,
    })?;
    let mut value = serde_json::from_str(&finite_json(&text)).map_err(|e| LoadError::Json {
        path: path.to_owned(),
        message: e.to_string(),
    })?;
    decode_tagged_floats(&mut value);
    Ok(value)
}

/// The key of mlx-lm 0.32.2's tagged non-finite floats: its `save_config` writes `inf` as
/// `{"__float__": "Infinity"}` (so that the file stays JSON) and `load_config` reads it back.
pub(crate) const FLOAT_TAG: &str = "__float__";

/// mlx-lm's `_decode_tagged_floats`: each `{"__float__": "Infinity" | "-Infinity" | "NaN"}`
/// read as the bare literal is (±f64::MAX, null: `finite_json`).
fn decode_tagged_floats(v: &mut serde_json::Value) {
    use serde_json::Value;
    let tagged = match v {
        Value::Object(m) if m.len() == 1 => match m.get(FLOAT_TAG).and_then(Value::as_str) {
            Some("Infinity") => Some(serde_json::json!(f64::MAX)),
            Some("-Infinity") => Some(serde_json::json!(-f64::MAX)),
            Some("NaN") => Some(Value::Null),
            _ => None,
        },
        _ => None,
    };
    if let Some(x) = tagged {
        *v = x;
        return;
    }
    match v {
        Value::Object(m) => m.values_mut().for_each(decode_tagged_floats),
        Value::Array(a) => a.iter_mut().for_each(decode_tagged_floats),
        _ => {}
    }
}

/// The JSON text with Python's non-finite literals (`Infinity`, `-Infinity`, `NaN`, which
/// `json.dump` writes and mlx-lm's `json.load` reads: Mamba-2 configs carry
/// `"time_step_limit": [0.0, Infinity]`) outside strings replaced by the largest finite
/// doubles (±f64::MAX, which round to ±inf as float32, the width MLX computes in) and
/// null.
fn finite_json(text: &str) -> std::borrow::Cow<'_, str> {
    if !(text.contains("Infinity") || text.contains("NaN")) {
        return std::borrow::Cow::Borrowed(text);
    }
    let (mut out, mut in_string, mut escaped) = (String::with_capacity(text.len()), false, false);
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
        } else if c == '"' {
            in_string = true;
        } else {
            let words = [
                ("-Infinity", "-1.7976931348623157e308"),
                ("Infinity", "1.7976931348623157e308"),
                ("NaN", "null"),
            ];
            if let Some((word, with)) = words.iter().find(|(w, _)| rest.starts_with(w)) {
                out.push_str(with);
                rest = &rest[word.len()..];
                continue;
            }
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::{decode_tagged_floats, finite_json};

    #[test]
    fn mlx_lm_tagged_floats_read_as_the_literals() {
        let mut v = serde_json::json!({"t": [0.0, {"__float__": "Infinity"}], "n": {"__float__": "NaN"}, "o": {"__float__": "x"}});
        decode_tagged_floats(&mut v);
        assert_eq!(v["t"][1].as_f64(), Some(f64::MAX));
        assert!(v["n"].is_null());
        assert_eq!(v["o"]["__float__"], "x");
    }

    #[test]
    fn python_non_finite_literals_read_outside_strings_only() {
        let text = r#"{"time_step_limit": [0.0, Infinity], "low": -Infinity, "x": NaN, "s": "NaN Infinity"}"#;
        let v: serde_json::Value = serde_json::from_str(&finite_json(text)).unwrap();
        assert_eq!(v["time_step_limit"][1].as_f64(), Some(f64::MAX));
        assert_eq!(
            v["time_step_limit"][1].as_f64().map(|x| x as f32),
            Some(f32::INFINITY)
        );
        assert_eq!(v["low"].as_f64(), Some(-f64::MAX));
        assert!(v["x"].is_null());
        assert_eq!(v["s"], "NaN Infinity");
    }
}
