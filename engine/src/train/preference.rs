//! DPO, CPO and SimPO: pair objectives on the per-token log-probs of one joint forward over
//! a batch's chosen rows, then its rejected rows (`orpo::pair_batch`), as TRL 1.16 defines
//! them. ℓ⁺, ℓ⁻ are a pair's chosen and rejected response log-probs: the SUM over its
//! response targets (DPO, CPO), or their MEAN (SimPO); ℓ⁺_ref, ℓ⁻_ref the reference model's
//! sums. All losses are means over the B pairs.
//!
//! - DPO (`trl/trainer/dpo_trainer.py: DPOTrainer._compute_loss`, reverse KL, one loss
//!   type): Δ = (ℓ⁺ − ℓ⁺_ref) − (ℓ⁻ − ℓ⁻_ref);
//!   sigmoid −log σ(βΔ); hinge relu(1 − βΔ); robust (−(1−ε) log σ(βΔ) + ε log σ(−βΔ)) /
//!   (1 − 2ε); ipo (Δ⁺/n⁺ − Δ⁻/n⁻ − 1/(2β))² with Δ± = ℓ± − ℓ±_ref and n± = max(1, the
//!   response's token count) (TRL's per-token IPO). TRL 1.16's sigmoid, hinge and ipo do
//!   not read `label_smoothing`; robust does.
//! - CPO (`trl/experimental/cpo/cpo_trainer.py: CPOTrainer.cpo_loss`, loss_type sigmoid):
//!   −(1−ε) log σ(β(ℓ⁺ − ℓ⁻)) − ε log σ(−β(ℓ⁺ − ℓ⁻)), plus α·NLL, the NLL one token-weighted
//!   cross-entropy over the chosen responses (`concatenated_forward`, prompt labels −100;
//!   0 when α = 0, as TRL).
//! - SimPO (the same file, loss_type simpo): the CPO form on ℓ± means with the logits
//!   shifted by γ/β: (ℓ⁺ − ℓ⁻) − γ/β; α defaults to 0.
//!
//! Metrics as TRL logs them: rewards/chosen = mean β(ℓ⁺ − ℓ⁺_ref) (CPO/SimPO: β ℓ⁺),
//! rewards/rejected likewise, rewards/accuracies = share of pairs with a chosen reward above
//! the rejected one, rewards/margins = mean reward gap, logps/chosen and logps/rejected =
//! mean ℓ⁺, ℓ⁻ (CPO/SimPO also nll_loss). A further pair objective is one more
//! `PairObjective` variant: its `per_pair_loss` arm and its `NAMES`.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::maximum;
use mlx_rs::{Array, Dtype};

use super::data::Pair;
use super::loss::cross_entropy;
use super::orpo::pair_batch;
use crate::model::LanguageModel;
use crate::plant::{self, Defect};

/// DPO's loss types (TRL 1.16's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DpoLoss {
    #[default]
    Sigmoid,
    Hinge,
    Ipo,
    /// Robust DPO: the sigmoid loss debiased for labels flipped with probability ε.
    Robust,
}

/// A preference objective over pairs and its hyper-parameters (defaults: TRL 1.16's).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
#[serde(rename_all = "lowercase", tag = "method")]
pub enum PairObjective {
    Dpo {
        beta: f32,
        loss: DpoLoss,
        label_smoothing: f32,
    },
    Cpo {
        beta: f32,
        label_smoothing: f32,
        cpo_alpha: f32,
    },
    Simpo {
        beta: f32,
        label_smoothing: f32,
        cpo_alpha: f32,
        gamma: f32,
    },
}

/// One batch's numbers (scalars): the loss and what TRL logs.
pub struct PrefTerms {
    pub loss: Array,
    pub rewards_chosen: Array,
    pub rewards_rejected: Array,
    pub accuracy: Array,
    pub margin: Array,
    pub logps_chosen: Array,
    pub logps_rejected: Array,
    /// CPO/SimPO only.
    pub nll: Option<Array>,
    /// Each pair's chosen score ℓ⁺ [B] (gradient-stopped; evals measure its noise for the
    /// dynamic-weight controller). After the named terms in `into_vec`.
    pub chosen_rows: Array,
}

