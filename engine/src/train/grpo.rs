//! GRPO's objective (Shao et al. 2024) as trl 1.16.0's `GRPOTrainer` defines it
//! (`trl/trainer/grpo_trainer.py`), from per-token log-probabilities of sampled completions.
//!
//! Advantages (`_generate_and_score_completions`, "sum_then_normalize"): a completion's
//! reward is r = Σ_k w_k·r_k over the reward functions that scored it (NaN when none did);
//! within each group of G completions of one prompt, A = (r − mean_g) / (std_g + 1e-4), the
//! mean NaN-aware and the std Bessel-corrected (trl's `nanstd`); `--grpo-scale-rewards batch`
//! takes the std over the whole batch, `none` does not divide; a NaN advantage becomes 0.
//!
//! Loss (`_compute_loss`, token-level importance sampling): with ρ = exp(logp − logp_old)
//! (logp_old = logp with its gradient stopped when each generation is used once),
//! ℓ_t = −min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A) + β·(exp(ref − logp) − (ref − logp) − 1),
//! reduced over the completion tokens: "grpo" the mean over rows of each row's token mean,
//! "bnpo" and "dapo" (one process, no accumulation: the same) Σ ℓ·mask / Σ mask, "dr_grpo"
//! Σ ℓ·mask / (rows · max completion length). The float64 oracle is `oracles/grpo_reference.py`.
//!
//! A micro-batch of the rows (the update runs one prompt's group at a time, as mlx-lm-lora
//! does, so one group's activations live at a time) takes the whole batch's token and row
//! counts (`BatchTotals`) as its denominators: every reduction above is a sum over rows
//! divided by one of them, so the micro-batches' terms and gradients add up to the batch's.

use mlx_rs::error::Exception;
use mlx_rs::ops::{clip, exp, maximum, minimum};
use mlx_rs::{Array, Dtype};

/// How per-token losses become the scalar loss (TRL's `loss_type`; "dapo" is its default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum GrpoLoss {
    Grpo,
    Bnpo,
    #[default]
    Dapo,
    #[value(name = "dr_grpo")]
    DrGrpo,
}

/// How advantages are scaled (TRL's `scale_rewards`; "group" is its default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum RewardScale {
    #[default]
    Group,
    Batch,
    None,
}

/// The loss's knobs (TRL's defaults: ε 0.2 both sides, β 0).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct GrpoLossConfig {
    pub loss_type: GrpoLoss,
    pub epsilon_low: f32,
    pub epsilon_high: f32,
    pub beta: f32,
    /// dr_grpo's constant: the completion length limit.
    pub max_completion_length: usize,
}

/// One batch's GRPO numbers (scalars).
pub struct GrpoTerms {
    pub loss: Array,
    /// Masked mean of the per-token KL estimate (0 without a reference).
    pub kl: Array,
    /// Fraction of completion tokens whose ratio was clipped (low with A < 0, high with A > 0).
    pub clip_ratio: Array,
}

impl GrpoTerms {
    pub const NAMES: [&'static str; 3] = ["loss", "kl", "clip_ratio"];

    pub fn into_vec(self) -> Vec<Array> {
        vec![self.loss, self.kl, self.clip_ratio]
    }
}

/// The whole batch's denominators, for terms taken over a micro-batch of its rows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchTotals {
    /// Completion tokens (Σ mask) of the whole batch.
    pub tokens: f32,
    /// Rows of the whole batch.
    pub rows: f32,
}

/// The sample standard deviation (n − 1) of the finite values, NaN below two.
pub fn nanstd(values: &[f64]) -> f64 {
    let kept: Vec<f64> = values.iter().copied().filter(|v| !v.is_nan()).collect();
    let n = kept.len() as f64;
    if kept.len() < 2 {
        return f64::NAN;
    }
    let mean = kept.iter().sum::<f64>() / n;
    let var = kept.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    (var * n / (n - 1.0)).sqrt()
}

/// The mean of the finite values (NaN when there are none).
pub fn nanmean(values: &[f64]) -> f64 {
    let kept: Vec<f64> = values.iter().copied().filter(|v| !v.is_nan()).collect();
    kept.iter().sum::<f64>() / kept.len() as f64
}

/// Each completion's reward (None: no function scored it) and advantage, for `per_func`
/// [rows][functions] (None: that function did not score the row) in groups of `group`
/// consecutive rows.
pub fn advantages(
    per_func: &[Vec<Option<f64>>],
    weights: &[f64],
    group: usize,
    scale: RewardScale,
) -> (Vec<Option<f64>>, Vec<f32>) {
    let rewards: Vec<f64> = per_func
        .iter()
        .map(|row| {
            if row.iter().all(Option::is_none) {
                return f64::NAN;
            }
            row.iter()
                .zip(weights)
                .filter_map(|(r, w)| r.map(|r| r * w))
                .sum()
        })
        .collect();
    let batch_std = nanstd(&rewards);
    let group = group.max(1);
    let mut adv = Vec::with_capacity(rewards.len());
    for g in rewards.chunks(group) {
        // The planted defect normalizes by the whole batch's mean instead of the group's.
        let mean = if crate::plant::is(crate::plant::Defect::GrpoBatchMeanBaseline) {
            nanmean(&rewards)
        } else {
            nanmean(g)
        };
        let std = match scale {
            RewardScale::Batch => batch_std,
            _ => nanstd(g),
        };
        for r in g {
            let a = r - mean;
            let a = if scale == RewardScale::None {
                a
            } else {
                a / (std + 1e-4)
            };
            adv.push(if a.is_nan() { 0.0 } else { a as f32 });
        }
    }
    let rewards = rewards
        .into_iter()
        .map(|r| (!r.is_nan()).then_some(r))
        .collect();
    (rewards, adv)
}

