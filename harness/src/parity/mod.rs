//! Parity gates. `runtime`: the model-free MLX golden (Rust vs Python mlx, bit for bit).
//! `l1`: the engine vs mlx-lm on the tiny models. `sampling`: mlx-lm's sampler chain, seeded.

pub mod l1;
pub mod runtime;
pub mod sampling;
