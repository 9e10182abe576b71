//! Sampling as mlx-lm 0.32.2 does it (`sample_utils.make_sampler` and
//! `make_logits_processors`), op for op, so that sampled ids equal mlx-lm's for the same
//! seed and settings:
//!
//! - logits processors, in order: logit bias, repetition, presence, frequency penalties,
//!   each over the last `context_size` tokens of the whole sequence (prompt included);
//! - then log-probabilities `logits − logsumexp(logits)`;
//! - temperature 0 → argmax; otherwise top-p, min-p, top-k filters (in that order), then
//!   `categorical(logprobs · (1/temp))` with a key split from the sampler's own key sequence
//!   (the same split-and-carry sequence as MLX's global `mx.random.seed` state).
//!
//! Python scalars meet MLX arrays as "weak" scalars converted to the array's dtype; each
//! scalar here is cast to its partner's dtype to compute the same thing.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{argmax_axis, TryIndexUpdateOp, UpdateMode};
use mlx_rs::ops::{argpartition_axis, cumsum, select, sort_axis};
use mlx_rs::{random, Array, Dtype};

use crate::constrain::{env_for, Constraint, Grammar};
use crate::load::tokenizer::Tokenizer;
use crate::model::layers::weak;

type R<T> = Result<T, Exception>;

/// Sampling settings, with mlx-lm's defaults (temperature 0 = greedy).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temp: f64,
    pub top_p: f64,
    pub min_p: f64,
    pub min_tokens_to_keep: i32,
    pub top_k: i32,
    /// Seed of the sampler's key sequence (mlx-lm: `mx.random.seed`).
    pub seed: u64,
    pub logit_bias: Vec<(u32, f32)>,
    pub repetition_penalty: Option<f64>,
    pub repetition_context_size: usize,
    pub presence_penalty: Option<f64>,
    pub presence_context_size: usize,
    pub frequency_penalty: Option<f64>,
    pub frequency_context_size: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temp: 0.0,
            top_p: 0.0,
            min_p: 0.0,
            min_tokens_to_keep: 1,
            top_k: 0,
            seed: 0,
            logit_bias: Vec::new(),
            repetition_penalty: None,
            repetition_context_size: 20,
            presence_penalty: None,
            presence_context_size: 20,
            frequency_penalty: None,
            frequency_context_size: 20,
        }
    }
}

/// A sampling setting this model cannot run: the field and why (each one would reach an
/// MLX index or shape with a value out of range).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct InvalidSampling {
    pub field: &'static str,
    pub message: String,
}

impl SamplingParams {
    /// Checks the settings against a model with `vocab` logits. A token id past the
    /// vocabulary would make MLX read or write outside the logits (a crash, not an error),
    /// so every id and every k is checked here, before any MLX work.
    pub fn check(&self, vocab: usize) -> Result<(), InvalidSampling> {
        let bad = |field, message: String| Err(InvalidSampling { field, message });
        if let Some(&(id, _)) = self.logit_bias.iter().find(|(id, _)| *id as usize >= vocab) {
            return bad(
                "logit_bias",
                format!(
                    "token id {id} is not in this model's vocabulary (ids 0–{})",
                    vocab - 1
                ),
            );
        }
        if !(self.temp.is_finite() && self.temp >= 0.0) {
            return bad(
                "temperature",
                format!("must be a finite number ≥ 0, got {}", self.temp),
            );
        }
        // As mlx-lm's make_sampler: the filters run only when sampling (temperature > 0).
        if self.temp > 0.0 && self.top_k > 0 && self.top_k as usize >= vocab {
            return bad(
                "top_k",
                format!(
                    "top_k {} is not below this model's vocabulary size {vocab} (0 turns it off)",
                    self.top_k
                ),
            );
        }
        if self.temp > 0.0
            && self.min_p != 0.0
            && !(1..=vocab as i64).contains(&(self.min_tokens_to_keep as i64))
        {
            return bad(
                "min_tokens_to_keep",
                format!("must be in 1–{vocab}, got {}", self.min_tokens_to_keep),
            );
        }
        Ok(())
    }
}

fn active(p: Option<f64>) -> Option<f64> {
    p.filter(|&v| v != 0.0)
}

/// The last `n` ids of `history` as an int32 index array.
fn recent(history: &[u32], n: usize) -> Array {
    let tail: Vec<i32> = history[history.len().saturating_sub(n)..]
        .iter()
        .map(|&t| t as i32)
        .collect();
    Array::from_slice(&tail, &[tail.len() as i32])
}

/// `sampler` constrained to `grammar` over `tokenizer` (as it is without a grammar).
pub fn constrain(
    sampler: Sampler,
    tokenizer: &std::sync::Arc<Tokenizer>,
    grammar: Option<&Grammar>,
) -> Result<Sampler, String> {
    let Some(grammar) = grammar else {
        return Ok(sampler);
    };
    let env = env_for(tokenizer)?;
    // Refused over this model's tokenizer: the request's grammar, not the server.
    let constraint = Constraint::new(&env, grammar)
        .map_err(|e| format!("{}{e}", crate::constrain::RUNTIME_ERROR))?;
    Ok(sampler.constrained(constraint))
}

