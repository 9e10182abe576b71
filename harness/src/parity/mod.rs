//! Parity gates. `runtime`: the model-free MLX golden (Rust vs Python mlx, bit for bit).
//! `l1`: the engine vs mlx-lm on the tiny models. `sampling`: mlx-lm's sampler chain, seeded.

pub mod batch;
pub mod detok;
pub mod l1;
pub mod l2;
pub mod l3;
pub mod runtime;
pub mod sampling;
pub mod spec;
pub mod spec_l2;
pub mod train;

/// Why a parity gate could not run (a failing gate is a report, not an error).
#[derive(Debug, thiserror::Error)]
pub enum ParityError {
    #[error(transparent)]
    Golden(#[from] crate::goldens::GoldenError),
    #[error("golden index: {0}")]
    Index(String),
    #[error("engine: {0}")]
    Load(#[from] engine::load::LoadError),
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
    #[error("unknown case `{0}`")]
    UnknownCase(String),
}
