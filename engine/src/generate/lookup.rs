//! Prompt-lookup decoding: speculation without a drafter. The drafts are copied from the
//! text itself — the prompt and every id emitted so far: the last n ids (n from the longest
//! n-gram down to 1) are looked up at their most recent earlier occurrence, and up to γ ids
//! that followed it there are proposed. The target verifies them with the same batched
//! pass as a draft model's round (`speculative::verify`), so greedy output is the plain
//! greedy output and sampled output is drawn from the target's own distribution (every
//! emitted id is the target's pick at its position; a draft only saves the forward).
//!
//! The names follow transformers' `prompt_lookup_num_tokens` (γ) and
//! `max_matching_ngram_size`, which vLLM's ngram speculator calls `num_speculative_tokens`
//! and `prompt_lookup_max`. One difference from transformers' candidate generator: it takes
//! the *earliest* match, we take the most recent (in an edit the text being copied is the
//! latest occurrence; the earliest is often a different context with the same n-gram).

use std::borrow::BorrowMut;

use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::decode::Decoder;
use super::rollback;
use super::sampler::Sampler;
use super::speculative::{self, SpecStats, Verified};
use super::{Finish, Flow, Session};
use crate::plant::{self, Defect};

/// transformers' defaults: 10 drafts per pass, n-grams of up to 2 ids.
pub const DEFAULT_NUM_TOKENS: usize = 10;
pub const DEFAULT_MAX_NGRAM: usize = 2;
/// The most drafts per pass and the longest n-gram a request may ask for.
pub const MAX_NUM_TOKENS: usize = 64;
pub const MAX_NGRAM: usize = 16;

/// A request's prompt-lookup settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LookupParams {
    /// γ: ids proposed per verify pass (at most; fewer where the match is near the end).
    pub num_tokens: usize,
    /// The longest n-gram matched; shorter ones down to 1 are tried when it finds nothing.
    pub max_ngram: usize,
}

/// A setting out of range: which one (`num_tokens` or `max_ngram`) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadLookup {
    pub field: &'static str,
    pub message: String,
}

impl LookupParams {
    /// Checked settings (`max_ngram` None: the default).
    pub fn new(num_tokens: usize, max_ngram: Option<usize>) -> Result<Self, BadLookup> {
        let bad = |field, what: &str, max| BadLookup {
            field,
            message: format!("{what} must be between 1 and {max}"),
        };
        if !(1..=MAX_NUM_TOKENS).contains(&num_tokens) {
            return Err(bad("num_tokens", "the drafts per pass", MAX_NUM_TOKENS));
        }
        let max_ngram = max_ngram.unwrap_or(DEFAULT_MAX_NGRAM);
        if !(1..=MAX_NGRAM).contains(&max_ngram) {
            return Err(bad("max_ngram", "the n-gram size", MAX_NGRAM));
        }
        Ok(LookupParams {
            num_tokens,
            max_ngram,
        })
    }
}

/// Up to `limit` ids copied from `history`: what followed the most recent earlier occurrence
/// of its last n ids, for the largest n ≤ `max_ngram` that occurs earlier. A copy that
/// reaches the end of `history` goes on over the ids it has proposed (history and drafts
/// read as one text), so a loop in the text is drafted γ ids at a time, not one period.
/// Empty when not even the last id occurs earlier.
pub fn propose(history: &[u32], max_ngram: usize, limit: usize) -> Vec<u32> {
    let len = history.len();
    if limit == 0 || len < 2 {
        return Vec::new();
    }
    for n in (1..=max_ngram.min(len - 1)).rev() {
        let tail = &history[len - n..];
        // Starts s < len - n, latest first: the occurrence ends before the tail does.
        if let Some(s) = (0..len - n).rev().find(|&s| &history[s..s + n] == tail) {
            let from = s + n + usize::from(plant::is(Defect::LookupWrongOffsetUnverified));
            let mut drafts = Vec::with_capacity(limit);
            for i in from..from + limit {
                // i - len < drafts.len(): a draft already made when i is past the history.
                let id = history
                    .get(i)
                    .copied()
                    .or_else(|| drafts.get(i - len).copied());
                match id {
                    Some(id) => drafts.push(id),
                    None => break,
                }
            }
            return drafts;
        }
    }
    Vec::new()
}

/// The refusal of penalties and a logit bias (the verify pass samples all positions at
/// once, without the processors' per-position history). A constraint is verified under its
/// mask (`Sampler::pick_verify`).
pub const PROCESSORS_REFUSED: &str = "prompt-lookup decoding does not support repetition, \
     presence or frequency penalties or a logit bias; drop them or prompt lookup";

/// The prompt-lookup policy: one round looks the drafts up in the history, verifies them
/// in one target forward and emits the accepted ones plus the target's own next id.
pub struct LookupRound {
    params: LookupParams,
    /// The id the target is fed first in the next round (emitted, or the last prompt id).
    y: u32,
    first: bool,
    pub spec: SpecStats,
}

impl LookupRound {
    /// Prefills `target` (holding `prompt[..cached]`) up to the last prompt id, which the
    /// first verify pass feeds. Refuses penalties and a logit bias.
    pub fn start<S: BorrowMut<Sampler>>(
        target: &mut Session,
        dec: &mut Decoder<'_, S>,
        prompt: &[u32],
        cached: usize,
        params: LookupParams,
    ) -> Result<Self, Exception> {
        assert!(
            cached < prompt.len(),
            "at least one prompt token must be fed"
        );
        if dec.sampler().has_penalties() {
            return Err(Exception::custom(PROCESSORS_REFUSED));
        }
        let last = prompt.len() - 1;
        speculative::prefill_to(target, &prompt[cached..last])?;
        Ok(LookupRound {
            params,
            y: prompt[last],
            first: true,
            spec: SpecStats::default(),
        })
    }

    /// One round. Some(finish) when the request is over.
    pub fn advance<S: BorrowMut<Sampler>, E: From<Exception>>(
        &mut self,
        target: &mut Session,
        dec: &mut Decoder<'_, S>,
        on_token: &mut impl FnMut(u32, &Array, bool) -> Result<Flow, E>,
    ) -> Result<Option<Finish>, E> {
        if dec.remaining() == 0 {
            return Ok(Some(Finish::Length));
        }
        // The last id emitted (or of the prompt) ends the history; the target's own id after
        // the drafts is the one more each pass emits, so drafting `remaining` is never needed.
        let limit = self
            .params
            .num_tokens
            .min(dec.remaining() - 1)
            .min(rollback::room(&mut target.caches));
        let drafts = propose(dec.history(), self.params.max_ngram, limit);
        let verdict = speculative::verify(
            target,
            dec,
            &[self.y],
            &drafts,
            &mut self.spec,
            &mut self.first,
            on_token,
        )?;
        match verdict {
            Verified::Finished { finish, .. } => Ok(Some(finish)),
            Verified::Next { token, .. } => {
                self.y = token;
                Ok(None)
            }
        }
    }
}
