//! Speculative decoding with optiq 0.7.7's Gemma 4 assistant drafter, as its
//! `assistant_generate_step` runs it (the path `optiq serve --drafter` takes). Unlike
//! mlx-lm's loop: the drafter has no cache and reads the target's (`DonorKv`) plus the
//! target's hidden state, so the first pass after the prefill only verifies (no hidden state
//! yet); the target verifies through its head *without* the final softcap; a pass drafts at
//! most min(γ, tokens still wanted − 1); the token a pass ends on (correction or bonus) is
//! fed first in the next pass and emitted there; rollback trims every target cache — a
//! sliding-window ring by slicing off its tail (optiq's `_trim_rotating`), so rings past
//! their window roll back too. The drafter always drafts greedily.

use std::borrow::BorrowMut;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::Array;

use super::decode::Decoder;
use super::sampler::Sampler;
use super::speculative::SpecStats;
use super::{ids_array, Finish, Flow, Session, Stats};
use crate::cache::Cache;
use crate::model::{AssistantDrafter, AssistantTarget, DonorKv};
use crate::plant::{self, Defect};

/// What a run did, step by step (for the L2 gate): every draft call (position, token in,
/// drafted id, the drafter's logits) and every verify pass (ids fed, drafts accepted).
#[derive(Default)]
pub struct AssistantTrace {
    pub drafts: Vec<(i32, u32, u32, Array)>,
    pub passes: Vec<(Vec<u32>, usize)>,
}

/// A donor cache's K/V in temporal order, as optiq's `_read_cache_temporal` reads it.
fn read_temporal(cache: &dyn Cache) -> Result<(Array, Array), Exception> {
    cache
        .as_kv_ref()
        .ok_or_else(|| {
            Exception::custom("the assistant drafter reads standard or rotating caches only")
        })?
        .temporal_kv()
}

/// optiq's `_trim_cache`: every target cache gives back `n` positions (`Cache::rollback`:
/// a ring slices off its tail, others trim).
fn trim_all(caches: &mut [Box<dyn Cache>], n: usize) -> Result<(), Exception> {
    if n == 0 {
        return Ok(());
    }
    for c in caches.iter_mut() {
        if plant::is(Defect::AssistantRingTrimLikeMlxLm) {
            c.trim(n as i32);
        } else {
            c.rollback(n as i32)?;
        }
    }
    Ok(())
}

/// The assistant's policy: one pass drafts up to γ tokens from the target's last hidden
/// state and caches, verifies them with the target, and emits the token the previous pass
/// ended on plus the accepted drafts.
pub struct AssistPass<'t> {
    gamma: usize,
    /// The donor caches the drafter reads (the last sliding and the last full layer).
    sliding: usize,
    full: usize,
    /// The id fed first in the next pass, and whether it is output (emitted there).
    cur: u32,
    cur_is_output: bool,
    /// The target's hidden state and log-probabilities at `cur` (None before the first pass).
    h_prev: Option<Array>,
    prev_lp: Option<Array>,
    trace: Option<&'t mut AssistantTrace>,
    pub spec: SpecStats,
}

impl<'t> AssistPass<'t> {
    /// Prefills `session` (the target, holding `prompt[..cached]`) up to the last prompt
    /// token. Refuses logits processors.
    pub fn start<S: BorrowMut<Sampler>>(
        session: &mut Session,
        target: &dyn AssistantTarget,
        dec: &mut Decoder<'_, S>,
        prompt: &[u32],
        cached: usize,
        gamma: usize,
        trace: Option<&'t mut AssistantTrace>,
    ) -> Result<Self, Exception> {
        assert!(
            cached < prompt.len(),
            "at least one prompt token must be fed"
        );
        super::speculative::refuse_processors(dec.sampler())?;
        let (mut sliding, full) = target.donor_caches()?;
        if plant::is(Defect::AssistantFirstSlidingDonor) {
            sliding = 0;
        }
        let last = prompt.len() - 1;
        for chunk in prompt[cached..last].chunks(session.prefill_step.max(1)) {
            session.prefill_chunk(chunk)?;
        }
        Ok(AssistPass {
            gamma,
            sliding,
            full,
            cur: prompt[last],
            cur_is_output: false,
            h_prev: None,
            prev_lp: None,
            trace,
            spec: SpecStats::default(),
        })
    }

