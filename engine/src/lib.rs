//! The engine: an LLM runtime on MLX (through mlx-rs). See `docs/` for one page per
//! subsystem. MLX is not thread-safe: all MLX work of one model stays on one thread.

mod alloc;
pub mod cache;
pub mod clock;
pub mod constrain;
pub mod convert;
pub mod dist;
pub mod embed;
pub mod generate;
pub mod load;
pub mod model;
pub mod plant;
pub mod pyfmt;
pub mod runtime;
pub mod scalar;
pub mod serve;
pub mod tiers;
pub mod train;
pub mod vision;

/// The engine crate's version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
