//! Parity gates. `runtime`: the model-free MLX golden (Rust vs Python mlx, bit for bit).
//! `l1`: the engine vs mlx-lm on the tiny models.

pub mod l1;
pub mod runtime;
