//! Builds mlx-c 0.7.0 against the MLX runtime of the official PyPI wheel.
//!
//! 1. find the runtime (`MLX_DIR`, or the pinned wheel installed into our cache dir);
//! 2. find mlx-c's sources inside the crates.io `mlx-sys` 0.7.0 package (through cargo);
//! 3. compile them with `cc`, plus the small shims Linux needs;
//! 4. generate the bindings with bindgen (finding or installing a libclang);
//! 5. link libmlx and publish its location to dependents as `DEP_MLX_*`.
//!
//! Steps 3 and 4 are skipped when an earlier run built the same from the same inputs
//! (`reuse`: cargo runs this script again whenever anything it depends on changes hash).
//!
//! `docs/build.md` explains each step and every environment override.

mod cache;
mod libclang;
mod mlxc;
mod reuse;
mod runtime;

use std::env;
use std::path::PathBuf;

fn main() {
    for var in [
        "MLX_DIR",
        "ENGINE_CACHE_DIR",
        "LIBCLANG_PATH",
        "ENGINE_PYTHON",
        "MLX_C_SRC",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=build");
    println!("cargo:rerun-if-changed=csrc");

    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let target = Target::from_env();

    let runtime = runtime::locate(&target);
    let mlx_c = mlxc::locate_sources(&out_dir);
    let entry = reuse::entry(&target, &mlx_c, &runtime, &out_dir);
    if reuse::restore(&entry, &out_dir) {
        mlxc::link_restored(&target, &out_dir);
    } else {
        mlxc::compile(&target, &mlx_c, &runtime);
        libclang::ensure(&target);
        mlxc::generate_bindings(&target, &mlx_c, &runtime, &out_dir);
        reuse::store(&entry, &out_dir);
    }
    mlxc::compile_shims(&target);
    runtime.link(&target);
}

/// What we are building for, read from cargo's environment (never `cfg!`: a build
/// script runs on the host).
pub struct Target {
    pub os: String,
    pub arch: String,
    pub cuda: bool,
}

impl Target {
    fn from_env() -> Self {
        let var = |name: &str| env::var(name).unwrap_or_default();
        Target {
            os: var("CARGO_CFG_TARGET_OS"),
            arch: var("CARGO_CFG_TARGET_ARCH"),
            cuda: env::var_os("CARGO_FEATURE_CUDA").is_some(),
        }
    }

    pub fn is_macos(&self) -> bool {
        self.os == "macos"
    }
}

/// Fails the build with one readable message (cargo prints panics from build scripts
/// verbatim; the message says what went wrong and what to do).
pub fn fail(message: impl AsRef<str>) -> ! {
    eprintln!("\nerror: {}\n", message.as_ref());
    panic!("{}", message.as_ref());
}
