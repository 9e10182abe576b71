//! Prompt lookup and a draft model's rows inside the batch lane (issue 43 item 4): while
//! some row asks for lookup (`prompt_lookup_num_tokens`) or drafts with `--draft-model`, a
//! decode step is a speculation round (`generate::batch_lookup`): each lookup row drafts
//! from its own text, each drafting row from the drafter's batch (`draft.rs`), up to its γ
//! and the ids it still may emit; the other rows draft nothing, and one forward verifies
//! every row. Each row then picks as the serial lane's verify does — a speculating row
//! with its sampler over its own run, its drafts + 1 positions (so a seeded lookup row
//! draws what it draws on the serial lane; it also joins holding its prompt but the last
//! id, `admit.rs`) (`Sampler::pick_verify`: greedy, sampled or under a grammar), any other row its next id
//! from its first position with its own processors (`Decoder::pick`); when every row samples
//! plain greedy, one argmax for all (`GreedyPicks`) — and emits its picks up to the first
//! draft they disagree with, one id at a time through the decode core, so a stop string,
//! EOS or the token limit ends it mid-run as on a plain step. Each row gives back the
//! positions it fed past what it emitted (`Batch::trim_rows`).
//!
//! A round needs the rows' texts on the host, so the queued samples of the last step are
//! emitted first (the round is not pipelined, as the serial lane's lookup is not). Where no
//! row finds a draft, the step is a plain one. Models whose caches cannot give positions
//! back row by row (sliding-window rings, recurrent states: `batch::trims_rows`) decode
//! lookup rows plainly in the lane. Counted in /stats `speculative` as the serial lane's
//! lookup is.

use std::sync::atomic::Ordering;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use super::contain::failed;
use super::{Lane, Outcome, Row};
use crate::generate::batch_lookup::{agreed, runs, GreedyPicks};
use crate::generate::lookup::propose;
use crate::generate::Finish;
use crate::serve::worker::Worker;

/// A row's picks over its run: ids (host), their log-probabilities [ids, vocab], and how
/// many of its drafts they may accept.
struct Picked {
    ids: Vec<u32>,
    logprobs: Array,
    kept: usize,
}

impl Worker {
    /// Whether this lane's steps are lookup rounds now: the model's caches trim by row and
    /// some row asks for lookup.
    pub(super) fn lookup_due(lane: &Lane<'_>) -> bool {
        lane.row_trims
            && lane
                .rows
                .iter()
                .any(|r| r.lookup.is_some() || r.draft.is_some())
    }