const DPO_NAMES: [&str; 7] = [
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
];
const CPO_NAMES: [&str; 8] = [
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "nll_loss",
];

impl PrefTerms {
    pub fn into_vec(self) -> Vec<Array> {
        let mut v = vec![
            self.loss,
            self.rewards_chosen,
            self.rewards_rejected,
            self.accuracy,
            self.margin,
            self.logps_chosen,
            self.logps_rejected,
        ];
        v.extend(self.nll);
        v.push(self.chosen_rows);
        v
    }
}

impl PairObjective {
    /// The names of `PrefTerms::into_vec`'s entries, in order.
    pub fn names(&self) -> &'static [&'static str] {
        match self {
            PairObjective::Dpo { .. } => &DPO_NAMES,
            _ => &CPO_NAMES,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            PairObjective::Dpo { .. } => "dpo",
            PairObjective::Cpo { .. } => "cpo",
            PairObjective::Simpo { .. } => "simpo",
        }
    }

    /// The weight `w` of this objective (None: it has no such weight).
    pub fn weight(&self, w: super::lambda::Actuated) -> Option<f32> {
        use super::lambda::Actuated;
        match (*self, w) {
            (_, Actuated::Beta) => Some(self.beta()),
            (PairObjective::Simpo { gamma, .. }, Actuated::Gamma) => Some(gamma),
            _ => None,
        }
    }

    /// This objective with weight `w` set to `value` (unchanged where it has no such weight).
    pub fn with_weight(mut self, w: super::lambda::Actuated, value: f32) -> Self {
        use super::lambda::Actuated;
        match (&mut self, w) {
            (
                PairObjective::Dpo { beta, .. }
                | PairObjective::Cpo { beta, .. }
                | PairObjective::Simpo { beta, .. },
                Actuated::Beta,
            ) => *beta = value,
            (PairObjective::Simpo { gamma, .. }, Actuated::Gamma) => *gamma = value,
            _ => {}
        }
        self
    }

    pub fn beta(&self) -> f32 {
        match *self {
            PairObjective::Dpo { beta, .. }
            | PairObjective::Cpo { beta, .. }
            | PairObjective::Simpo { beta, .. } => beta,
        }
    }

    /// Whether the objective compares with a reference model (DPO).
    pub fn needs_reference(&self) -> bool {
        matches!(self, PairObjective::Dpo { .. })
    }

    /// SimPO scores a response by its mean log-prob; DPO and CPO by the sum.
    fn averages(&self) -> bool {
        matches!(self, PairObjective::Simpo { .. })
    }
}

fn scalar(x: f32) -> Array {
    Array::from_f32(x)
}

/// −(1 − ε)·log σ(βz) − ε·log σ(−βz): TRL's label-smoothed sigmoid loss (ε = 0: −log σ(βz)).
fn smoothed_sigmoid(z: &Array, beta: f32, eps: f32) -> Result<Array, Exception> {
    let bz = z.multiply(scalar(beta))?;
    let pos = mlx_rs::nn::log_sigmoid(&bz)?.multiply(scalar(1.0 - eps))?;
    let neg = mlx_rs::nn::log_sigmoid(bz.negative()?)?.multiply(scalar(eps))?;
    pos.add(neg)?.negative()
}

