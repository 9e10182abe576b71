//! The process's allocator on Linux: mimalloc, for every allocation in the process, Rust's
//! and libmlx's alike. Built with its `override` feature, it defines `malloc`, `free` and
//! the rest in the executable, which take precedence over glibc's for libmlx and libstdc++
//! too. That is where the time goes for small models: each MLX op allocates its graph
//! node, shared pointers and output buffer on the calling thread and frees them on the
//! stream's thread, and glibc's arenas serialize those cross-thread frees on a lock (a
//! 64-step decode of a tiny model spent ~20 % of its time in malloc, free and the futex
//! waits of their locks). The numbers are in docs/build.md ("The process allocator").
//!
//! A library may name the global allocator: every binary that links the engine (the
//! `engine` and `harness` binaries, the test binaries) gets it. macOS keeps its own
//! (its malloc zones are not replaced by symbol interposition). The engine's own unit-test
//! build leaves it out: that binary links a second copy of this crate (the dev-dependency
//! with the `plant` feature), whose allocator it then uses.

#[cfg(all(target_os = "linux", not(test)))]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
