//! The train suite's DPO legs: one DPO step (sigmoid loss, β 0.1) — the engine's default
//! prefix-shared forward over chosen and rejected, LoRA gradients, AdamW update — with the reference log-probs
//! computed once before the timed steps (the engine's `precompute_ref_log_probs`, the base
//! model), against mlx-lm-lora 5.10.2's DPO step (`oracles/train_leg.py --method dpo`: its
//! `get_token_scores`, `compute_score` and `dpo_loss` under `nn.value_and_grad`, compiled,
//! reference scores likewise computed once). Same models, pairs and LoRA as the ORPO legs;
//! time and memory compared, not losses.

use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use engine::train::data::Pair;
use engine::train::optim::{AdamW, Schedule};
use engine::train::preference::{
    pref_terms, reference_logps, reference_rows, DpoLoss, PairObjective,
};
use serde::Deserialize;

use super::median;
use super::train_leg::TrainLeg;

/// The engine's DPO stack name.
pub const ENGINE: &str = "engine-dpo";
/// mlx-lm-lora's DPO stack name.
pub const PEER: &str = "mlx-lm-lora-dpo";

#[derive(Deserialize)]
struct PairIds {
    prompt_len: usize,
    chosen: Vec<u32>,
    rejected: Vec<u32>,
}

/// One engine DPO leg in this process (`harness leg-train --method dpo`).
pub fn leg(model: &Path, pairs_file: &Path, steps: usize, num_layers: usize) -> Result<TrainLeg> {
    let m = engine::model::load(model)?;
    let ids: Vec<PairIds> = serde_json::from_str(&std::fs::read_to_string(pairs_file)?)?;
    let pairs: Vec<Pair> = ids
        .into_iter()
        .map(|p| Pair {
            prompt_len: p.prompt_len,
            chosen: p.chosen,
            rejected: p.rejected,
        })
        .collect();
    let adapters = super::train_leg::attach(m.as_ref(), num_layers)?;
    let reference = reference_logps(m.as_ref(), &adapters, &pairs, pairs.len())?;
    let all: Vec<usize> = (0..pairs.len()).collect();
    let reference = reference_rows(&reference, &all);
    let refs: Vec<&Pair> = pairs.iter().collect();
    let (ids, _, rm) = engine::train::orpo::pair_batch(&refs);
    let p = engine::train::orpo_prefix::shared_prefix_len(&refs, ids.shape()[1] as usize) as i32;
    let obj = PairObjective::Dpo {
        beta: 0.1,
        loss: DpoLoss::Sigmoid,
        label_smoothing: 0.0,
    };
    let mut opt = AdamW::new(Schedule::Constant(1e-4), 0.01);
    let mut times = Vec::new();
    for i in 0..steps + 2 {
        if i == 2 {
            engine::runtime::reset_peak_memory()?;
        }
        let t0 = Instant::now();
        let (out, grads) = engine::train::value_and_grad(&adapters, || {
            let logps = engine::train::orpo_prefix::prefix_shared_logps(m.as_ref(), &ids, p)?;
            Ok(pref_terms(&obj, &logps, &rm, Some(&reference))?.into_vec())
        })?;
        engine::train::apply_update(&mut opt, &adapters, &grads, &[&out[0]])?;
        if i >= 2 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(TrainLeg {
        stack: ENGINE.into(),
        step_s: median(times),
        peak_memory_bytes: engine::runtime::memory()?.peak as f64,
    })
}
