//! The prefix-shared ORPO forward: chosen and rejected share their prompt, so the tokens
//! every pair's two rows have in common (the shared prefix, P of them, the same P for the
//! whole batch) run once per pair (B rows), and the rest of both rows (2B rows) attends to
//! that prefix's K/V, which each layer's `SharedPrefix` cache hands back twice over (chosen
//! rows, then rejected rows). The K/V stay in the autodiff graph: the continuation rows'
//! gradients flow back into the prefix's forward. The prefix's logits are shared too; each
//! row's log-probabilities at those positions are read from them with its own targets (the
//! last prefix position predicts the first token after the prefix, which differs).
//!
//! The per-token log-probabilities are those of the joint 2B-row forward (`OrpoForward::
//! Joint`, TRL's `concatenated_forward`, the path the reference gate is defined on): the
//! same ops per row, on matmuls and reductions of other shapes (measured bit-identical).
//! The gradients differ by rounding only: the joint forward backpropagates chosen and
//! rejected rows apart and sums their parameter gradients, this one sums their cotangents
//! at the prefix first. Gated against the joint path in `engine/tests/it/orpo_prefix.rs`: in
//! f32 within reassociation, in bf16 as close to the exact gradients as the joint path.

use crate::cache::attention_views;
use mlx_rs::error::Exception;
use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};

use super::data::Pair;
use super::loss::cross_entropy;
use super::orpo::{orpo_terms, pair_batch, OrpoTerms, SftScope};
use crate::cache::{causal_mask, AttentionCache, Cache, Kv, Mask};
use crate::model::LanguageModel;

/// How the ORPO step runs its forward over a batch's chosen and rejected rows.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum OrpoForward {
    /// One forward of 2B rows (chosen, then rejected), as TRL's `concatenated_forward`
    /// (what segmented runs and pairs without a shared prefix take).
    Joint,
    /// The default: the shared prefix once per pair, then the 2B continuation rows on its
    /// K/V. The same losses, gradients equal up to rounding (engine/tests/it/orpo_prefix.rs),
    /// less memory and time (docs/training.md).
    #[default]
    PrefixShared,
}

impl OrpoForward {
    pub fn name(self) -> &'static str {
        match self {
            OrpoForward::Joint => "joint",
            OrpoForward::PrefixShared => "prefix-shared",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "joint" => Some(OrpoForward::Joint),
            "prefix-shared" => Some(OrpoForward::PrefixShared),
            _ => None,
        }
    }
}

/// The prefix every pair's chosen and rejected rows share (the same length for all pairs),
/// short enough that every row has a target past it and the continuation has an input:
/// at most min(row length) − 1 and `width` − 2 (`width`: the padded batch's length).
pub fn shared_prefix_len(pairs: &[&Pair], width: usize) -> usize {
    pairs
        .iter()
        .map(|p| {
            let common = p
                .chosen
                .iter()
                .zip(&p.rejected)
                .take_while(|(a, b)| a == b)
                .count();
            common.min(p.chosen.len().min(p.rejected.len()).saturating_sub(1))
        })
        .min()
        .unwrap_or(0)
        .min(width.saturating_sub(2))
}

/// A layer's cache for the two forwards: the first (the prefix, B rows) passes its K/V
/// through and keeps them; the second (`copies` × B rows at offset P: ORPO's 2B, a GRPO
/// group's rows over their one prompt) gets them, `copies` times over, in front of its own.
struct SharedPrefix {
    prefix: Option<(Array, Array)>,
    /// How many times over the continuation's rows repeat the prefix's rows.
    copies: usize,
}

impl SharedPrefix {
    /// The prefix's K/V for all the continuation's rows (`copies` × the prefix's, copy
    /// after copy) ahead of their `new` ones.
    fn ahead(&self, prefix: &Array, new: Array, values: bool) -> Result<Array, Exception> {
        use crate::plant::{is, Defect};
        let p = if is(Defect::OrpoPrefixKvNoGrad) {
            mlx_rs::stop_gradient(prefix)?
        } else {
            prefix.clone()
        };
        let later = if values && is(Defect::OrpoRejectedSkipsPrefix) {
            mlx_rs::ops::zeros_like(&p)?
        } else {
            p.clone()
        };
        let mut copies = vec![&p];
        copies.extend(std::iter::repeat_n(&later, self.copies.max(1) - 1));
        concatenate(&[concatenate(&copies, 0)?, new], 2)
    }
}

impl Cache for SharedPrefix {
    fn offset(&self) -> i32 {
        self.prefix.as_ref().map_or(0, |(k, _)| k.shape()[2])
    }

    fn is_trimmable(&self) -> bool {
        false
    }

    fn trim(&mut self, _n: i32) -> i32 {
        0
    }

    fn state(&self) -> Vec<&Array> {
        self.prefix.iter().flat_map(|(k, v)| [k, v]).collect()
    }

    /// As a fresh cache, then as a standard one at offset P (mlx-lm's masks for both).
    fn make_mask(&self, n: i32, window: Option<i32>) -> Result<Mask, Exception> {
        let offset = self.offset();
        Ok(match window {
            Some(w) if offset > 0 || n > w => Mask::Array(causal_mask(n, offset, Some(w))?),
            _ if n == 1 => Mask::None,
            _ => Mask::Causal,
        })
    }

    attention_views!();
}