/// Each pair's loss [B] from the policy's scores `c`, `r` [B], the reference's (DPO) and
/// the response token counts `nc`, `nr` [B].
fn per_pair_loss(
    obj: &PairObjective,
    (c, r): (&Array, &Array),
    reference: Option<(&Array, &Array)>,
    (nc, nr): (&Array, &Array),
) -> Result<Array, Exception> {
    match *obj {
        PairObjective::Dpo {
            beta,
            loss,
            label_smoothing: eps,
        } => {
            let (rc, rr) = reference.expect("DPO needs reference log-probs");
            // Planted: β applied twice (β·βΔ).
            let beta = if plant::is(Defect::DpoBetaTwice) {
                beta * beta
            } else {
                beta
            };
            let (dc, dr) = (c.subtract(rc)?, r.subtract(rr)?);
            let delta = dc.subtract(&dr)?;
            match loss {
                DpoLoss::Sigmoid => smoothed_sigmoid(&delta, beta, 0.0),
                DpoLoss::Hinge => maximum(
                    scalar(1.0).subtract(delta.multiply(scalar(beta))?)?,
                    scalar(0.0),
                ),
                DpoLoss::Robust => {
                    let bd = delta.multiply(scalar(beta))?;
                    let clean = mlx_rs::nn::log_sigmoid(&bd)?.multiply(scalar(1.0 - eps))?;
                    let flipped = mlx_rs::nn::log_sigmoid(bd.negative()?)?.multiply(scalar(eps))?;
                    clean
                        .negative()?
                        .add(flipped)?
                        .divide(scalar(1.0 - 2.0 * eps))
                }
                DpoLoss::Ipo => {
                    let one = scalar(1.0);
                    let avg = dc
                        .divide(maximum(nc, &one)?)?
                        .subtract(dr.divide(maximum(nr, &one)?)?)?;
                    avg.subtract(scalar(1.0 / (2.0 * beta)))?.square()
                }
            }
        }
        PairObjective::Cpo {
            beta,
            label_smoothing,
            ..
        } => smoothed_sigmoid(&c.subtract(r)?, beta, label_smoothing),
        PairObjective::Simpo {
            beta,
            label_smoothing,
            gamma,
            ..
        } => {
            // Planted: the margin γ not divided by β.
            let shift = if plant::is(Defect::SimpoGammaNotOverBeta) {
                gamma
            } else {
                gamma / beta
            };
            let z = c.subtract(r)?.subtract(scalar(shift))?;
            smoothed_sigmoid(&z, beta, label_smoothing)
        }
    }
}

/// The objective's terms from per-token log-probs [2B, T] (chosen rows, then rejected), the
/// f32 response-target mask of the same shape, and (DPO) the reference's summed response
/// log-probs [2B] in the same row order.
pub fn pref_terms(
    obj: &PairObjective,
    token_logps: &Array,
    response_mask: &Array,
    reference: Option<&Array>,
) -> Result<PrefTerms, Exception> {
    let b = token_logps.shape()[0] / 2;
    let sums = token_logps.multiply(response_mask)?.sum_axis(-1, false)?;
    let counts = response_mask.sum_axis(-1, false)?;
    let scores = if obj.averages() {
        sums.divide(&counts)?
    } else {
        sums.clone()
    };
    let (c, r) = (scores.index(..b), scores.index(b..));
    // Planted: the reference log-probs are the policy's own (gradient stopped).
    let policy_as_ref;
    let reference = if plant::is(Defect::DpoReferenceFromPolicy) && reference.is_some() {
        policy_as_ref = mlx_rs::stop_gradient(&sums)?;
        Some(&policy_as_ref)
    } else {
        reference
    };
    let refs = reference.map(|a| (a.index(..b), a.index(b..)));
    let counts = (counts.index(..b), counts.index(b..));
    let losses = per_pair_loss(
        obj,
        (&c, &r),
        refs.as_ref().map(|(x, y)| (x, y)),
        (&counts.0, &counts.1),
    )?;
    let beta = scalar(obj.beta());
    let (rw_c, rw_r) = match &refs {
        Some((rc, rr)) => (c.subtract(rc)?, r.subtract(rr)?),
        None => (c.clone(), r.clone()),
    };
    let rw_c = mlx_rs::stop_gradient(rw_c.multiply(&beta)?)?;
    let rw_r = mlx_rs::stop_gradient(rw_r.multiply(&beta)?)?;
    let mean = |x: &Array| x.mean(None);
    let mut loss = mean(&losses)?;
    let nll = match *obj {
        PairObjective::Dpo { .. } => None,
        PairObjective::Cpo { cpo_alpha, .. } | PairObjective::Simpo { cpo_alpha, .. } => {
            let nll = chosen_response_nll(token_logps, response_mask, b, cpo_alpha)?;
            loss = loss.add(nll.multiply(scalar(cpo_alpha))?)?;
            Some(nll)
        }
    };
    Ok(PrefTerms {
        loss,
        accuracy: mean(&rw_c.gt(&rw_r)?.as_dtype(Dtype::Float32)?)?,
        margin: mean(&rw_c.subtract(&rw_r)?)?,
        rewards_chosen: mean(&rw_c)?,
        rewards_rejected: mean(&rw_r)?,
        logps_chosen: mlx_rs::stop_gradient(mean(&c)?)?,
        logps_rejected: mlx_rs::stop_gradient(mean(&r)?)?,
        nll,
        chosen_rows: mlx_rs::stop_gradient(&c)?,
    })
}

