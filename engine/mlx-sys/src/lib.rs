//! Raw bindings to mlx-c 0.7.0, compiled here against the MLX runtime of the official
//! PyPI wheel (see `docs/build.md`). The items are exactly what bindgen produces for
//! mlx-c's public headers, as in the upstream `mlx-sys` 0.7.0 package.
#![allow(non_upper_case_globals)]
#![allow(non_camel_case_types)]
#![allow(non_snake_case)]
#![allow(clippy::all)]
#![allow(rustdoc::all)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));