    /// The drafter's guesses after `cur`: at most `budget`, greedy, none before the target
    /// has given a hidden state.
    fn draft(
        &mut self,
        session: &mut Session,
        target: &dyn AssistantTarget,
        drafter: &AssistantDrafter,
        budget: i64,
    ) -> Result<Vec<u32>, Exception> {
        let mut drafts = Vec::new();
        let Some(h) = self.h_prev.as_ref().filter(|_| budget > 0) else {
            return Ok(drafts);
        };
        let position = session.caches[0].offset();
        let kv = DonorKv {
            sliding: read_temporal(session.caches[self.sliding].as_ref())?,
            full: read_temporal(session.caches[self.full].as_ref())?,
        };
        let (mut tok_in, mut h_in) = (self.cur, h.clone());
        for k in 0..budget as i32 {
            let emb = target.embed_scaled(&ids_array(&[tok_in]))?;
            let (logits, h_next) = drafter.forward(&emb, &h_in, &kv, position + k)?;
            let d = argmax_axis(&logits.reshape(&[-1])?, 0, None)?;
            d.eval()?;
            let d = d.as_slice::<u32>()[0];
            if let Some(t) = self.trace.as_mut() {
                t.drafts.push((position + k, tok_in, d, logits));
            }
            drafts.push(d);
            (tok_in, h_in) = (d, h_next);
        }
        Ok(drafts)
    }

    /// One pass. Some(finish) when the request is over (the positions fed past the last
    /// emitted one given back).
    pub fn advance<S: BorrowMut<Sampler>, E: From<Exception>>(
        &mut self,
        session: &mut Session,
        target: &dyn AssistantTarget,
        drafter: &AssistantDrafter,
        dec: &mut Decoder<'_, S>,
        on_token: &mut impl FnMut(u32, &Array, bool) -> Result<Flow, E>,
    ) -> Result<Option<Finish>, E> {
        let remaining = dec.remaining() as i64 - i64::from(self.cur_is_output);
        let budget = (self.gamma as i64).min(remaining - 1);
        let drafts = self.draft(session, target, drafter, budget)?;
        let mut inp = vec![self.cur];
        inp.extend(&drafts);
        let hidden = target.hidden(&ids_array(&inp), &mut session.caches)?;
        let logits = target.head_uncapped(&hidden)?.index(0);
        self.spec.target_calls += 1;
        if let Some(t) = self.trace.as_mut() {
            t.passes.push((inp.clone(), 0));
        }
        let (toks, lp) = dec.pick_rows(&logits)?;
        mlx_rs::transforms::async_eval([&toks])?;
        if self.cur_is_output {
            let lp_cur = self
                .prev_lp
                .take()
                .expect("an output token has its log-probs");
            let lp_cur = lp_cur.reshape(&[1, -1])?;
            if let Some(finish) = dec.emit(self.cur, &lp_cur, false, on_token)? {
                trim_all(&mut session.caches, inp.len() - 1)?;
                return Ok(Some(finish));
            }
        } else {
            dec.prompt_done();
        }
        toks.eval()?;
        let toks = toks.as_slice::<u32>().to_vec();
        let n = drafts.iter().zip(&toks).take_while(|(d, t)| d == t).count();
        self.spec.drafted += drafts.len();
        self.spec.accepted += n;
        if let Some(pass) = self.trace.as_mut().and_then(|t| t.passes.last_mut()) {
            pass.1 = n;
        }
        for (j, &d) in drafts[..n].iter().enumerate() {
            let lp_d = lp.index(j as i32).reshape(&[1, -1])?;
            if let Some(finish) = dec.emit(d, &lp_d, true, on_token)? {
                // Kept: `cur` and the drafts up to this one.
                trim_all(&mut session.caches, inp.len() - (j + 2))?;
                return Ok(Some(finish));
            }
        }
        trim_all(&mut session.caches, inp.len() - (n + 1))?;
        self.cur = toks[n];
        self.prev_lp = Some(lp.index(n as i32));
        self.h_prev = Some(hidden.index((.., n as i32..n as i32 + 1, ..)));
        self.cur_is_output = true;
        Ok(None)
    }
}

/// Assistant-drafted generation of up to `max_tokens`; `session` holds the target and
/// `prompt[..cached]`. `on_token` sees each id, its log-probabilities [1, vocab] and whether
/// it was an accepted draft (the EOS id is not passed on). Logits processors are refused.
#[allow(clippy::too_many_arguments)]
pub fn assistant_generate_in(
    session: &mut Session,
    target: &dyn AssistantTarget,
    drafter: &AssistantDrafter,
    prompt: &[u32],
    cached: usize,
    gamma: usize,
    max_tokens: usize,
    eos_ids: &[u32],
    sampler: &mut Sampler,
    trace: Option<&mut AssistantTrace>,
    mut on_token: impl FnMut(u32, &Array, bool) -> Result<Flow, Exception>,
) -> Result<(Stats, SpecStats, Finish), Exception> {
    let mut dec = Decoder::new(prompt, max_tokens, eos_ids, sampler);
    let mut pass = AssistPass::start(session, target, &mut dec, prompt, cached, gamma, trace)?;
    let finish = loop {
        if let Some(f) = pass.advance(session, target, drafter, &mut dec, &mut on_token)? {
            break f;
        }
    };
    Ok((dec.finish(), pass.spec, finish))
}
