//! Finding (or installing) the MLX runtime: libmlx plus the C++ headers mlx-c compiles
//! against. The engine and the Python oracle use the same wheel, so parity can be exact.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{cache, fail, Target};

/// The MLX version mlx-c 0.7.0 targets. 0.32.4 changed a signature mlx-c calls.
pub const MLX_VERSION: &str = "0.32.2";

pub struct Runtime {
    /// Directory holding `include/mlx/` and `lib/libmlx.*`.
    pub root: PathBuf,
    /// Where it came from: the wheel's distribution name, or `MLX_DIR`.
    pub source: String,
}

impl Runtime {
    pub fn include_dir(&self) -> PathBuf {
        self.root.join("include")
    }

    pub fn lib_dir(&self) -> PathBuf {
        self.root.join("lib")
    }

    /// Links libmlx and tells dependents (as `DEP_MLX_*`) where it is, so their build
    /// scripts can add an rpath: binaries then run without LD_LIBRARY_PATH.
    pub fn link(&self, target: &Target) {
        let lib_dir = self.lib_dir();
        println!("cargo:rustc-link-search=native={}", lib_dir.display());
        println!("cargo:rustc-link-lib=dylib=mlx");
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
        println!("cargo::metadata=lib_dir={}", lib_dir.display());
        println!("cargo::metadata=root={}", self.root.display());
        println!("cargo::metadata=source={}", self.source);
        println!("cargo::metadata=version={MLX_VERSION}");
        if target.cuda {
            if let Some(dir) = cuda_driver_dir() {
                println!("cargo::metadata=rpath_link={}", dir.display());
            }
        }
    }
}

/// The wheel that carries libmlx for this target.
fn wheel_name(target: &Target) -> &'static str {
    match (target.is_macos(), target.cuda) {
        (true, true) => fail("the `cuda` feature is for Linux; on macOS the runtime is mlx-metal"),
        (true, false) => "mlx-metal",
        (false, true) => "mlx-cuda-13",
        (false, false) => {
            if env::var_os("CARGO_FEATURE_METAL").is_some() {
                fail("the `metal` feature needs macOS; on Linux build without it (CPU) or with `cuda`");
            }
            "mlx-cpu"
        }
    }
}

pub fn locate(target: &Target) -> Runtime {
    if target.cuda && cuda_driver_dir().is_none() {
        // Checked before pip fetches gigabytes of CUDA wheels that could not link anyway.
        fail(
            "the `cuda` feature needs the NVIDIA driver's libcuda.so.1, and this machine has none \
             (looked in LD_LIBRARY_PATH, /usr/local/nvidia/lib64, /usr/lib/x86_64-linux-gnu, \
             /usr/lib/aarch64-linux-gnu, /usr/lib64). Build with `--features cuda` on a machine \
             with an NVIDIA driver (nvidia-smi works), or without it for the CPU runtime.",
        );
    }
    let runtime = match env::var_os("MLX_DIR") {
        Some(dir) => Runtime {
            root: PathBuf::from(dir),
            source: "MLX_DIR".to_owned(),
        },
        None => install_wheel(target),
    };
    check_layout(&runtime);
    check_version(&runtime);
    if target.os == "linux" {
        check_shared_deps(&runtime, target);
    }
    runtime
}

fn install_wheel(target: &Target) -> Runtime {
    let wheel = wheel_name(target);
    let dest = cache::dir()
        .join("runtime")
        .join(format!("{wheel}-{MLX_VERSION}"));
    // The CUDA wheel's libmlx finds cuBLAS/cuDNN/NCCL in sibling nvidia-* wheels.
    cache::pip_install(&format!("{wheel}=={MLX_VERSION}"), &dest, target.cuda);
    Runtime {
        root: dest.join("mlx"),
        source: format!("{wheel}=={MLX_VERSION} (pip, cached in {})", dest.display()),
    }
}

fn check_layout(runtime: &Runtime) {
    let header = runtime.include_dir().join("mlx/mlx.h");
    let has_lib = ["libmlx.so", "libmlx.dylib"]
        .iter()
        .any(|name| runtime.lib_dir().join(name).is_file());
    if !header.is_file() || !has_lib {
        fail(format!(
            "{} is not an MLX runtime: expected include/mlx/mlx.h and lib/libmlx.{{so,dylib}} \
             below it. MLX_DIR must name the `mlx` directory of an installed mlx-cpu, \
             mlx-cuda-13 or mlx-metal {MLX_VERSION} wheel (e.g. .../site-packages/mlx); \
             unset MLX_DIR to let the build install the pinned wheel itself.",
            runtime.root.display()
        ));
    }
}

/// Reads the version macros from the runtime's headers; mlx-c 0.7.0 needs exactly 0.32.2.
fn check_version(runtime: &Runtime) {
    let path = runtime.include_dir().join("mlx/version.h");
    let text = fs::read_to_string(&path)
        .unwrap_or_else(|e| fail(format!("cannot read {}: {e}", path.display())));
    let part = |name: &str| {
        text.lines()
            .find_map(|line| line.trim().strip_prefix(&format!("#define {name} ")))
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|| fail(format!("{} has no {name}", path.display())))
    };
    let found = format!(
        "{}.{}.{}",
        part("MLX_VERSION_MAJOR"),
        part("MLX_VERSION_MINOR"),
        part("MLX_VERSION_PATCH")
    );
    if found != MLX_VERSION {
        fail(format!(
            "the MLX runtime at {} is version {found}, but mlx-c 0.7.0 (used by mlx-rs 0.33.0) \
             targets {MLX_VERSION} exactly. Point MLX_DIR at a {MLX_VERSION} wheel, or unset it.",
            runtime.root.display()
        ));
    }
}

/// Lists libmlx's shared-library dependencies the dynamic loader cannot find. Linking
/// would fail on them later with a far less helpful message.
fn check_shared_deps(runtime: &Runtime, target: &Target) {
    let lib = runtime.lib_dir().join("libmlx.so");
    let mut ldd = Command::new("ldd");
    ldd.arg(&lib);
    if let Some(dir) = cuda_driver_dir() {
        ldd.env("LD_LIBRARY_PATH", dir);
    }
    let Ok(output) = ldd.output() else {
        return; // no ldd: let the linker speak
    };
    let missing: Vec<String> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|line| line.contains("not found"))
        .filter_map(|line| line.split_whitespace().next().map(str::to_owned))
        .collect();
    if missing.is_empty() {
        return;
    }
    let hint = if target.cuda && missing.iter().any(|m| m.starts_with("libcuda.so")) {
        "libcuda.so.1 comes with the NVIDIA driver, not with a wheel: the `cuda` feature \
         needs a machine with an NVIDIA driver installed (nvidia-smi works). Build without \
         `--features cuda` for the CPU runtime."
    } else {
        "The wheel's own libraries should sit beside it; reinstall it by deleting the cache \
         entry (see docs/build.md) or fix MLX_DIR."
    };
    fail(format!(
        "libmlx at {} needs shared libraries that are not installed: {}. {hint}",
        lib.display(),
        missing.join(", ")
    ));
}

/// The directory holding the NVIDIA driver's libcuda.so.1, if this machine has one.
fn cuda_driver_dir() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = env::var("LD_LIBRARY_PATH")
        .unwrap_or_default()
        .split(':')
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .collect();
    candidates.extend(
        [
            "/usr/local/nvidia/lib64",
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
            "/usr/lib64",
        ]
        .map(PathBuf::from),
    );
    candidates
        .into_iter()
        .find(|dir| Path::new(dir).join("libcuda.so.1").exists())
}
