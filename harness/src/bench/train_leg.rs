//! What every train-suite leg shares: the LoRA rank and the leg's result line.

use serde::{Deserialize, Serialize};

/// LoRA rank on every linear of every block, for every stack.
pub const RANK: i32 = 8;

/// One fresh-process leg's result: median step time and the step's peak memory.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainLeg {
    pub stack: String,
    pub step_s: f64,
    pub peak_memory_bytes: f64,
}
