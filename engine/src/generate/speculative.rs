//! Speculative decoding, as mlx-lm 0.32.2's `speculative_generate_step` does it: a small
//! draft model proposes γ tokens one at a time; the target verifies [last token, drafts…]
//! in one forward; one batched log-softmax + sample over those γ+1 positions gives the
//! target's own choice at each; the longest prefix where draft and target agree is
//! accepted, then the target's token at the first disagreement (or the bonus token after a
//! full accept) is emitted too. The target gives back the rejected drafts, the draft model
//! the ones it fed beyond the accepted prefix (`rollback`: a trim, as in mlx-lm, where every
//! cache can trim; a recurrent state returns to its checkpoint and the kept positions are fed
//! again, which mlx-lm does not do — it refuses such models).
//!
//! Both prompts are prefilled up to their last token in chunks; the last prompt token is
//! the first draft step's input and the first verify's first position, as in mlx-lm. After
//! a full accept, the last draft (never fed to the draft model) is fed to it together with
//! the bonus token.

use std::borrow::BorrowMut;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use super::decode::Decoder;
use super::rollback::Checkpoint;
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
    /// Verify passes that gave rejected drafts back, and of those the ones that had
    /// accepted some drafts first (over a recurrent state those are fed again).
    pub rolled_back: usize,
    pub partly_accepted: usize,
}

impl SpecStats {
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }
}

/// The refusal of penalties and a logit bias under speculation (mlx-lm's processor path
/// feeds them a history this executor does not keep). A constraint is no processor here:
/// the verify pass checks the drafts against the grammar's mask and masks every row.
pub const PENALTIES_REFUSED: &str = "speculative decoding does not support repetition, \
     presence or frequency penalties or a logit bias; drop them or the draft model";

/// Refuses a sampler with penalties or a logit bias (a draft model's rounds and prompt
/// lookup verify under a constraint; see `Sampler::pick_verify`).
pub fn refuse_penalties(sampler: &Sampler) -> Result<(), Exception> {
    if sampler.has_penalties() {
        return Err(Exception::custom(PENALTIES_REFUSED));
    }
    Ok(())
}

/// The assistant drafter's refusal: penalties as for a draft model, and a constraint too
/// (its verify pass does not check drafts against a grammar).
pub fn refuse_processors(sampler: &Sampler) -> Result<(), Exception> {
    refuse_penalties(sampler)?;
    if sampler.is_constrained() {
        return Err(Exception::custom(
            "the Gemma 4 assistant drafter does not draft under a grammar (a JSON schema, \
             regex or Lark grammar): drop the grammar or the assistant",
        ));
    }
    Ok(())
}

/// Feeds `ids` in prefill chunks (caches evaluated after each, no logits).
pub(super) fn prefill_to(session: &mut Session, ids: &[u32]) -> Result<(), Exception> {
    for chunk in ids.chunks(session.prefill_step.max(1)) {
        session.prefill_chunk(chunk)?;
    }
    Ok(())
}

fn ids_of(a: &Array) -> Result<Vec<u32>, Exception> {
    a.eval()?;
    Ok(a.as_slice::<u32>().to_vec())
}

/// How a verify pass ended. Either way the target holds everything up to the `accepted`
/// drafts.
pub enum Verified {
    /// The request is over (EOS, a stop, the limit) while emitting.
    Finished { finish: Finish, accepted: usize },
    /// `accepted` drafts and then the target's own `token` were emitted (`token` is to be
    /// fed next).
    Next { accepted: usize, token: u32 },
}