/// The GRPO terms from the completions' per-token log-probabilities [N, T] (f32), the
/// old policy's (None: these, gradient-stopped), the reference's (needed when β ≠ 0), the
/// completion mask [N, T] (f32) and the advantages [N]; over a micro-batch of a batch whose
/// denominators are `totals` (None: this is the whole batch), so that the micro-batches'
/// terms sum to the batch's.
pub fn grpo_terms(
    logps: &Array,
    old: Option<&Array>,
    reference: Option<&Array>,
    mask: &Array,
    advantages: &Array,
    cfg: &GrpoLossConfig,
    totals: Option<BatchTotals>,
) -> Result<GrpoTerms, Exception> {
    let f = |x: f32| Array::from_f32(x);
    // Planted: each micro-batch divides by its own counts, as if it were the batch.
    let totals =
        totals.filter(|_| !crate::plant::is(crate::plant::Defect::GrpoMicroBatchOwnTotals));
    let old = match old {
        Some(o) => o.clone(),
        None => mlx_rs::stop_gradient(logps)?,
    };
    let ratio = exp(logps.subtract(&old)?)?;
    let (lo, hi) = (1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high);
    let clipped = clip(&ratio, (f(lo), f(hi)))?;
    let a = advantages.expand_dims(-1)?;
    let mut per_token = minimum(ratio.multiply(&a)?, clipped.multiply(&a)?)?.negative()?;
    let n_tokens = match totals {
        Some(t) => f(t.tokens.max(1.0)),
        None => maximum(mask.sum(None)?, f(1.0))?,
    };
    let masked_mean =
        |x: &Array| -> Result<Array, Exception> { x.multiply(mask)?.sum(None)?.divide(&n_tokens) };
    let kl = match (cfg.beta != 0.0, reference) {
        (false, _) => f(0.0),
        (true, None) => {
            return Err(Exception::custom(
                "GRPO with β ≠ 0 needs the reference model's log-probabilities",
            ))
        }
        (true, Some(r)) => {
            let d = r.subtract(logps)?;
            let per_token_kl = exp(&d)?.subtract(&d)?.subtract(f(1.0))?;
            per_token = per_token.add(per_token_kl.multiply(f(cfg.beta))?)?;
            masked_mean(&per_token_kl)?
        }
    };
    let zero = f(0.0);
    let low = ratio.lt(f(lo))?.logical_and(&a.lt(&zero)?)?;
    let high = ratio.gt(f(hi))?.logical_and(&a.gt(&zero)?)?;
    let clip_ratio = masked_mean(&low.logical_or(&high)?.as_dtype(Dtype::Float32)?)?;
    let rows = totals.map_or(logps.shape()[0] as f32, |t| t.rows);
    let loss = match cfg.loss_type {
        GrpoLoss::Grpo => {
            let per_row = maximum(mask.sum_axis(-1, false)?, f(1.0))?;
            let row_means = per_token
                .multiply(mask)?
                .sum_axis(-1, false)?
                .divide(&per_row)?;
            match totals {
                Some(_) => row_means.sum(None)?.divide(f(rows))?,
                None => row_means.mean(None)?,
            }
        }
        GrpoLoss::Bnpo | GrpoLoss::Dapo => masked_mean(&per_token)?,
        GrpoLoss::DrGrpo => per_token
            .multiply(mask)?
            .sum(None)?
            .divide(f(rows * cfg.max_completion_length as f32))?,
    };
    Ok(GrpoTerms {
        loss,
        kl,
        clip_ratio,
    })
}

#[cfg(test)]
mod tests {
    use super::{advantages, RewardScale};

    #[test]
    fn a_group_whose_rewards_are_equal_gets_zero_advantages_and_unscored_rows_get_zero() {
        let rows = vec![
            vec![Some(1.0)],
            vec![Some(1.0)],
            vec![Some(0.0)],
            vec![None],
        ];
        let (r, a) = advantages(&rows, &[1.0], 2, RewardScale::Group);
        assert_eq!(a[..2], [0.0, 0.0]);
        assert_eq!(r[3], None);
        assert_eq!(a[3], 0.0);
        // One scored row in its group: its std is NaN, so its advantage is 0 as well.
        assert_eq!(a[2], 0.0);
    }
}