/// CPO's NLL: −Σ chosen response log-probs / Σ chosen response tokens (one cross-entropy
/// over the chosen half, prompt labels masked); TRL skips it (0) when α = 0.
fn chosen_response_nll(
    token_logps: &Array,
    response_mask: &Array,
    b: i32,
    alpha: f32,
) -> Result<Array, Exception> {
    if alpha == 0.0 {
        return Ok(scalar(0.0));
    }
    let mask = response_mask.index(..b);
    let sum = token_logps.index(..b).multiply(&mask)?.sum(None)?;
    sum.divide(mask.sum(None)?)?.negative()
}

/// Per-token log-probs [2B, T − 1] of a `pair_batch`'s targets from the logits of its
/// inputs (f32, as the ORPO path computes them).
pub fn token_logps(logits: &Array, ids: &Array) -> Result<Array, Exception> {
    cross_entropy(logits, &ids.index((.., 1..)))?
        .as_dtype(Dtype::Float32)?
        .negative()
}

/// The objective's terms for `pairs` from the logits of their `pair_batch` inputs.
pub fn terms_from_logits(
    obj: &PairObjective,
    logits: &Array,
    ids: &Array,
    response_mask: &Array,
    reference: Option<&Array>,
) -> Result<PrefTerms, Exception> {
    pref_terms(obj, &token_logps(logits, ids)?, response_mask, reference)
}

/// The batch's reference log-probs [2B] (chosen sums, then rejected sums), if any.
pub fn reference_rows(refs: &[[f32; 2]], batch: &[usize]) -> Array {
    let v: Vec<f32> = batch
        .iter()
        .map(|&i| refs[i][0])
        .chain(batch.iter().map(|&i| refs[i][1]))
        .collect();
    Array::from_slice(&v, &[v.len() as i32])
}

/// The summed response log-probs [chosen, rejected] of each pair under `model` as it is
/// (one joint forward per `batch_size` pairs).
pub fn summed_logps(
    model: &dyn LanguageModel,
    pairs: &[Pair],
    batch_size: usize,
) -> Result<Vec<[f32; 2]>, Exception> {
    let mut out = Vec::with_capacity(pairs.len());
    for chunk in pairs.chunks(batch_size.max(1)) {
        let refs: Vec<&Pair> = chunk.iter().collect();
        let (ids, _, rm) = pair_batch(&refs);
        let t = ids.shape()[1];
        let logits = model.forward(
            &ids.index((.., ..t - 1)),
            &mut crate::cache::none::none_for(&model.make_caches()),
        )?;
        let sums = token_logps(&logits, &ids)?
            .multiply(&rm)?
            .sum_axis(-1, false)?;
        sums.eval()?;
        let s = sums.as_slice::<f32>();
        let n = chunk.len();
        out.extend((0..n).map(|i| [s[i], s[n + i]]));
    }
    Ok(out)
}

/// The reference model's summed log-probs (TRL's `precompute_ref_log_probs`): the base
/// model, every adapter taken off for the pass (`Adapters::without`: a fresh LoRA's B = 0
/// already adds nothing, but resumed or loaded adapters, DoRA's magnitudes and fully
/// fine-tuned weights do), then put back as they were.
pub fn reference_logps(
    model: &dyn LanguageModel,
    adapters: &super::lora::Adapters,
    pairs: &[Pair],
    batch_size: usize,
) -> Result<Vec<[f32; 2]>, Exception> {
    // Planted: the adapters stay on, so the reference is the policy.
    if plant::is(Defect::DpoReferenceKeepsAdapters) {
        return summed_logps(model, pairs, batch_size);
    }
    adapters.without(|| summed_logps(model, pairs, batch_size))
}
