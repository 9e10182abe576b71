//! Speculative decoding, as mlx-lm 0.32.2's `speculative_generate_step` does it: a small
//! draft model proposes γ tokens one at a time; the target verifies [last token, drafts…]
//! in one forward; one batched log-softmax + sample over those γ+1 positions gives the
//! target's own choice at each; the longest prefix where draft and target agree is
//! accepted, then the target's token at the first disagreement (or the bonus token after a
//! full accept) is emitted too. Rollback is a trim: the target drops the rejected drafts,
//! the draft model drops the ones it fed beyond the accepted prefix.
//!
//! Both prompts are prefilled up to their last token in chunks; the last prompt token is
//! the first draft step's input and the first verify's first position, as in mlx-lm. After
//! a full accept, the last draft (never fed to the draft model) is fed to it together with
//! the bonus token.

use std::time::Instant;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use super::sampler::Sampler;
use super::{Finish, Flow, Session, Stats};
use crate::plant::{self, Defect};

/// mlx-lm's prefill chunk for speculative generation.
pub const SPEC_PREFILL_STEP: usize = 512;

/// What the speculation did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SpecStats {
    /// Draft tokens proposed and accepted.
    pub drafted: usize,
    pub accepted: usize,
    /// Verify forwards of the target (one per round) and draft-model forwards.
    pub target_calls: usize,
    pub draft_calls: usize,
}

impl SpecStats {
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }
}

/// Speculative decoding runs without logits processors (mlx-lm's processor path feeds them
/// a history this executor does not keep).
pub fn refuse_processors(sampler: &Sampler) -> Result<(), Exception> {
    if sampler.has_processors() {
        return Err(Exception::custom(
            "speculative decoding does not support logits processors (repetition, presence \
             or frequency penalties, logit bias); drop them or the draft model",
        ));
    }
    Ok(())
}

/// Log-probabilities of logits [n, vocab] and the sampler's choice at every row.
fn pick(sampler: &mut Sampler, logits: &Array) -> Result<(Array, Array), Exception> {
    let logprobs = logits.subtract(logits.logsumexp_axis(-1, true)?)?;
    Ok((sampler.sample(&logprobs)?, logprobs))
}

/// Feeds `ids` in prefill chunks (caches evaluated after each, no logits).
fn prefill_to(session: &mut Session, ids: &[u32]) -> Result<(), Exception> {
    for chunk in ids.chunks(session.prefill_step.max(1)) {
        session.prefill_chunk(chunk)?;
    }
    Ok(())
}

fn ids_of(a: &Array) -> Result<Vec<u32>, Exception> {
    a.eval()?;
    Ok(a.as_slice::<u32>().to_vec())
}

/// Speculative generation of up to `max_tokens` with `num_draft` drafts per round, both
/// sessions holding `prompt[..cached]` already. `on_token` sees each id, its
/// log-probabilities [1, vocab] and whether it was a draft the target accepted (the EOS id
/// is not passed on). Logits processors are not supported (mlx-lm's processor path feeds
/// them a history this executor does not keep): a sampler with processors is refused.
#[allow(clippy::too_many_arguments)]
pub fn speculative_generate_in(
    target: &mut Session,
    draft: &mut Session,
    prompt: &[u32],
    cached: usize,
    num_draft: usize,
    max_tokens: usize,
    eos_ids: &[u32],
    sampler: &mut Sampler,
    mut on_token: impl FnMut(u32, &Array, bool) -> Result<Flow, Exception>,
) -> Result<(Stats, SpecStats, Finish), Exception> {
    assert!(
        cached < prompt.len(),
        "at least one prompt token must be fed"
    );
    refuse_processors(sampler)?;
    if num_draft == 0 {
        return Err(Exception::custom("--num-draft-tokens must be at least 1"));
    }
    let mut stats = Stats {
        prompt_tokens: prompt.len(),
        ..Stats::default()
    };
    let mut spec = SpecStats::default();
    let start = Instant::now();
    // Prefill both up to the last prompt token, draft first (as mlx-lm).
    let last = prompt.len() - 1;
    prefill_to(draft, &prompt[cached..last])?;
    prefill_to(target, &prompt[cached..last])?;
    let mut y: Vec<u32> = vec![prompt[last]];
    let mut draft_y: Vec<u32> = y.clone();
    let mut produced = 0usize;
    let mut finish = Finish::Length;
    let mut first = true;
    let mut decode_start = Instant::now();
    'rounds: while produced < max_tokens {
        let n_draft = num_draft.min(max_tokens - produced);
        // Draft n_draft tokens, each fed back as a lazy array (mlx-lm's async drafting).
        let mut drafts: Vec<Array> = Vec::with_capacity(n_draft);
        let mut logits = draft.step(&draft_y)?;
        for i in 0..n_draft {
            let (d, _) = pick(sampler, &logits)?;
            mlx_rs::transforms::async_eval([&d])?;
            spec.draft_calls += 1;
            if i + 1 < n_draft {
                logits = draft.step_array(&d)?;
            }
            drafts.push(d);
        }
        let draft_ids = ids_of(&mlx_rs::ops::concatenate(&drafts, 0)?)?;
        // Verify [y, drafts…] in one target forward; sample all positions at once.
        let mut verify = y.clone();
        verify.extend(&draft_ids);
        let logits = target.forward(&verify)?;
        let logits = logits
            .index((.., -(n_draft as i32 + 1).., ..))
            .squeeze_axes(&[0])?;
        let (tokens, logprobs) = pick(sampler, &logits)?;
        let tokens = ids_of(&tokens)?;
        spec.target_calls += 1;
        spec.drafted += n_draft;
        if first {
            stats.prompt_time = start.elapsed();
            decode_start = Instant::now();
            first = false;
        }
        let mut n = 0;
        while n < n_draft && tokens[n] == draft_ids[n] {
            n += 1;
        }
        spec.accepted += n;
        // Emit the accepted drafts, then the target's own token at n.
        for (i, &id) in tokens[..=n].iter().enumerate() {
            if produced == max_tokens {
                break 'rounds;
            }
            if eos_ids.contains(&id) {
                finish = Finish::Eos;
                break 'rounds;
            }
            let lp = logprobs.index(i as i32).reshape(&[1, -1])?;
            let flow = on_token(id, &lp, i < n)?;
            produced += 1;
            stats.generated_tokens += 1;
            if flow == Flow::Stop {
                finish = Finish::Stop;
                break 'rounds;
            }
        }
        if produced == max_tokens {
            break;
        }
        y = vec![tokens[n]];
        draft_y = if n == n_draft {
            vec![draft_ids[n_draft - 1], tokens[n]]
        } else {
            y.clone()
        };
        let rejected = n_draft - n;
        target
            .trim(rejected - usize::from(plant::is(Defect::SpecTargetTrimShort) && rejected > 0))?;
        if !plant::is(Defect::SpecKeepDraftTail) {
            draft.trim(rejected.saturating_sub(1))?;
        }
    }
    stats.generation_time = decode_start.elapsed();
    Ok((stats, spec, finish))
}
