//! The oracle venv (`oracles/.venv`, made by `oracles/setup.sh`): where it is, what it has,
//! and whether its libmlx is the very wheel the engine links.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use sha2::{Digest, Sha256};

/// The repository root (the parent of the goldens dir).
pub fn repo_root() -> PathBuf {
    let goldens = crate::goldens::goldens_root();
    goldens.parent().map(Path::to_path_buf).unwrap_or(goldens)
}

/// `ORACLE_VENV`, else `<repo>/oracles/.venv`.
pub fn venv_dir() -> PathBuf {
    std::env::var_os("ORACLE_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("oracles/.venv"))
}

pub fn python() -> PathBuf {
    venv_dir().join("bin/python")
}

/// What the venv's Python reports about itself.
#[derive(Debug, Clone, Deserialize)]
pub struct VenvInfo {
    pub python: String,
    pub versions: std::collections::BTreeMap<String, String>,
    pub libmlx: Option<String>,
}

const PROBE: &str = r#"
import importlib.metadata as md, json, sys
from pathlib import Path
versions = {}
for name in ["mlx", "mlx-cpu", "mlx-cuda-13", "mlx-metal", "mlx-lm", "mlx-optiq", "transformers"]:
    try:
        versions[name] = md.version(name)
    except md.PackageNotFoundError:
        pass
libmlx = None
try:
    import mlx.core as mx
    lib = Path(mx.__file__).resolve().parent / "lib"
    for name in ("libmlx.so", "libmlx.dylib"):
        if (lib / name).exists():
            libmlx = str(lib / name)
except Exception:
    pass
print(json.dumps({"python": sys.version.split()[0], "versions": versions, "libmlx": libmlx}))
"#;

#[derive(Debug, thiserror::Error)]
pub enum OracleError {
    #[error("no oracle venv at {0}: create it with `bash oracles/setup.sh`")]
    Missing(PathBuf),
    #[error("the oracle venv's python failed: {0}")]
    Probe(String),
}

pub fn probe() -> Result<VenvInfo, OracleError> {
    let python = python();
    if !python.exists() {
        return Err(OracleError::Missing(venv_dir()));
    }
    let out = Command::new(&python)
        .args(["-c", PROBE])
        .output()
        .map_err(|e| OracleError::Probe(e.to_string()))?;
    if !out.status.success() {
        return Err(OracleError::Probe(
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| OracleError::Probe(e.to_string()))
}

pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let bytes = std::fs::read(path)?;
    Ok(format!("{:x}", Sha256::digest(&bytes)))
}

/// The engine's runtime wheel, as the venv names it (`mlx-cpu`, `mlx-cuda-13`, `mlx-metal`).
pub fn engine_wheel() -> &'static str {
    match engine::runtime::backend() {
        "cuda" => "mlx-cuda-13",
        "metal" => "mlx-metal",
        _ => "mlx-cpu",
    }
}

/// The verdict on "one libmlx for engine and oracle".
#[derive(Debug, Clone)]
pub struct SameRuntime {
    pub engine_version: String,
    pub oracle_version: Option<String>,
    pub engine_lib: Option<PathBuf>,
    pub engine_sha256: Option<String>,
    pub oracle_sha256: Option<String>,
}

impl SameRuntime {
    pub fn versions_match(&self) -> bool {
        self.oracle_version.as_deref() == Some(self.engine_version.as_str())
    }

    pub fn bytes_match(&self) -> Option<bool> {
        Some(self.engine_sha256.as_ref()? == self.oracle_sha256.as_ref()?)
    }
}

pub fn same_runtime(info: &VenvInfo) -> SameRuntime {
    let engine_lib = engine::runtime::loaded_library_path();
    SameRuntime {
        engine_version: engine::runtime::mlx_version(),
        oracle_version: info.versions.get(engine_wheel()).cloned(),
        engine_sha256: engine_lib.as_deref().and_then(|p| sha256_file(p).ok()),
        oracle_sha256: info
            .libmlx
            .as_deref()
            .and_then(|p| sha256_file(Path::new(p)).ok()),
        engine_lib,
    }
}