/// The verify half of a round, for every kind of drafter (a draft model's round, prompt
/// lookup): the target runs `[y…, drafts…]` in one forward; the last drafts + 1 positions
/// go through one log-softmax and one sampler call, the target's own choice at each; the
/// longest prefix where the drafts equal those choices is accepted and emitted, then the
/// target's choice at the first disagreement (or the bonus after a full accept); before
/// emitting, the target gives back the rejected drafts (`rollback::Checkpoint`, taken
/// before the forward). Without drafts it is one plain step. Under a
/// constraint the drafts are cut before the first id the grammar refuses (a cut draft is
/// a rejected one) and each row is masked with the grammar's mask at its position, so the
/// ids are constrained plain decoding's.
#[allow(clippy::too_many_arguments)]
pub fn verify<S: BorrowMut<Sampler>, E: From<Exception>>(
    target: &mut Session,
    dec: &mut Decoder<'_, S>,
    y: &[u32],
    drafts: &[u32],
    spec: &mut SpecStats,
    first: &mut bool,
    on_token: &mut impl FnMut(u32, &Array, bool) -> Result<Flow, E>,
) -> Result<Verified, E> {
    let n_draft = drafts.len();
    let mut fed = y.to_vec();
    fed.extend(drafts);
    // Only a pass with drafts can have something to give back.
    let point = (n_draft > 0).then(|| Checkpoint::take(target));
    let logits = if n_draft == 0 && y.len() == 1 {
        // One position: the one-token step (compiled where that is exact).
        target.step(y)?
    } else {
        target
            .forward(&fed)?
            .index((.., -(n_draft as i32 + 1).., ..))
            .squeeze_axes(&[0])?
    };
    // The grammar's view needs the history; copied only when there is a grammar.
    let history = match dec.sampler().is_constrained() {
        true => dec.history().to_vec(),
        false => Vec::new(),
    };
    let (kept, tokens, logprobs) = dec.sampler().pick_verify(&logits, &history, drafts)?;
    let tokens = ids_of(&tokens)?;
    spec.target_calls += 1;
    spec.drafted += n_draft;
    if std::mem::take(first) {
        dec.prompt_done();
    }
    let mut n = 0;
    let blind = plant::is(Defect::LookupWrongOffsetUnverified);
    while n < kept && (blind || tokens[n] == drafts[n]) {
        n += 1;
    }
    spec.accepted += n;
    if n < n_draft {
        spec.rolled_back += 1;
        spec.partly_accepted += usize::from(n > 0);
    }
    // The target keeps y and the accepted drafts; the emitted id at n is fed next round.
    if let Some(point) = point {
        let short = usize::from(plant::is(Defect::SpecTargetTrimShort) && n < n_draft);
        point.roll_back(target, &fed, y.len() + n + short)?;
    }
    // Emit the accepted drafts (the target's picks there), then the target's own id at n.
    let out: Vec<u32> = drafts[..n].iter().copied().chain([tokens[n]]).collect();
    for (i, &id) in out.iter().enumerate() {
        let lp = logprobs.index(i as i32).reshape(&[1, -1])?;
        if let Some(finish) = dec.emit(id, &lp, i < n, on_token)? {
            return Ok(Verified::Finished {
                finish,
                accepted: n,
            });
        }
    }
    Ok(Verified::Next {
        accepted: n,
        token: tokens[n],
    })
}

/// The draft model's policy: one round drafts up to γ tokens, verifies them in one target
/// forward and emits the accepted ones plus the target's own next token.
pub struct SpecRound {
    gamma: usize,
    /// What the target and the draft model are fed first in the next round.
    y: Vec<u32>,
    draft_y: Vec<u32>,
    first: bool,
    pub spec: SpecStats,
}

