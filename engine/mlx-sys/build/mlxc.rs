//! mlx-c: its sources come from the crates.io `mlx-sys` 0.7.0 package (resolved by cargo,
//! never copied into this repository); we compile them against the wheel's headers.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::runtime::Runtime;
use crate::{fail, Target};

const UPSTREAM: &str = "mlx-sys";
const UPSTREAM_VERSION: &str = "0.7.0";

/// Returns the `mlx-c` directory of the upstream package. `MLX_C_SRC` overrides it (an
/// mlx-c 0.7.0 checkout), e.g. for offline builds.
pub fn locate_sources(out_dir: &Path) -> PathBuf {
    if let Some(dir) = env::var_os("MLX_C_SRC") {
        return checked(PathBuf::from(dir));
    }
    // A one-dependency manifest of its own ([workspace] keeps it out of ours, so our
    // [patch] does not apply and cargo resolves the real package from the registry).
    let helper = out_dir.join("upstream-mlx-sys");
    fs::create_dir_all(helper.join("src")).expect("create helper manifest dir");
    fs::write(
        helper.join("Cargo.toml"),
        format!(
            "[package]\nname = \"upstream-mlx-sys-locator\"\nversion = \"0.0.0\"\nedition = \"2021\"\npublish = false\n\n\
             [dependencies]\n{UPSTREAM} = {{ version = \"={UPSTREAM_VERSION}\", default-features = false }}\n\n[workspace]\n"
        ),
    )
    .expect("write helper manifest");
    fs::write(helper.join("src/lib.rs"), "").expect("write helper lib");

    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let output = Command::new(&cargo)
        .args(["metadata", "--format-version", "1", "--manifest-path"])
        .arg(helper.join("Cargo.toml"))
        .env_remove("CARGO_TARGET_DIR")
        .output()
        .unwrap_or_else(|e| fail(format!("could not run `{cargo} metadata`: {e}")));
    if !output.status.success() {
        fail(format!(
            "`cargo metadata` could not fetch {UPSTREAM} {UPSTREAM_VERSION} (whose package carries \
             the mlx-c sources we compile):\n{}\nCheck access to crates.io, or set MLX_C_SRC to an \
             mlx-c 0.7.0 source directory.",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let metadata: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("cargo metadata prints JSON");
    let manifest = metadata["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == UPSTREAM && p["version"] == UPSTREAM_VERSION)
        .and_then(|p| p["manifest_path"].as_str())
        .unwrap_or_else(|| {
            fail(format!(
                "cargo metadata did not list {UPSTREAM} {UPSTREAM_VERSION}"
            ))
        });
    checked(Path::new(manifest).parent().unwrap().join("src/mlx-c"))
}

fn checked(dir: PathBuf) -> PathBuf {
    if !dir.join("mlx/c/mlx.h").is_file() || !dir.join("CMakeLists.txt").is_file() {
        fail(format!(
            "{} does not look like mlx-c 0.7.0 (no mlx/c/mlx.h or CMakeLists.txt)",
            dir.display()
        ));
    }
    dir
}

/// The translation units mlx-c's own CMakeLists builds (commented-out entries skipped).
fn sources(mlx_c: &Path) -> Vec<PathBuf> {
    let cmake = fs::read_to_string(mlx_c.join("CMakeLists.txt")).expect("read CMakeLists.txt");
    let block = cmake
        .split_once("set(mlxc-src")
        .and_then(|(_, rest)| rest.split_once(')'))
        .map(|(block, _)| block)
        .unwrap_or_else(|| fail("mlx-c's CMakeLists.txt has no `set(mlxc-src ...)` list"));
    let files: Vec<PathBuf> = block
        .lines()
        .map(str::trim)
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.strip_prefix("${CMAKE_CURRENT_LIST_DIR}/"))
        .map(|rel| mlx_c.join(rel))
        .collect();
    if files.is_empty() {
        fail("mlx-c's source list is empty");
    }
    files
}

fn csrc(name: &str) -> PathBuf {
    PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap())
        .join("csrc")
        .join(name)
}

/// aarch64 compilers have __fp16/__bf16 and mlx-c's own half.h; elsewhere ours.
fn needs_half_shim(target: &Target) -> bool {
    target.arch != "aarch64"
}

pub fn compile(target: &Target, mlx_c: &Path, runtime: &Runtime) {
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++20")
        .pic(true)
        .warnings(false)
        .include(mlx_c)
        .include(runtime.include_dir())
        .flag_if_supported("-Wno-deprecated-declarations")
        .files(sources(mlx_c));
    // Force-included ahead of every translation unit: std::format where libstdc++ lacks it.
    build
        .flag("-include")
        .flag(csrc("format_fallback.h").to_str().unwrap());
    if needs_half_shim(target) {
        build
            .flag("-include")
            .flag(csrc("half_x86.h").to_str().unwrap());
    }
    if target.is_macos() {
        build.define("_METAL_", None);
        build.define("ACCELERATE_NEW_LAPACK", None);
    }
    build.compile("mlxc");
}

/// Links the `libmlxc.a` that `reuse::restore` put into OUT_DIR, with the lines cc's
/// `compile` prints for it.
pub fn link_restored(target: &Target, out_dir: &Path) {
    println!("cargo:rustc-link-lib=static=mlxc");
    println!("cargo:rustc-link-search=native={}", out_dir.display());
    println!(
        "cargo:rustc-link-lib={}",
        if target.is_macos() { "c++" } else { "stdc++" }
    );
}

/// The small shims Linux needs (one C file, compiled every time).
pub fn compile_shims(target: &Target) {
    if !target.is_macos() {
        cc::Build::new()
            .file(csrc("linux_shims.c"))
            .pic(true)
            .compile("mlx_engine_shims");
    }
}

pub fn generate_bindings(target: &Target, mlx_c: &Path, _runtime: &Runtime, out_dir: &Path) {
    let mut headers: Vec<PathBuf> = fs::read_dir(mlx_c.join("mlx/c"))
        .expect("read mlx-c headers")
        .map(|entry| entry.expect("dir entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "h"))
        .collect();
    headers.sort();

    let mut builder = bindgen::Builder::default()
        .rust_target("1.73.0".parse().expect("rust target"))
        .clang_arg(format!("-I{}", mlx_c.display()))
        .blocklist_function("malloc")
        .blocklist_function("realloc");
    for dir in crate::libclang::extra_include_dirs() {
        builder = builder.clang_arg(format!("-isystem{}", dir.display()));
    }
    if needs_half_shim(target) {
        builder = builder
            .clang_arg("-include")
            .clang_arg(csrc("half_x86.h").to_string_lossy())
            .blocklist_type("float16_t")
            .blocklist_type("bfloat16_t")
            .blocklist_type("mlx_float16_storage")
            .raw_line(
                "/// IEEE half-precision bits (the shape bindgen gives `__fp16` on aarch64).\n\
                 #[repr(transparent)]\n\
                 #[derive(Debug, Default, Copy, Clone, PartialEq, Eq, Hash)]\n\
                 pub struct float16_t(pub u16);\n\
                 /// bfloat16 bits (the shape bindgen gives `__bf16` on aarch64).\n\
                 pub type bfloat16_t = u16;",
            );
    }
    for header in &headers {
        builder = builder.header(header.to_string_lossy());
    }
    let bindings = builder.generate().unwrap_or_else(|e| {
        fail(format!(
            "bindgen could not parse mlx-c's headers: {e}. If libclang's own headers are \
             missing, set BINDGEN_EXTRA_CLANG_ARGS=-isystem<dir with stddef.h> (see docs/build.md)."
        ))
    });
    bindings
        .write_to_file(out_dir.join("bindings.rs"))
        .expect("write bindings.rs");
}