impl AttentionCache for SharedPrefix {
    fn update_and_fetch(&mut self, keys: Array, values: Array) -> Result<Kv, Exception> {
        match &self.prefix {
            None => {
                self.prefix = Some((keys.clone(), values.clone()));
                Ok(Kv::Dense(keys, values))
            }
            Some((pk, pv)) => Ok(Kv::Dense(
                self.ahead(pk, keys, false)?,
                self.ahead(pv, values, true)?,
            )),
        }
    }
}

/// The logits [copies × B, L, V] of `rest` [copies × B, L] (row r continues prefix row
/// r mod B) after `prefix` [B, Q] (Q > 0), the prefix run once: its K/V are handed to every
/// copy, its own logits are never asked for (MLX is lazy: its head is not computed).
pub fn continuation_logits(
    model: &dyn LanguageModel,
    prefix: &Array,
    rest: &Array,
) -> Result<Array, Exception> {
    let copies = (rest.shape()[0] / prefix.shape()[0].max(1)) as usize;
    let mut caches = shared_caches(model, copies);
    model.forward(prefix, &mut caches)?;
    model.forward(rest, &mut caches)
}

fn shared_caches(model: &dyn LanguageModel, copies: usize) -> Vec<Box<dyn Cache>> {
    model
        .make_caches()
        .iter()
        .map(|_| {
            Box::new(SharedPrefix {
                prefix: None,
                copies,
            }) as Box<dyn Cache>
        })
        .collect()
}

/// Per-token log-probabilities [2B, T − 1] (f32) of a `pair_batch`'s `ids` [2B, T] with the
/// first `p` tokens of every pair run once (0 < p ≤ T − 2). Target steps before `from` are
/// not scored by the caller: where none of the prefix's steps past its last one is
/// (`from` ≥ P − 1, a response-only loss), the prefix stops at Q = min(`from`, P), the rows
/// run on from there, no head is applied to the prefix, and the Q unscored columns are 0.
/// Otherwise (ORPO's full-row NLL) the prefix's logits are shared by both rows.
pub fn prefix_shared_logps(
    model: &dyn LanguageModel,
    ids: &Array,
    p: i32,
    from: i32,
) -> Result<Array, Exception> {
    let (rows, t) = (ids.shape()[0], ids.shape()[1]);
    let b = rows / 2;
    if from >= p - 1 {
        let q = from.min(p);
        let rest = match q {
            0 => model.forward(
                &ids.index((.., ..t - 1)),
                &mut crate::cache::none::none_for(&model.make_caches()),
            )?,
            _ => continuation_logits(model, &ids.index((..b, ..q)), &ids.index((.., q..t - 1)))?,
        };
        let scored = cross_entropy(&rest, &ids.index((.., q + 1..)))?
            .as_dtype(Dtype::Float32)?
            .negative()?;
        let unscored = mlx_rs::ops::zeros::<f32>(&[rows, q])?;
        return concatenate(&[unscored, scored], 1);
    }
    let mut caches = shared_caches(model, 2);
    let prefix_logits = model.forward(&ids.index((..b, ..p)), &mut caches)?;
    let rest_logits = model.forward(&ids.index((.., p..t - 1)), &mut caches)?;
    let prefix = prefix_logps(&prefix_logits, &ids.index((.., 1..p + 1)), b)?;
    let rest = cross_entropy(&rest_logits, &ids.index((.., p + 1..)))?;
    concatenate(&[prefix, rest], 1)?
        .as_dtype(Dtype::Float32)?
        .negative()
}

/// The first target step a response-only loss scores in a `pair_batch` of `pairs`: the
/// step that predicts the first response token of the shortest prompt.
pub fn first_response_step(pairs: &[&Pair]) -> i32 {
    pairs.iter().map(|p| p.prompt_len).min().unwrap_or(1).max(1) as i32 - 1
}

/// `cross_entropy` of the shared prefix logits [B, P, V] against both halves' targets
/// [2B, P]: the same ops per row (shift by the stopped max, logsumexp − the target's
/// score), the logsumexp taken once per pair. Rows: chosen, then rejected.
fn prefix_logps(logits: &Array, targets: &Array, b: i32) -> Result<Array, Exception> {
    let p = logits.shape()[1];
    let max = mlx_rs::stop_gradient(logits.max_axis(-1, true)?)?;
    let shifted = logits.subtract(&max)?;
    let both = mlx_rs::ops::stack(&[targets.index(..b), targets.index(b..)], -1)?;
    let score = shifted.take_along_axis(&both, -1)?;
    let lse = shifted.logsumexp_axis(-1, true)?;
    lse.subtract(&score)?
        .transpose_axes(&[2, 0, 1])?
        .reshape(&[2 * b, p])
}

/// The ORPO terms of a batch of pairs under `model` by `forward` (the joint path where the
/// pairs share no prefix).
pub fn orpo_loss_by(
    model: &dyn LanguageModel,
    pairs: &[&Pair],
    lambda: f32,
    scope: SftScope,
    forward: OrpoForward,
) -> Result<OrpoTerms, Exception> {
    let (ids, prompt_mask, response_mask) = pair_batch(pairs);
    let p = shared_prefix_len(pairs, ids.shape()[1] as usize);
    if forward == OrpoForward::Joint || p == 0 {
        return super::orpo::orpo_loss(model, pairs, lambda, scope);
    }
    let from = match scope {
        SftScope::Full => 0,
        SftScope::Response => first_response_step(pairs),
    };
    let logps = prefix_shared_logps(model, &ids, p as i32, from)?;
    orpo_terms(&logps, &prompt_mask, &response_mask, lambda, scope)
}