/// One sequence's sampler: settings plus its key sequence, and the grammar its answer
/// must match (a constraint: the last logits processor, the token mask).
pub struct Sampler {
    pub params: SamplingParams,
    key: Array,
    constraint: Option<Constraint>,
    /// A thinking budget (`generate::budget`): forces the thinking end once it is spent.
    budget: Option<super::budget::ThinkBudget>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> R<Self> {
        let key = random::key(params.seed)?;
        Ok(Sampler {
            params,
            key,
            constraint: None,
            budget: None,
        })
    }

    /// This sampler with a thinking budget (the last processor, after any constraint).
    pub fn with_budget(mut self, budget: Option<super::budget::ThinkBudget>) -> Self {
        self.budget = budget;
        self
    }

    /// This sampler with `constraint` masking every step's logits.
    pub fn constrained(mut self, constraint: Constraint) -> Self {
        self.constraint = Some(constraint);
        self
    }

    /// Any logits processor: the penalties, a logit bias, a thinking budget or a
    /// constraint.
    pub fn has_processors(&self) -> bool {
        self.constraint.is_some() || self.has_penalties()
    }

    /// A logits processor other than the constraint (a penalty, a logit bias, a thinking
    /// budget): these need each position's own history, which a verify pass does not keep.
    pub fn has_penalties(&self) -> bool {
        let p = &self.params;
        self.budget.is_some()
            || !p.logit_bias.is_empty()
            || active(p.repetition_penalty).is_some()
            || active(p.presence_penalty).is_some()
            || active(p.frequency_penalty).is_some()
    }

    /// Whether a grammar constrains this sampler's answer.
    pub fn is_constrained(&self) -> bool {
        self.constraint.is_some()
    }

    /// A verify pass's choices: `logits` [drafts + 1, vocab] of the positions after
    /// `history`, `history + drafts[..1]`, …; without a constraint every row is sampled
    /// (one log-softmax, one sampler call), with one the drafts are cut before the first id
    /// the grammar refuses and each kept row is masked with the grammar's mask at its
    /// position (the forward is started first, so it runs while the masks are computed).
    /// (kept drafts, ids [kept + 1], log-probabilities [kept + 1, vocab]).
    pub fn pick_verify(
        &mut self,
        logits: &Array,
        history: &[u32],
        drafts: &[u32],
    ) -> R<(usize, Array, Array)> {
        let (kept, logits) = match self.constraint.as_mut() {
            None => (drafts.len(), logits.clone()),
            Some(c) => {
                mlx_rs::transforms::async_eval([logits])?;
                let (kept, masks) = c.draft_masks(history, drafts)?;
                if masks.is_empty() {
                    (kept, logits.clone())
                } else {
                    use mlx_rs::ops::indexing::IndexOp;
                    let rows = logits.index(..(kept as i32 + 1));
                    (kept, c.mask_rows(&rows, &masks)?)
                }
            }
        };
        let logprobs = logits.subtract(logits.logsumexp_axis(-1, true)?)?;
        Ok((kept, self.sample(&logprobs)?, logprobs))
    }

    /// mlx-lm's logits processors over `history` (every token so far, prompt included).
    ///
    /// Ids are checked against the logits' width first (out-of-range ids would make MLX's
    /// scatter and gather touch memory outside the array), so a bad id is an error here
    /// whichever caller skipped `SamplingParams::check`.
    pub fn process(&self, logits: &Array, history: &[u32]) -> R<Array> {
        let p = &self.params;
        let vocab = logits.shape().last().copied().unwrap_or(0).max(0) as u32;
        let window = [
            p.repetition_context_size,
            p.presence_context_size,
            p.frequency_context_size,
        ]
        .into_iter()
        .max()
        .unwrap_or(0);
        let recent_ids = &history[history.len().saturating_sub(window)..];
        if let Some(id) = p
            .logit_bias
            .iter()
            .map(|&(id, _)| id)
            .chain(recent_ids.iter().copied())
            .find(|&id| id >= vocab)
        {
            return Err(Exception::custom(format!(
                "token id {id} is not in this model's vocabulary of {vocab}"
            )));
        }
        let mut logits = logits.clone();
        if !p.logit_bias.is_empty() {
            let idx: Vec<i32> = p.logit_bias.iter().map(|&(i, _)| i as i32).collect();
            let vals: Vec<f32> = p.logit_bias.iter().map(|&(_, v)| v).collect();
            let idx = Array::from_slice(&idx, &[idx.len() as i32]);
            let vals = Array::from_slice(&vals, &[vals.len() as i32]);
            logits = logits
                .try_index_update((.., &idx), &vals, UpdateMode::Add)
                .map_err(to_exc)?;
        }
        if history.is_empty() {
            return Ok(logits);
        }
        if let Some(penalty) = active(p.repetition_penalty) {
            let tokens = recent(history, p.repetition_context_size);
            let selected = logits.take_axis(&tokens, 1)?;
            let scaled = select(
                selected.lt(weak(0.0, &selected)?)?,
                selected.multiply(weak(penalty, &selected)?)?,
                selected.divide(weak(penalty, &selected)?)?,
            )?;
            logits = logits
                .try_index_update((.., &tokens), &scaled, UpdateMode::Replace)
                .map_err(to_exc)?;
        }
        if let Some(penalty) = active(p.presence_penalty) {
            let tokens = recent(history, p.presence_context_size);
            let lowered = logits
                .take_axis(&tokens, 1)?
                .subtract(weak(penalty, &logits)?)?;
            logits = logits
                .try_index_update((.., &tokens), &lowered, UpdateMode::Replace)
                .map_err(to_exc)?;
        }
        if let Some(penalty) = active(p.frequency_penalty) {
            let tokens = recent(history, p.frequency_context_size);
            let minus = weak(penalty, &logits)?.negative()?;
            logits = logits
                .try_index_update((.., &tokens), &minus, UpdateMode::Add)
                .map_err(to_exc)?;
        }
        Ok(logits)
    }

