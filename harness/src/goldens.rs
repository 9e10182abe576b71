//! Reading committed goldens: a JSON index (with provenance) plus raw little-endian tensor
//! bytes. Lookup is layered: `goldens/<machine-key>/<name>` first, then `goldens/<name>`.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum GoldenError {
    #[error("golden `{name}` not found (looked in {looked})")]
    NotFound { name: String, looked: String },
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("golden index {path} is malformed: {message}")]
    Malformed { path: PathBuf, message: String },
}

/// The goldens directory: `HARNESS_GOLDENS`, else the first `goldens/` with a REFERENCE
/// file above the current directory, else the one in this source tree.
pub fn goldens_root() -> PathBuf {
    if let Ok(dir) = std::env::var("HARNESS_GOLDENS") {
        return PathBuf::from(dir);
    }
    if let Ok(cwd) = std::env::current_dir() {
        for dir in cwd.ancestors() {
            let candidate = dir.join("goldens");
            if candidate.join("REFERENCE").is_file() {
                return candidate;
            }
        }
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../goldens")
}

/// Where `name` resolves on this machine, and which layer that is.
pub fn resolve(
    root: &Path,
    machine_key: &str,
    name: &str,
) -> Result<(PathBuf, Layer), GoldenError> {
    let override_dir = root.join(machine_key).join(name);
    if override_dir.is_dir() {
        return Ok((override_dir, Layer::Machine));
    }
    let reference = root.join(name);
    if reference.is_dir() {
        return Ok((reference, Layer::Reference));
    }
    Err(GoldenError::NotFound {
        name: name.to_owned(),
        looked: format!("{} and {}", override_dir.display(), reference.display()),
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layer {
    Reference,
    Machine,
}

/// One tensor's place in the data file.
#[derive(Debug, Clone, Deserialize)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<i32>,
    pub offset: usize,
    pub bytes: usize,
}

/// A golden dir whose index lists cases of tensors stored in one data file.
pub struct TensorGolden {
    pub dir: PathBuf,
    pub layer: Layer,
    pub index: Value,
    data: Vec<u8>,
}

impl TensorGolden {
    /// Opens `name` for this machine (layered lookup).
    pub fn open(name: &str) -> Result<Self, GoldenError> {
        let (dir, layer) = resolve(&goldens_root(), &crate::machine::machine_key(), name)?;
        Self::open_dir(dir, layer)
    }

    pub fn open_dir(dir: PathBuf, layer: Layer) -> Result<Self, GoldenError> {
        let index_path = dir.join("index.json");
        let text = std::fs::read_to_string(&index_path).map_err(|source| GoldenError::Io {
            path: index_path.clone(),
            source,
        })?;
        let index: Value = serde_json::from_str(&text).map_err(|e| GoldenError::Malformed {
            path: index_path.clone(),
            message: e.to_string(),
        })?;
        let data_name = index["data"].as_str().unwrap_or("data.bin");
        let data_path = dir.join(data_name);
        let data = std::fs::read(&data_path).map_err(|source| GoldenError::Io {
            path: data_path,
            source,
        })?;
        Ok(TensorGolden {
            dir,
            layer,
            index,
            data,
        })
    }

    fn malformed(&self, message: String) -> GoldenError {
        GoldenError::Malformed {
            path: self.dir.join("index.json"),
            message,
        }
    }

    /// The case object named `case`.
    pub fn case(&self, case: &str) -> Result<&Value, GoldenError> {
        self.index["cases"]
            .as_array()
            .and_then(|cases| cases.iter().find(|c| c["name"] == case))
            .ok_or_else(|| self.malformed(format!("no case `{case}`")))
    }

    /// The raw bytes of a tensor entry (from any index layout).
    pub fn tensor_at(&self, entry: &TensorEntry) -> Result<(TensorEntry, &[u8]), GoldenError> {
        let bytes = self
            .data
            .get(entry.offset..entry.offset + entry.bytes)
            .ok_or_else(|| {
                self.malformed(format!(
                    "tensor `{}` lies outside the data file",
                    entry.name
                ))
            })?;
        Ok((entry.clone(), bytes))
    }

    /// The entry and raw bytes of tensor `tensor` in case `case`.
    pub fn tensor(&self, case: &str, tensor: &str) -> Result<(TensorEntry, &[u8]), GoldenError> {
        let entry = self.case(case)?["tensors"]
            .as_array()
            .and_then(|ts| ts.iter().find(|t| t["name"] == tensor))
            .ok_or_else(|| self.malformed(format!("case `{case}` has no tensor `{tensor}`")))?;
        let entry: TensorEntry = serde_json::from_value(entry.clone())
            .map_err(|e| self.malformed(format!("tensor `{case}/{tensor}`: {e}")))?;
        let bytes = self
            .data
            .get(entry.offset..entry.offset + entry.bytes)
            .ok_or_else(|| {
                self.malformed(format!(
                    "tensor `{case}/{tensor}` lies outside the data file"
                ))
            })?;
        Ok((entry, bytes))
    }
}