    /// Each row's picks from the verify's `logits` [rows, run length, vocab] (lazy where
    /// they can be; read back together), or the row's failure.
    fn pick_rounds(
        rows: &mut [Row<'_>],
        logits: &Array,
        drafts: &[Vec<u32>],
    ) -> Result<Vec<Result<Picked, Exception>>, Exception> {
        if rows.iter_mut().all(|r| r.dec.plain_greedy()) {
            let greedy = GreedyPicks::of(logits)?;
            return Ok((0..rows.len())
                .map(|r| {
                    Ok(Picked {
                        ids: greedy.row(r).to_vec(),
                        logprobs: greedy.logprobs(r),
                        kept: drafts[r].len(),
                    })
                })
                .collect());
        }
        let lazy: Vec<Result<(usize, Array, Array), Exception>> = rows
            .iter_mut()
            .enumerate()
            .map(|(r, row)| {
                if row.lookup.is_some() || row.draft.is_some() {
                    let history = match row.dec.sampler().is_constrained() {
                        true => row.dec.history().to_vec(),
                        false => Vec::new(),
                    };
                    // The row's own positions only: a sampled row then draws over the shape
                    // the serial lane's verify draws over, so its seeded answer is the same.
                    let own = match crate::plant::is(crate::plant::Defect::BatchLookupDrawsPadded) {
                        // Planted: the row draws over the round's longest run.
                        true => logits.shape()[1],
                        false => drafts[r].len() as i32 + 1,
                    };
                    let run = logits.index((r as i32, 0..own));
                    row.dec.sampler().pick_verify(&run, &history, &drafts[r])
                } else {
                    let first = logits.index((r as i32, 0..1));
                    let (y, lp) = row.dec.pick(&first)?;
                    Ok((0, y, lp))
                }
            })
            .collect();
        let ids: Vec<&Array> = lazy.iter().flatten().map(|(_, ids, _)| ids).collect();
        // One read back for every row (a row whose ids fail to evaluate fails the lot, as
        // a step's samples do).
        mlx_rs::transforms::eval(ids)?;
        Ok(lazy
            .into_iter()
            .map(|picked| {
                let (kept, ids, logprobs) = picked?;
                let ids = ids.as_dtype(mlx_rs::Dtype::Uint32)?;
                Ok(Picked {
                    ids: ids.as_slice::<u32>().to_vec(),
                    logprobs,
                    kept,
                })
            })
            .collect())
    }

    /// Emits row `row`'s picks up to the first draft they disagree with; its outcome, and
    /// the ids it emitted (pushed to its history) and drafts accepted among them.
    fn emit_round(row: &mut Row<'_>, picked: &Picked, drafts: &[u32]) -> (Option<Outcome>, usize) {
        let accepted = agreed(&picked.ids, drafts, picked.kept);
        for (j, &id) in picked.ids[..=accepted].iter().enumerate() {
            let j = j as i32;
            match Self::emit_next(row, id, &picked.logprobs.index(j..j + 1)) {
                Outcome::Continue if !row.emit.gone => {}
                Outcome::Continue => return (Some(Outcome::Done(Finish::Stop)), accepted),
                other => return (Some(other), accepted),
            }
        }
        (None, accepted)
    }

    /// Runs this step as a lookup round when one is due and some row finds drafts (true);
    /// false leaves the step to `decode_step` (the queued samples may have been emitted).
    pub(super) fn lookup_round<'w>(&'w self, lane: &mut Lane<'w>) -> bool {
        if !Self::lookup_due(lane) {
            return false;
        }
        // Drafts come from the rows' texts: the queued samples are emitted first.
        self.flush(lane);
        let mut drafts: Vec<Vec<u32>> = lane
            .rows
            .iter()
            .map(|r| match r.lookup {
                Some(p) => {
                    let limit = p.num_tokens.min(r.dec.remaining().saturating_sub(1));
                    propose(r.dec.history(), p.max_ngram, limit)
                }
                None => Vec::new(),
            })
            .collect();
        let drafted = self.model_drafts(lane, &mut drafts);
        if drafts.iter().all(Vec::is_empty) {
            return false;
        }
        let next: Vec<u32> = lane.rows.iter().map(|r| r.next).collect();
        let runs = runs(&next, &drafts);
        let picks = lane
            .batch
            .verify(&runs)
            .and_then(|logits| Self::pick_rounds(&mut lane.rows, &logits, &drafts));
        let picks = match picks {
            Ok(p) => p,
            Err(e) => {
                // As a failed step: every row retried alone from the ids it had fed.
                self.contain(lane, &e);
                return true;
            }
        };
        let fed = runs[0].len();
        let (mut n_drafts, mut accepted) = (0, 0);
        let mut outcomes = Vec::with_capacity(lane.rows.len());
        let mut given_back = Vec::with_capacity(lane.rows.len());
        for ((row, picked), drafts) in lane.rows.iter_mut().zip(&picks).zip(&drafts) {
            let before = row.dec.history().len();
            let outcome = match picked {
                Ok(picked) => {
                    let (outcome, agreed) = Self::emit_round(row, picked, drafts);
                    accepted += agreed;
                    outcome
                }
                Err(e) => Some(failed(e)),
            };
            // The row keeps its next id and the drafts it emitted after it (an EOS id is
            // not emitted: the next id alone stays).
            let emitted = row.dec.history().len() - before;
            given_back.push(fed - emitted.max(1));
            n_drafts += drafts.len();
            outcomes.push(outcome);
        }
        self.settle_drafter(lane, &drafted, &given_back, fed, &outcomes);
        let c = &self.counters;
        c.spec_drafted.fetch_add(n_drafts as u64, Ordering::Relaxed);
        c.spec_accepted
            .fetch_add(accepted as u64, Ordering::Relaxed);
        c.spec_target_calls.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = lane.batch.trim_rows(&given_back) {
            let rows = std::mem::take(&mut lane.rows);
            for (row, outcome) in rows.into_iter().zip(outcomes) {
                self.close(row, outcome.unwrap_or_else(|| failed(&e)));
            }
            self.fresh_batch(lane);
            return true;
        }
        if !self.settle(&mut lane.rows, &mut lane.batch, outcomes, None) {
            self.fresh_batch(lane);
        }
        lane.steps += 1;
        true
    }
}
