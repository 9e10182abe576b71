// Included (`include!`) by the build script of every crate that produces binaries or tests
// and depends on `mlx-sys` directly. Cargo only applies `rustc-link-arg` to the targets of
// the package whose build script prints it, so each such package forwards mlx-sys's
// `DEP_MLX_*` metadata itself: an rpath to the wheel's lib dir (binaries, tests and copies
// of them run without LD_LIBRARY_PATH) and where libmlx came from (for `engine doctor`).

fn forward_mlx_link_args() {
    let var = |name: &str| {
        std::env::var(name).unwrap_or_else(|_| {
            panic!("{name} is unset: this crate must depend on mlx-sys directly (links = \"mlx\")")
        })
    };
    let lib_dir = var("DEP_MLX_LIB_DIR");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
    if let Ok(dir) = std::env::var("DEP_MLX_RPATH_LINK") {
        println!("cargo:rustc-link-arg=-Wl,-rpath-link,{dir}");
    }
    println!("cargo:rustc-env=MLX_RUNTIME_LIB_DIR={lib_dir}");
    println!("cargo:rustc-env=MLX_RUNTIME_SOURCE={}", var("DEP_MLX_SOURCE"));
    println!("cargo:rustc-env=MLX_RUNTIME_VERSION={}", var("DEP_MLX_VERSION"));
}
