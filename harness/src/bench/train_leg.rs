//! What every train-suite leg shares: the LoRA rank and the leg's result line.

use engine::model::LanguageModel;
use engine::train::lora::{AdapterConfig, Adapters};
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

/// One token pair as the legs' pairs file holds it.
#[derive(Serialize, Deserialize)]
pub struct PairIds {
    pub prompt_len: usize,
    pub chosen: Vec<u32>,
    pub rejected: Vec<u32>,
}

/// The token pairs a leg trains on (the file the suite writes).
pub fn load_pairs(pairs_file: &std::path::Path) -> anyhow::Result<Vec<engine::train::data::Pair>> {
    let ids: Vec<PairIds> = serde_json::from_str(&std::fs::read_to_string(pairs_file)?)?;
    Ok(ids
        .into_iter()
        .map(|p| engine::train::data::Pair {
            prompt_len: p.prompt_len,
            chosen: p.chosen,
            rejected: p.rejected,
        })
        .collect())
}

/// Every stack's adapters: LoRA rank `RANK`, scale 20, on every linear of the last
/// `num_layers` blocks (mlx-lm's `linear_to_lora_layers` on the peer's side), seed 0.
pub fn attach(m: &dyn LanguageModel, num_layers: usize) -> anyhow::Result<Adapters<'_>> {
    let config = AdapterConfig::lora(num_layers, RANK);
    Ok(Adapters::attach(m, config, 0)?)
}
