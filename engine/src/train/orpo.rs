//! ORPO's loss (Hong et al. 2024; TRL's ORPOTrainer): L = NLL + λ·L_OR, where
//! L_OR = −log σ(log_odds), log_odds = (ℓw − ℓr) − (log1mexp(ℓw) − log1mexp(ℓr)), and ℓw,
//! ℓr are the chosen and rejected responses' mean per-token log-probabilities (response
//! positions only, length-normalized). The NLL term is on the chosen sequence: with
//! `SftScope::Full` (default, as TRL and the paper) the token-mean cross-entropy over every
//! supervised position — prompt and response, label-shifted — from the same forward, i.e.
//! −((P−1)·pm + M·ℓw)/((P−1)+M); with `SftScope::Response`, −ℓw. Batch terms are means
//! over pairs.

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
    let nll = match scope {
        SftScope::Response => lw.negative()?,
        SftScope::Full => {
            let chosen = |x: &Array| x.index(..b);
            let prompt_sum = token_logps.multiply(prompt_mask)?.sum_axis(-1, false)?;
            let prompt_n = prompt_mask.sum_axis(-1, false)?;
            let total = chosen(&prompt_sum).add(chosen(&resp_sum))?;
            total
                .divide(chosen(&prompt_n).add(chosen(&resp_n))?)?
                .negative()?
        }
    };
    let log_odds = lw
        .subtract(&lr)?
        .subtract(log1mexp(&lw)?.subtract(log1mexp(&lr)?)?)?;
    let l_or = mlx_rs::nn::log_sigmoid(&log_odds)?.negative()?;
    let per_pair = nll.add(l_or.multiply(Array::from_f32(lambda))?)?;
    let mean = |x: &Array| x.mean(None);
    Ok(OrpoTerms {
        loss: mean(&per_pair)?,
        nll: mean(&nll)?,
        or: mean(&l_or)?,
        accuracy: mean(&lw.gt(&lr)?.as_dtype(Dtype::Float32)?)?,
        margin: mean(&lw.subtract(&lr)?)?,
        lw: mean(&lw)?,
        lr: mean(&lr)?,
    })
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
