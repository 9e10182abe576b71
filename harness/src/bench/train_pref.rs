//! The train suite's preference legs, one step each on the ORPO legs' models, pairs and
//! LoRA — the engine's default prefix-shared forward over chosen and rejected, LoRA
//! gradients, AdamW update — against mlx-lm-lora 5.10.2's step for the same method
//! (`oracles/train_leg.py --method …`, under `nn.value_and_grad`, compiled). Time and memory
//! are compared, not losses (mlx-lm-lora's CPO has no NLL term; TRL's has α = 1).
//! - DPO (sigmoid, β 0.1): reference log-probs computed once before the timed steps (the
//!   engine's `precompute_ref_log_probs`, the base model), as the peer's `get_token_scores`
//!   + `compute_score` + `dpo_loss` does with its reference.
//! - CPO (TRL's defaults: sigmoid, β 0.1, α 1): the peer's `cpo_loss_from_model` (sigmoid).
//! - SimPO (TRL's defaults: β 0.1, γ 0.5, α 0): mlx-lm-lora has no SimPO; its nearest step
//!   is CPO with length-normalized scores (`loss_type` "ipo": the mean log-prob per
//!   response, two forwards, no reference — SimPO's work), named `mlx-lm-lora-cpo-mean`.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Result};
use engine::train::data::Pair;
use engine::train::optim::{AdamW, Schedule};
use engine::train::preference::{pref_terms, reference_logps, reference_rows};
use engine::train::preference_cli::{PairMethod, PrefArgs};

use super::median;
use super::train_leg::TrainLeg;

/// Each preference method's name (as `--method` takes it), engine stack and peer stack.
pub const METHODS: [(&str, &str, &str); 3] = [
    ("dpo", "engine-dpo", "mlx-lm-lora-dpo"),
    ("cpo", "engine-cpo", "mlx-lm-lora-cpo"),
    ("simpo", "engine-simpo", "mlx-lm-lora-cpo-mean"),
];

/// The preference method a stack (the engine's or the peer's) runs, if it runs one.
pub fn method_of(stack: &str) -> Option<&'static str> {
    METHODS
        .iter()
        .find(|(_, e, p)| *e == stack || *p == stack)
        .map(|(m, _, _)| *m)
}

/// The engine's stack of `method`.
pub fn engine_stack(method: &str) -> Option<&'static str> {
    METHODS
        .iter()
        .find(|(m, _, _)| *m == method)
        .map(|(_, e, _)| *e)
}

/// The peer's stack of `method`.
pub fn peer_stack(method: &str) -> Option<&'static str> {
    METHODS
        .iter()
        .find(|(m, _, _)| *m == method)
        .map(|(_, _, p)| *p)
}

fn pair_method(method: &str) -> Result<PairMethod> {
    Ok(match method {
        "dpo" => PairMethod::Dpo,
        "cpo" => PairMethod::Cpo,
        "simpo" => PairMethod::Simpo,
        other => bail!("no preference leg for method {other:?} (dpo, cpo, simpo)"),
    })
}

/// One engine leg of `method` in this process (`harness leg-train --method dpo|cpo|simpo`).
pub fn leg(
    model: &Path,
    pairs_file: &Path,
    steps: usize,
    num_layers: usize,
    method: &str,
) -> Result<TrainLeg> {
    let stack = engine_stack(method).unwrap_or("engine");
    let obj = PrefArgs::default().objective(pair_method(method)?);
    let m = engine::model::load(model)?;
    let pairs = super::train_leg::load_pairs(pairs_file)?;
    let adapters = super::train_leg::attach(m.as_ref(), num_layers)?;
    let all: Vec<usize> = (0..pairs.len()).collect();
    let reference = match obj.needs_reference() {
        true => {
            let r = reference_logps(m.as_ref(), &adapters, &pairs, pairs.len())?;
            Some(reference_rows(&r, &all))
        }
        false => None,
    };
    let refs: Vec<&Pair> = pairs.iter().collect();
    let (ids, _, rm) = engine::train::orpo::pair_batch(&refs);
    let p = engine::train::orpo_prefix::shared_prefix_len(&refs, ids.shape()[1] as usize) as i32;
    let from = engine::train::orpo_prefix::first_response_step(&refs);
    let mut opt = AdamW::new(Schedule::Constant(1e-4), 0.01);
    let mut times = Vec::new();
    for i in 0..steps + 2 {
        if i == 2 {
            engine::runtime::reset_peak_memory()?;
        }
        let t0 = Instant::now();
        let (out, grads) = engine::train::value_and_grad(&adapters, || {
            let logps = engine::train::orpo_prefix::prefix_shared_logps(m.as_ref(), &ids, p, from)?;
            Ok(pref_terms(&obj, &logps, &rm, reference.as_ref())?.into_vec())
        })?;
        engine::train::apply_update(&mut opt, &adapters, &grads, &[&out[0]])?;
        if i >= 2 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(TrainLeg {
        stack: stack.into(),
        step_s: median(times),
        peak_memory_bytes: engine::runtime::memory()?.peak as f64,
    })
}
