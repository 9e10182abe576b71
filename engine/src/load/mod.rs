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
    serde_json::from_str(&text).map_err(|e| LoadError::Json {
        path: path.to_owned(),
        message: e.to_string(),
    })
}
