//! Speculative decoding with optiq 0.7.7's Gemma 4 assistant drafter, as its
//! `assistant_generate_step` runs it (the path `optiq serve --drafter` takes). Unlike
//! mlx-lm's loop: the drafter has no cache and reads the target's (`DonorKv`) plus the
//! target's hidden state, so the first pass after the prefill only verifies (no hidden state
//! yet); the target verifies through its head *without* the final softcap; a pass drafts at
//! most min(γ, tokens still wanted − 1); the token a pass ends on (correction or bonus) is
//! fed first in the next pass and emitted there; rollback trims every target cache — a
//! sliding-window ring by slicing off its tail (optiq's `_trim_rotating`), so rings past
//! their window roll back too. The drafter always drafts greedily.

use std::time::Instant;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::Array;

use super::sampler::Sampler;
use super::speculative::SpecStats;
use super::{ids_array, Finish, Flow, Session, Stats};
use crate::cache::{Cache, KvCache, RotatingKvCache};
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
fn read_temporal(cache: &mut Box<dyn Cache>) -> Result<(Array, Array), Exception> {
    let any = cache.as_any_mut();
    if let Some(ring) = any.downcast_mut::<RotatingKvCache>() {
        return ring.newest_window();
    }
    if let Some(kv) = any.downcast_mut::<KvCache>() {
        return kv
            .live()
            .ok_or_else(|| Exception::custom("a donor cache is empty or quantized"));
    }
    Err(Exception::custom(
        "the assistant drafter reads standard or rotating caches only",
    ))
}

/// optiq's `_trim_cache`: every target cache gives back `n` positions.
fn trim_all(caches: &mut [Box<dyn Cache>], n: usize) -> Result<(), Exception> {
    if n == 0 {
        return Ok(());
    }
    for c in caches.iter_mut() {
        if plant::is(Defect::AssistantRingTrimLikeMlxLm) {
            c.trim(n as i32);
        } else if let Some(ring) = c.as_any_mut().downcast_mut::<RotatingKvCache>() {
            ring.trim_tail(n as i32)?;
        } else if c.is_trimmable() {
            c.trim(n as i32);
        } else {
            return Err(Exception::custom(
                "speculative decoding needs caches that can give positions back",
            ));
        }
    }
    Ok(())
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
    mut trace: Option<&mut AssistantTrace>,
    mut on_token: impl FnMut(u32, &Array, bool) -> Result<Flow, Exception>,
) -> Result<(Stats, SpecStats, Finish), Exception> {
    assert!(
        cached < prompt.len(),
        "at least one prompt token must be fed"
    );
    super::speculative::refuse_processors(sampler)?;
    let (mut sliding, full) = target.donor_caches()?;
    if plant::is(Defect::AssistantFirstSlidingDonor) {
        sliding = 0;
    }
    let mut stats = Stats {
        prompt_tokens: prompt.len(),
        ..Stats::default()
    };
    let mut spec = SpecStats::default();
    let start = Instant::now();
    let last = prompt.len() - 1;
    for chunk in prompt[cached..last].chunks(session.prefill_step.max(1)) {
        session.prefill_chunk(chunk)?;
    }
    let mut cur = prompt[last];
    let mut cur_is_output = false;
    let mut h_prev: Option<Array> = None;
    let mut prev_lp: Option<Array> = None;
    let mut produced = 0usize;
    let finish;
    let mut decode_start = Instant::now();
    // Emits one id; None to go on, Some(finish) to stop.
    let mut emit = |id: u32, lp: &Array, from_draft: bool, produced: &mut usize| {
        if eos_ids.contains(&id) {
            return Ok::<_, Exception>(Some(Finish::Eos));
        }
        let flow = on_token(id, &lp.reshape(&[1, -1])?, from_draft)?;
        *produced += 1;
        if flow == Flow::Stop {
            return Ok(Some(Finish::Stop));
        }
        Ok((*produced >= max_tokens).then_some(Finish::Length))
    };
    loop {
        let remaining = max_tokens as i64 - produced as i64 - i64::from(cur_is_output);
        let budget = (gamma as i64).min(remaining - 1);
        let mut drafts: Vec<u32> = Vec::new();
        if let (Some(h), true) = (&h_prev, budget > 0) {
            let position = session.caches[0].offset();
            let kv = DonorKv {
                sliding: read_temporal(&mut session.caches[sliding])?,
                full: read_temporal(&mut session.caches[full])?,
            };
            let (mut tok_in, mut h_in) = (cur, h.clone());
            for k in 0..budget as i32 {
                let emb = target.embed_scaled(&ids_array(&[tok_in]))?;
                let (logits, h_next) = drafter.forward(&emb, &h_in, &kv, position + k)?;
                let d = argmax_axis(&logits.reshape(&[-1])?, 0, None)?;
                d.eval()?;
                let d = d.as_slice::<u32>()[0];
                if let Some(t) = trace.as_mut() {
                    t.drafts.push((position + k, tok_in, d, logits));
                }
                drafts.push(d);
                (tok_in, h_in) = (d, h_next);
            }
        }
        let mut inp = vec![cur];
        inp.extend(&drafts);
        let hidden = target.hidden(&ids_array(&inp), &mut session.caches)?;
        let logits = target.head_uncapped(&hidden)?.index(0);
        spec.target_calls += 1;
        if let Some(t) = trace.as_mut() {
            t.passes.push((inp.clone(), 0));
        }
        let lp = logits.subtract(logits.logsumexp_axis(-1, true)?)?;
        let toks = sampler.sample(&lp)?;
        mlx_rs::transforms::async_eval([&toks])?;
        // Positions fed this pass that are emitted (the rest are trimmed if we stop).
        let mut kept = 1;
        if cur_is_output {
            let lp_cur = prev_lp.take().expect("an output token has its log-probs");
            if let Some(f) = emit(cur, &lp_cur, false, &mut produced)? {
                finish = f;
                trim_all(&mut session.caches, inp.len() - kept)?;
                break;
            }
        } else {
            stats.prompt_time = start.elapsed();
            decode_start = Instant::now();
        }
        toks.eval()?;
        let toks = toks.as_slice::<u32>().to_vec();
        let n = drafts.iter().zip(&toks).take_while(|(d, t)| d == t).count();
        spec.drafted += drafts.len();
        spec.accepted += n;
        if let Some(pass) = trace.as_mut().and_then(|t| t.passes.last_mut()) {
            pass.1 = n;
        }
        let mut stop = None;
        for (j, &d) in drafts[..n].iter().enumerate() {
            kept = j + 2;
            if let Some(f) = emit(d, &lp.index(j as i32), true, &mut produced)? {
                stop = Some(f);
                break;
            }
        }
        if let Some(f) = stop {
            finish = f;
            trim_all(&mut session.caches, inp.len() - kept)?;
            break;
        }
        trim_all(&mut session.caches, inp.len() - (n + 1))?;
        cur = toks[n];
        prev_lp = Some(lp.index(n as i32));
        h_prev = Some(hidden.index((.., n as i32..n as i32 + 1, ..)));
        cur_is_output = true;
    }
    stats.generated_tokens = produced;
    stats.generation_time = decode_start.elapsed();
    Ok((stats, spec, finish))
}
