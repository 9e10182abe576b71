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

/// The directory of tiny model `name` (`models/<name>`) as it resolves on this machine.
pub fn model_dir(name: &str) -> Result<PathBuf, GoldenError> {
    let root = goldens_root();
    Ok(resolve(
        &root,
        &crate::machine::machine_key(),
        &format!("models/{name}"),
    )?
    .0)
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

    /// Opens a golden that has an index but no tensor data file.
    pub fn open_index_only(name: &str) -> Result<Self, GoldenError> {
        let (dir, layer) = resolve(&goldens_root(), &crate::machine::machine_key(), name)?;
        let mut golden = Self::open_index_dir(dir)?;
        golden.layer = layer;
        Ok(golden)
    }

    /// An index-only golden in `dir` (e.g. a live oracle run's output).
    pub fn open_index_dir(dir: PathBuf) -> Result<Self, GoldenError> {
        let layer = Layer::Reference;
        let index_path = dir.join("index.json");
        let text = std::fs::read_to_string(&index_path).map_err(|source| GoldenError::Io {
            path: index_path.clone(),
            source,
        })?;
        let index = serde_json::from_str(&text).map_err(|e| GoldenError::Malformed {
            path: index_path,
            message: e.to_string(),
        })?;
        Ok(TensorGolden {
            dir,
            layer,
            index,
            data: Vec::new(),
        })
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

/// Machine-key override dirs present under `root`: the dirs that are not one of `groups`
/// (the golden groups of the gate table).
pub fn machine_layers(root: &Path, groups: &[&str]) -> Vec<String> {
    let mut keys: Vec<String> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !groups.contains(&n.as_str()) && !n.starts_with('.'))
        .collect();
    keys.sort();
    keys
}

/// The reference machine key (`goldens/REFERENCE`).
pub fn reference_key(root: &Path) -> Option<String> {
    std::fs::read_to_string(root.join("REFERENCE"))
        .ok()
        .map(|s| s.trim().to_owned())
}

/// Problems `harness goldens check` finds in one golden dir: missing provenance fields, or
/// a generator that does not exist.
pub fn check_dir(dir: &Path, repo: &Path) -> Vec<String> {
    let index = ["index.json", "provenance.json"]
        .iter()
        .map(|f| dir.join(f))
        .find(|p| p.is_file());
    let Some(index) = index else {
        return vec![format!(
            "{}: no index.json or provenance.json",
            dir.display()
        )];
    };
    let value: Value = match std::fs::read_to_string(&index)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
    {
        Some(v) => v,
        None => return vec![format!("{}: unreadable JSON", index.display())],
    };
    let mut problems = Vec::new();
    let prov = &value["provenance"];
    for key in [
        "oracle",
        "oracle_version",
        "mlx_version",
        "command",
        "machine_key",
        "created",
    ] {
        if prov[key].as_str().is_none_or(str::is_empty) {
            problems.push(format!("{}: provenance.{key} missing", index.display()));
        }
    }
    match value["generator"].as_str() {
        Some(generator) if repo.join(generator).is_file() => {}
        Some(generator) => problems.push(format!(
            "{}: generator {generator} does not exist",
            index.display()
        )),
        None => problems.push(format!("{}: no generator named", index.display())),
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
    }

    #[test]
    fn check_catches_missing_provenance_and_generator() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(
            tmp.path().join("index.json"),
            r#"{"provenance": {"oracle": "mlx-lm", "command": "x"}, "generator": "oracles/nope.py"}"#,
        )
        .unwrap();
        let problems = check_dir(tmp.path(), &repo());
        assert!(
            problems
                .iter()
                .any(|p| p.contains("provenance.machine_key missing")),
            "{problems:?}"
        );
        assert!(
            problems
                .iter()
                .any(|p| p.contains("oracles/nope.py does not exist")),
            "{problems:?}"
        );
    }

    #[test]
    fn machine_override_wins_over_the_reference_set() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        std::fs::create_dir_all(root.join("runtime")).unwrap();
        assert_eq!(resolve(root, "m1", "runtime").unwrap().1, Layer::Reference);
        std::fs::create_dir_all(root.join("m1/runtime")).unwrap();
        let (dir, layer) = resolve(root, "m1", "runtime").unwrap();
        assert_eq!((dir, layer), (root.join("m1/runtime"), Layer::Machine));
        assert_eq!(resolve(root, "m2", "runtime").unwrap().1, Layer::Reference);
        assert!(resolve(root, "m1", "l1/none").is_err());
        assert_eq!(machine_layers(root, &["runtime"]), vec!["m1".to_owned()]);
    }
}
