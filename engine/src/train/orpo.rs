//! ORPO's loss (Hong et al. 2024) with TRL's batch semantics (trl 0.19.1,
//! `trl/trainer/orpo_trainer.py`): L = NLL + λ·mean(L_OR), where
//! L_OR = −log σ(log_odds), log_odds = (ℓw − ℓr) − (log1mexp(ℓw) − log1mexp(ℓr))
//! (`ORPOTrainer.odds_ratio_loss`), and ℓw, ℓr are each chosen and rejected response's mean
//! per-token log-probability (response positions only, `get_batch_logps(average_log_prob=
//! True)`). The NLL term is one cross-entropy over the whole chosen half of the batch
//! (`concatenated_forward`'s `cross_entropy_loss`, `nn.CrossEntropyLoss` with mean
//! reduction): a token-weighted mean across pairs, not a mean of per-pair means. With
//! `SftScope::Full` (default, as TRL's decoder-only path and the paper) it covers every
//! supervised position of the chosen rows, prompt and response, label-shifted; with
//! `SftScope::Response` only the chosen responses' positions (TRL's NLL with the prompt
//! labels masked, as its encoder-decoder path computes it): −Σ resp_sum / Σ resp_n. At
//! B = 1 both are the per-pair values. The other terms are means over pairs.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{expm1, log1p, select};
use mlx_rs::{Array, Dtype};

use super::data::Pair;
use super::loss::cross_entropy;
use crate::model::LanguageModel;

/// Which positions the NLL term supervises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SftScope {
    #[default]
    Full,
    Response,
}

/// One batch's ORPO numbers (scalars): what the loss is made of and what evals report.
pub struct OrpoTerms {
    pub loss: Array,
    pub nll: Array,
    pub or: Array,
    /// Fraction of pairs with ℓw > ℓr.
    pub accuracy: Array,
    /// Mean ℓw − ℓr.
    pub margin: Array,
    pub lw: Array,
    pub lr: Array,
    /// Each pair's ℓw [B] (evals measure the noise of validation ℓw from it).
    pub lw_rows: Array,
}

