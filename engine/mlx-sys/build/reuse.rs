//! mlx-c's compiled library and its bindings, kept beside cargo's build outputs
//! (`<target-dir>/<profile>/build/mlx-c-KEY/`) and reused when this build script runs again
//! with the same inputs. Cargo runs it again whenever anything it was built from changes
//! hash, not only when mlx-c does: `.ci/run`'s non-test build of the engine resolves the
//! host's serde_core without a feature the tests' dev-dependencies turn on, which gives this
//! script another hash, and it then compiled mlx-c and ran bindgen a second time, on the
//! critical path of that build (~57 s of CPU).
//!
//! KEY hashes every input of the two steps: the contents of mlx-c's sources and headers, of
//! `csrc/` and of this build script; the runtime's include directory and version; the
//! target, the profile's optimization and debug settings and the C/C++ compiler (its path,
//! its `--version`, and every variable of the compiler's, cc's and bindgen's environment
//! that is set). A cache entry is written to a private name and renamed into place, so it is
//! whole or absent.

use std::collections::hash_map::DefaultHasher;
use std::env;
use std::fs;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::runtime::{Runtime, MLX_VERSION};
use crate::Target;

/// The files one cache entry holds: what `mlxc::compile` and `mlxc::generate_bindings`
/// write into OUT_DIR.
pub const OUTPUTS: [&str; 2] = ["libmlxc.a", "bindings.rs"];

/// The environment the compiler, the archiver, cc and bindgen read (by name prefix).
const TOOL_VARS: [&str; 16] = [
    "CC",
    "CXX",
    "CFLAGS",
    "AR",
    "HOST_",
    "TARGET_",
    "CRATE_CC",
    "CPATH",
    "C_INCLUDE",
    "CPLUS_INCLUDE",
    "OBJC",
    "COMPILER_PATH",
    "GCC_",
    "SOURCE_DATE_EPOCH",
    "BINDGEN",
    "LIBCLANG",
];

/// The entry's directory for these inputs (it may not exist yet).
pub fn entry(target: &Target, mlx_c: &Path, runtime: &Runtime, out_dir: &Path) -> PathBuf {
    let mut hasher = DefaultHasher::new();
    (&target.os, &target.arch, target.cuda).hash(&mut hasher);
    // cc also reads the rustflags (frame pointers, code model) and the target's features.
    for var in [
        "TARGET",
        "HOST",
        "OPT_LEVEL",
        "DEBUG",
        "PROFILE",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_CFG_TARGET_FEATURE",
    ] {
        env::var(var).ok().hash(&mut hasher);
    }
    let mut tool_vars: Vec<(String, String)> = env::vars()
        .filter(|(name, _)| TOOL_VARS.iter().any(|prefix| name.starts_with(prefix)))
        .collect();
    tool_vars.sort();
    tool_vars.hash(&mut hasher);
    let compiler = cc::Build::new().cpp(true).get_compiler();
    compiler.path().hash(&mut hasher);
    let version = Command::new(compiler.path()).arg("--version").output();
    version
        .map(|o| o.stdout)
        .unwrap_or_default()
        .hash(&mut hasher);
    (runtime.include_dir(), MLX_VERSION).hash(&mut hasher);
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    for dir in [
        mlx_c.to_path_buf(),
        manifest.join("csrc"),
        manifest.join("build"),
    ] {
        hash_tree(&dir, &mut hasher);
    }
    // OUT_DIR is <target-dir>/<profile>/build/mlx-sys-HASH/out.
    let build_dir = out_dir
        .ancestors()
        .nth(2)
        .expect("OUT_DIR is below target/<profile>/build");
    build_dir.join(format!("mlx-c-{:016x}", hasher.finish()))
}

/// Copies a complete entry's files into OUT_DIR; false when there is none.
pub fn restore(entry: &Path, out_dir: &Path) -> bool {
    if !entry.is_dir() {
        return false;
    }
    let restored = OUTPUTS
        .iter()
        .all(|name| fs::copy(entry.join(name), out_dir.join(name)).is_ok());
    if restored {
        println!(
            "cargo:warning=reusing mlx-c and its bindings built from the same inputs ({})",
            entry.display()
        );
    }
    restored
}

/// Keeps OUT_DIR's freshly built files as the entry (best effort: a failure only means
/// the next run builds them again).
pub fn store(entry: &Path, out_dir: &Path) {
    let partial = entry.with_extension(format!("partial-{}", std::process::id()));
    let _ = fs::remove_dir_all(&partial);
    let copied = fs::create_dir_all(&partial).is_ok()
        && OUTPUTS
            .iter()
            .all(|name| fs::copy(out_dir.join(name), partial.join(name)).is_ok());
    if !copied || fs::rename(&partial, entry).is_err() {
        let _ = fs::remove_dir_all(&partial);
    }
}

/// Every file below `dir` (sorted, recursively): its path relative to `dir` and contents.
fn hash_tree(dir: &Path, hasher: &mut DefaultHasher) {
    let mut entries: Vec<PathBuf> = match fs::read_dir(dir) {
        Ok(read) => read.filter_map(|e| e.ok().map(|e| e.path())).collect(),
        Err(_) => return,
    };
    entries.sort();
    for path in entries {
        if path.is_dir() {
            hash_tree(&path, hasher);
        } else if let Ok(bytes) = fs::read(&path) {
            path.file_name().hash(hasher);
            bytes.hash(hasher);
        }
    }
}