    /// One decode step's choice, as mlx-lm's generate_step makes it: the logits processors
    /// over `history` (when there are any), log-probabilities, then the sampled id — both
    /// lazy: (id [1], log-probabilities).
    pub fn pick(&mut self, logits: &Array, history: &[u32]) -> R<(Array, Array)> {
        let mut logits = if self.has_processors() {
            self.process(logits, history)?
        } else {
            logits.clone()
        };
        if let Some(c) = self.constraint.as_mut() {
            logits = c.apply(&logits, history)?;
        }
        if let Some(b) = &self.budget {
            logits = b.apply(&logits, history)?;
        }
        let logprobs = logits.subtract(logits.logsumexp(true)?)?;
        Ok((self.sample(&logprobs)?, logprobs))
    }

    /// The next token id from log-probabilities [1, vocab].
    pub fn sample(&mut self, logprobs: &Array) -> R<Array> {
        let p = self.params.clone();
        if p.temp == 0.0 {
            return argmax_axis(logprobs, -1, None);
        }
        let mut lp = logprobs.clone();
        if 0.0 < p.top_p && p.top_p < 1.0 {
            lp = apply_top_p(&lp, p.top_p)?;
        }
        if p.min_p != 0.0 {
            lp = apply_min_p(&lp, p.min_p, p.min_tokens_to_keep)?;
        }
        if p.top_k > 0 {
            lp = apply_top_k(&lp, p.top_k)?;
        }
        let (next, sub) = random::split(&self.key, 2)?;
        self.key = next;
        let scaled = lp.multiply(weak(1.0 / p.temp, &lp)?)?;
        random::categorical(&scaled, None, None, &sub)
    }
}

fn to_exc(e: mlx_rs::ops::indexing::IndexUpdateError) -> Exception {
    Exception::custom(e.to_string())
}

fn neg_inf(like: &Array) -> R<Array> {
    Array::from_f32(f32::NEG_INFINITY).as_dtype(like.dtype())
}

/// Keep the smallest set of top tokens whose probability mass reaches `top_p`.
fn apply_top_p(logprobs: &Array, top_p: f64) -> R<Array> {
    let sorted = sort_axis(logprobs, -1)?;
    let probs = sorted.as_dtype(Dtype::Float32)?.exp()?;
    let mass_above = cumsum(&probs, -1, true, false)?;
    use mlx_rs::ops::indexing::IndexOp;
    let total = mass_above.index((.., ..1)).add(probs.index((.., ..1)))?;
    let dropped = mass_above
        .ge(weak(top_p, &total)?.multiply(&total)?)?
        .sum_axis(-1, true)?;
    let threshold = sorted.take_along_axis(&dropped, -1)?;
    select(logprobs.lt(&threshold)?, neg_inf(logprobs)?, logprobs)
}

/// Drop tokens whose probability is under `min_p` × the top token's.
fn apply_min_p(logprobs: &Array, min_p: f64, min_tokens_to_keep: i32) -> R<Array> {
    let top = logprobs.max_axis(-1, true)?;
    let scaled_min = top.add(weak(min_p.ln(), &top)?)?;
    let mut remove = logprobs.lt(&scaled_min)?;
    if min_tokens_to_keep > 1 {
        use mlx_rs::ops::indexing::IndexOp;
        let top_idx = argpartition_axis(logprobs, -min_tokens_to_keep, -1)?;
        let keep = top_idx.index((.., -min_tokens_to_keep..));
        remove = remove.put_along_axis(&keep, Array::from_bool(false), -1)?;
    }
    select(&remove, neg_inf(logprobs)?, logprobs)
}

/// Keep only the `top_k` most likely tokens.
fn apply_top_k(logprobs: &Array, top_k: i32) -> R<Array> {
    use mlx_rs::ops::indexing::IndexOp;
    let vocab = *logprobs.shape().last().unwrap();
    if !(0 < top_k && top_k < vocab) {
        return Err(Exception::custom(format!(
            "top_k has to be in (0, {vocab}), got {top_k}"
        )));
    }
    let mask_idx = argpartition_axis(logprobs.negative()?, top_k - 1, -1)?.index((.., top_k..));
    logprobs.put_along_axis(&mask_idx, neg_inf(logprobs)?, -1)
}
