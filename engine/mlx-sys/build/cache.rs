//! The cache dir this crate owns: pip-installed wheels live here and are reused by every
//! later build (and every checkout) on the machine.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::fail;

/// `$ENGINE_CACHE_DIR`, else `$XDG_CACHE_HOME/mlx-engine`, else `~/.cache/mlx-engine`
/// (`~/Library/Caches/mlx-engine` on macOS).
pub fn dir() -> PathBuf {
    if let Some(dir) = env::var_os("ENGINE_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    if let Some(xdg) = env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(xdg).join("mlx-engine");
    }
    let home = env::var_os("HOME")
        .unwrap_or_else(|| fail("neither ENGINE_CACHE_DIR nor HOME is set; set ENGINE_CACHE_DIR to a writable directory"));
    let base = if env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("macos") {
        PathBuf::from(home).join("Library/Caches")
    } else {
        PathBuf::from(home).join(".cache")
    };
    base.join("mlx-engine")
}

/// The python used to run pip: `$ENGINE_PYTHON`, else `python3`.
pub fn python() -> String {
    env::var("ENGINE_PYTHON").unwrap_or_else(|_| "python3".to_owned())
}

/// Installs `requirement` with pip into `dest` unless a previous build already did.
/// pip writes into a temporary sibling that is renamed into place only when complete,
/// so an interrupted install is never mistaken for a finished one.
pub fn pip_install(requirement: &str, dest: &Path, with_deps: bool) {
    if dest.join(".complete").is_file() {
        println!(
            "cargo:warning=using cached {requirement} from {}",
            dest.display()
        );
        return;
    }
    let parent = dest.parent().expect("cache entries live in a directory");
    fs::create_dir_all(parent).unwrap_or_else(|e| {
        fail(format!(
            "cannot create the cache dir {}: {e}; set ENGINE_CACHE_DIR to a writable directory",
            parent.display()
        ))
    });
    let staging = parent.join(format!(
        ".{}.partial-{}",
        dest.file_name().unwrap().to_string_lossy(),
        std::process::id()
    ));
    let _ = fs::remove_dir_all(&staging);
    println!(
        "cargo:warning=installing {requirement} into {} (first build only)",
        dest.display()
    );
    let python = python();
    let mut pip = Command::new(&python);
    pip.args([
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-input",
        "--quiet",
    ])
    .args(["--only-binary=:all:", "--target"])
    .arg(&staging)
    .arg(requirement);
    if !with_deps {
        pip.arg("--no-deps");
    }
    let status = pip.status().unwrap_or_else(|e| {
        fail(format!(
            "could not run `{python} -m pip` to install {requirement}: {e}.\n\
             Install Python 3 with pip (Debian: `apt-get install python3-pip`), or point \
             ENGINE_PYTHON at one, or set MLX_DIR to an installed MLX runtime (see docs/build.md)."
        ))
    });
    if !status.success() {
        let _ = fs::remove_dir_all(&staging);
        fail(format!(
            "`{python} -m pip install {requirement}` failed ({status}). The build needs this wheel \
             from PyPI once; check network access to PyPI, or set MLX_DIR to an installed MLX \
             runtime (a directory with include/ and lib/), see docs/build.md."
        ));
    }
    fs::write(staging.join(".complete"), requirement).expect("write completion marker");
    match fs::rename(&staging, dest) {
        Ok(()) => {}
        // Another build finished the same install first; keep theirs.
        Err(_) if dest.join(".complete").is_file() => {
            let _ = fs::remove_dir_all(&staging);
        }
        Err(e) => fail(format!(
            "cannot move {} to {}: {e}",
            staging.display(),
            dest.display()
        )),
    }
}