impl OrpoTerms {
    pub const NAMES: [&'static str; 7] = ["loss", "nll", "or", "accuracy", "margin", "lw", "lr"];

    pub fn into_vec(self) -> Vec<Array> {
        vec![
            self.loss,
            self.nll,
            self.or,
            self.accuracy,
            self.margin,
            self.lw,
            self.lr,
            self.lw_rows,
        ]
    }
}

/// log(1 − eˣ) for x < 0, stable at both ends: log(−expm1(x)) near 0, log1p(−eˣ) below
/// −ln 2 (Mächler 2012).
pub fn log1mexp(x: &Array) -> Result<Array, Exception> {
    let near_zero = x.gt(Array::from_f32(-std::f32::consts::LN_2))?;
    let a = expm1(x)?.negative()?.log()?;
    let b = log1p(x.exp()?.negative()?)?;
    select(&near_zero, &a, &b)
}

/// ORPO from per-token log-probabilities [2B, T] (chosen rows first, then rejected) and
/// f32 masks of the same shape marking each row's prompt-span and response-span targets.
pub fn orpo_terms(
    token_logps: &Array,
    prompt_mask: &Array,
    response_mask: &Array,
    lambda: f32,
    scope: SftScope,
) -> Result<OrpoTerms, Exception> {
    let b = token_logps.shape()[0] / 2;
    let resp_sum = token_logps.multiply(response_mask)?.sum_axis(-1, false)?;
    let resp_n = response_mask.sum_axis(-1, false)?;
    let mean = resp_sum.divide(&resp_n)?;
    let (lw, lr) = (mean.index(..b), mean.index(b..));
    let nll = chosen_nll(token_logps, prompt_mask, response_mask, b, scope)?;
    let log_odds = lw
        .subtract(&lr)?
        .subtract(log1mexp(&lw)?.subtract(log1mexp(&lr)?)?)?;
    let l_or = mlx_rs::nn::log_sigmoid(&log_odds)?.negative()?;
    let mean = |x: &Array| x.mean(None);
    let or = mean(&l_or)?;
    Ok(OrpoTerms {
        loss: nll.add(or.multiply(Array::from_f32(lambda))?)?,
        nll,
        or,
        accuracy: mean(&lw.gt(&lr)?.as_dtype(Dtype::Float32)?)?,
        margin: mean(&lw.subtract(&lr)?)?,
        lw: mean(&lw)?,
        lr: mean(&lr)?,
        lw_rows: lw,
    })
}

/// The NLL of the chosen half (rows ..b): −Σ supervised log-probs / their count over all
/// chosen rows at once (TRL's `cross_entropy_loss`), positions by `scope`. The planted
/// `OrpoNllPerPairMean` takes each pair's token mean, then the mean over pairs.
fn chosen_nll(
    token_logps: &Array,
    prompt_mask: &Array,
    response_mask: &Array,
    b: i32,
    scope: SftScope,
) -> Result<Array, Exception> {
    let mask = match scope {
        SftScope::Full => prompt_mask.add(response_mask)?,
        SftScope::Response => response_mask.clone(),
    };
    let mask = mask.index(..b);
    let sum = token_logps
        .index(..b)
        .multiply(&mask)?
        .sum_axis(-1, false)?;
    let n = mask.sum_axis(-1, false)?;
    if crate::plant::is(crate::plant::Defect::OrpoNllPerPairMean) {
        return sum.divide(&n)?.mean(None)?.negative();
    }
    sum.sum(None)?.divide(n.sum(None)?)?.negative()
}

/// A batch of pairs as model inputs: ids [2B, T] (zero-padded; chosen rows, then
/// rejected), and the prompt/response target masks [2B, T − 1].
pub fn pair_batch(pairs: &[&Pair]) -> (Array, Array, Array) {
    let rows: Vec<(&[u32], usize)> = pairs
        .iter()
        .map(|p| (p.chosen.as_slice(), p.prompt_len))
        .chain(pairs.iter().map(|p| (p.rejected.as_slice(), p.prompt_len)))
        .collect();
    let t = rows.iter().map(|(s, _)| s.len()).max().unwrap_or(1);
    let (mut ids, mut pm, mut rm) = (Vec::new(), Vec::new(), Vec::new());
    for (seq, p) in &rows {
        ids.extend(seq.iter().map(|&x| x as i32));
        ids.extend(std::iter::repeat_n(0, t - seq.len()));
        // Target step s (1-based) is token s of the row.
        for s in 1..t {
            pm.push(if s < *p { 1.0f32 } else { 0.0 });
            rm.push(if s >= *p && s < seq.len() {
                1.0f32
            } else {
                0.0
            });
        }
    }
    let n = rows.len() as i32;
    (
        Array::from_slice(&ids, &[n, t as i32]),
        Array::from_slice(&pm, &[n, t as i32 - 1]),
        Array::from_slice(&rm, &[n, t as i32 - 1]),
    )
}

/// The ORPO terms of a batch of pairs under `model` (one forward over both sides).
pub fn orpo_loss(
    model: &dyn LanguageModel,
    pairs: &[&Pair],
    lambda: f32,
    scope: SftScope,
) -> Result<OrpoTerms, Exception> {
    let (ids, prompt_mask, response_mask) = pair_batch(pairs);
    let t = ids.shape()[1];
    let logits = model.forward(
        &ids.index((.., ..t - 1)),
        &mut crate::cache::none::none_for(&model.make_caches()),
    )?;
    orpo_from_logits(&logits, &ids, &prompt_mask, &response_mask, lambda, scope)
}

/// The ORPO terms from the logits of `ids[:, :-1]` (a `pair_batch`).
pub fn orpo_from_logits(
    logits: &Array,
    ids: &Array,
    prompt_mask: &Array,
    response_mask: &Array,
    lambda: f32,
    scope: SftScope,
) -> Result<OrpoTerms, Exception> {
    let logps = cross_entropy(logits, &ids.index((.., 1..)))?
        .as_dtype(Dtype::Float32)?
        .negative()?;
    orpo_terms(&logps, prompt_mask, response_mask, lambda, scope)
}
