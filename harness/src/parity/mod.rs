//! Parity gates. `runtime`: the model-free MLX golden (Rust vs Python mlx, bit for bit).

pub mod runtime;
