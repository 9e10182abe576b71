//! bindgen loads libclang at run time. Use the one the user pointed at (LIBCLANG_PATH) or a
//! system one; otherwise install PyPI's `libclang` wheel into our cache (no root needed).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::{cache, fail, Target};

const WHEEL: &str = "libclang==18.1.1";

static USING_WHEEL: OnceLock<bool> = OnceLock::new();

pub fn ensure(target: &Target) {
    // The user's choice, Xcode's libclang, or a system one: clang-sys finds those itself.
    let found =
        env::var_os("LIBCLANG_PATH").is_some() || target.is_macos() || system_libclang().is_some();
    let using_wheel = if found {
        false
    } else {
        let dest = cache::dir().join("tools").join("libclang-18.1.1");
        cache::pip_install(WHEEL, &dest, false);
        let native = dest.join("clang/native");
        if !native.join("libclang.so").is_file() {
            fail(format!(
                "bindgen needs libclang and none was found. Install one: `apt-get install \
                 libclang-dev` (Debian/Ubuntu), or `python3 -m pip install {WHEEL}` and set \
                 LIBCLANG_PATH=<site-packages>/clang/native. (Tried the wheel in {}.)",
                dest.display()
            ));
        }
        // clang-sys reads this when bindgen first loads libclang, later in this process.
        env::set_var("LIBCLANG_PATH", &native);
        true
    };
    USING_WHEEL.set(using_wheel).ok();
}

fn system_libclang() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Ok(out) = Command::new("llvm-config").arg("--libdir").output() {
        if out.status.success() {
            dirs.push(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
        }
    }
    for base in ["/usr/lib", "/usr/lib64", "/usr/local/lib"] {
        dirs.push(PathBuf::from(base));
        dirs.push(Path::new(base).join("x86_64-linux-gnu"));
        dirs.push(Path::new(base).join("aarch64-linux-gnu"));
        if let Ok(entries) = std::fs::read_dir(base) {
            for entry in entries.flatten() {
                if entry.file_name().to_string_lossy().starts_with("llvm") {
                    dirs.push(entry.path().join("lib"));
                }
            }
        }
    }
    dirs.into_iter().find(|dir| {
        std::fs::read_dir(dir).is_ok_and(|entries| {
            entries.flatten().any(|e| {
                let name = e.file_name();
                let name = name.to_string_lossy();
                name == "libclang.so"
                    || name.starts_with("libclang.so.")
                    || (name.starts_with("libclang-")
                        && name.contains(".so")
                        && !name.starts_with("libclang-cpp"))
            })
        })
    })
}

/// The PyPI libclang ships without clang's resource headers (stddef.h, stdbool.h, ...);
/// borrow the C compiler's, which the C headers we parse are written for anyway.
pub fn extra_include_dirs() -> Vec<PathBuf> {
    if !USING_WHEEL.get().copied().unwrap_or(false) {
        return Vec::new();
    }
    let compiler = env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    Command::new(compiler)
        .arg("-print-file-name=include")
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
        .filter(|dir| dir.join("stddef.h").is_file())
        .into_iter()
        .collect()
}
