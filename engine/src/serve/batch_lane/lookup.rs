//! Prompt lookup inside the batch lane (issue 43 item 4): while some row asks for it
//! (`prompt_lookup_num_tokens`) and every row samples plain greedy, a decode step is a
//! lookup round (`generate::batch_lookup`): each lookup row drafts from its own text (up
//! to its γ and the ids it still may emit), the other rows draft nothing, one forward
//! verifies every row, and each row emits what plain greedy decoding emits — its accepted
//! drafts and greedy's own id after them — one id at a time through the decode core, so a
//! stop string, EOS or the token limit ends it mid-run as on a plain step. Each row gives
//! back the positions it fed past what it emitted (`Batch::trim_rows`).
//!
//! A round needs the rows' texts on the host, so the queued samples of the last step are
//! emitted first (the round is not pipelined, as the serial lane's lookup is not). Where no
//! row finds a draft, the step is a plain one. Rows that sample otherwise (temperature,
//! processors) make every step plain while they run: their lookup rows decode plainly,
//! which emits the same ids. Models whose caches cannot give positions back row by row
//! (sliding-window rings, recurrent states: `batch::trims_rows`) decode lookup rows
//! plainly in the lane. Counted in /stats `speculative` as the serial lane's lookup is.

use std::sync::atomic::Ordering;

use super::{Lane, Outcome};
use crate::generate::batch::Batch;
use crate::generate::batch_lookup::Verify;
use crate::generate::lookup::propose;
use crate::generate::Finish;
use crate::serve::error::ApiError;
use crate::serve::worker::Worker;

impl Worker {
    /// Whether this lane's steps are lookup rounds now: the model's caches trim by row,
    /// some row asks for lookup, and every row samples plain greedy.
    pub(super) fn lookup_due(lane: &mut Lane<'_>) -> bool {
        lane.row_trims
            && lane.rows.iter().any(|r| r.lookup.is_some())
            && lane.rows.iter_mut().all(|r| r.dec.plain_greedy())
    }

    /// Runs this step as a lookup round when one is due and some row finds drafts (true);
    /// false leaves the step to `decode_step` (the queued samples may have been emitted).
    pub(super) fn lookup_round<'w>(&'w self, lane: &mut Lane<'w>) -> bool {
        if !Self::lookup_due(lane) {
            return false;
        }
        // Drafts come from the rows' texts: the queued samples are emitted first.
        self.flush(lane);
        let drafts: Vec<Vec<u32>> = lane
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
        if drafts.iter().all(Vec::is_empty) {
            return false;
        }
        let next: Vec<u32> = lane.rows.iter().map(|r| r.next).collect();
        let verify = match Verify::run(&mut lane.batch, &next, &drafts) {
            Ok(v) => v,
            Err(e) => {
                // As a failed step: every row retried alone from the ids it had fed.
                self.contain(lane, &e);
                return true;
            }
        };
        let fed = verify.run_len();
        let (mut drafted, mut accepted) = (0, 0);
        let mut outcomes = Vec::with_capacity(lane.rows.len());
        let mut given_back = Vec::with_capacity(lane.rows.len());
        for (r, row) in lane.rows.iter_mut().enumerate() {
            let before = row.dec.history().len();
            let mut outcome = None;
            for j in 0..=verify.accepted(r) {
                match Self::emit_next(row, verify.greedy(r)[j], &verify.logprobs(r, j)) {
                    Outcome::Continue if !row.emit.gone => {}
                    Outcome::Continue => {
                        outcome = Some(Outcome::Done(Finish::Stop));
                        break;
                    }
                    other => {
                        outcome = Some(other);
                        break;
                    }
                }
            }
            // The row keeps its next id and the drafts it emitted after it (an EOS id is
            // not emitted: the next id alone stays).
            let emitted = row.dec.history().len() - before;
            given_back.push(fed - emitted.max(1));
            drafted += drafts[r].len();
            accepted += verify
                .accepted(r)
                .min(drafts[r].len())
                .min(emitted.saturating_sub(1));
            outcomes.push(outcome);
        }
        let c = &self.counters;
        c.spec_drafted.fetch_add(drafted as u64, Ordering::Relaxed);
        c.spec_accepted
            .fetch_add(accepted as u64, Ordering::Relaxed);
        c.spec_target_calls.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = lane.batch.trim_rows(&given_back) {
            let rows = std::mem::take(&mut lane.rows);
            for (row, outcome) in rows.into_iter().zip(outcomes) {
                let failed =
                    || Outcome::Failed(ApiError::server(format!("generation failed: {e}")));
                self.close(row, outcome.unwrap_or_else(failed));
            }
            lane.batch = Batch::for_lane(self.model.as_ref());
            return true;
        }
        if !self.settle(&mut lane.rows, &mut lane.batch, outcomes, None) {
            lane.batch = Batch::for_lane(self.model.as_ref());
        }
        lane.steps += 1;
        true
    }
}