impl SpecRound {
    /// Prefills both sessions (each holding `prompt[..cached]`) up to the last prompt
    /// token, draft first (as mlx-lm). Refuses penalties, a logit bias and γ = 0.
    pub fn start<S: BorrowMut<Sampler>>(
        target: &mut Session,
        draft: &mut Session,
        dec: &mut Decoder<'_, S>,
        prompt: &[u32],
        cached: usize,
        gamma: usize,
    ) -> Result<Self, Exception> {
        assert!(
            cached < prompt.len(),
            "at least one prompt token must be fed"
        );
        refuse_penalties(dec.sampler())?;
        if gamma == 0 {
            return Err(Exception::custom("--num-draft-tokens must be at least 1"));
        }
        let last = prompt.len() - 1;
        prefill_to(draft, &prompt[cached..last])?;
        prefill_to(target, &prompt[cached..last])?;
        Ok(SpecRound {
            gamma,
            y: vec![prompt[last]],
            draft_y: vec![prompt[last]],
            first: true,
            spec: SpecStats::default(),
        })
    }

    /// One round. Some(finish) when the request is over.
    pub fn advance<S: BorrowMut<Sampler>, E: From<Exception>>(
        &mut self,
        target: &mut Session,
        draft: &mut Session,
        dec: &mut Decoder<'_, S>,
        on_token: &mut impl FnMut(u32, &Array, bool) -> Result<Flow, E>,
    ) -> Result<Option<Finish>, E> {
        if dec.remaining() == 0 {
            return Ok(Some(Finish::Length));
        }
        let n_draft = self.gamma.min(dec.remaining());
        // The draft model's recurrent states, to come back to after a rejection.
        let point = Checkpoint::take(draft);
        // Draft n_draft tokens, each fed back as a lazy array (mlx-lm's async drafting).
        let mut drafts: Vec<Array> = Vec::with_capacity(n_draft);
        let mut logits = draft.step(&self.draft_y)?;
        for i in 0..n_draft {
            let (d, _) = dec.pick_rows(&logits)?;
            mlx_rs::transforms::async_eval([&d])?;
            self.spec.draft_calls += 1;
            if i + 1 < n_draft {
                logits = draft.step_array(&d)?;
            }
            drafts.push(d);
        }
        let draft_ids = ids_of(&mlx_rs::ops::concatenate(&drafts, 0)?)?;
        let verdict = verify(
            target,
            dec,
            &self.y,
            &draft_ids,
            &mut self.spec,
            &mut self.first,
            on_token,
        )?;
        let (n, next) = match verdict {
            Verified::Finished { finish, accepted } => (accepted, Err(finish)),
            Verified::Next { accepted, token } => (accepted, Ok(token)),
        };
        // The draft model fed draft_y and every draft but the last; it keeps draft_y and the
        // accepted ones (after a full accept all it fed, and dγ comes next with the bonus).
        // Also when the request ended here, so that its caches hold no rejected draft (a
        // prompt-cache entry keeps them).
        if !plant::is(Defect::SpecKeepDraftTail) {
            let mut fed = self.draft_y.clone();
            fed.extend(&draft_ids[..n_draft - 1]);
            point.roll_back(draft, &fed, self.draft_y.len() + n)?;
        }
        let token = match next {
            Ok(token) => token,
            Err(finish) => return Ok(Some(finish)),
        };
        self.y = vec![token];
        self.draft_y = if n == n_draft {
            vec![draft_ids[n_draft - 1], token]
        } else {
            self.y.clone()
        };
        Ok(None)
    }
}

/// Speculative generation of up to `max_tokens` with `num_draft` drafts per round, both
/// sessions holding `prompt[..cached]` already. `on_token` sees each id, its
/// log-probabilities [1, vocab] and whether it was a draft the target accepted (the EOS id
/// is not passed on). Penalties and a logit bias are not supported (mlx-lm's processor
/// path feeds them a history this executor does not keep): such a sampler is refused; a
/// constrained one drafts under its grammar's mask.
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
    let mut dec = Decoder::new(prompt, max_tokens, eos_ids, sampler);
    let mut round = SpecRound::start(target, draft, &mut dec, prompt, cached, num_draft)?;
    let finish = loop {
        if let Some(finish) = round.advance(target, draft, &mut dec, &mut on_token)? {
            break finish;
        }
    };
    Ok((dec.finish(), round.spec, finish))
}
