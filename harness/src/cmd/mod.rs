//! Command handlers of the `harness` binary.

pub mod bench;
pub mod dist_rank;
pub mod doctor;
pub mod eval;
pub mod goldens;
pub mod parity;
pub mod probe;
pub mod results;
pub mod serve_check;
pub mod serve_diff_vision;
pub mod sweep;

/// The built-in default model (committed under goldens/models).
pub const DEFAULT_MODEL: &str = "tiny-llama-trained";
