//! The batch lane's admissions: which waiting requests start, how much of their prompts is
//! prefilled per tick, and how they join the batch.
//!
//! Up to `PREFILL_BATCH` requests are in prefill at once (mlx_lm.server's
//! `--prompt-concurrency`, BatchGenerator's `prefill_batch_size`, both 8), as many as there
//! are free slots. Each tick they get at most one prefill step of prompt tokens in all
//! (`--prefill-step-size`), in arrival order, each prompt in its own chunks of up to that
//! size (the chunks a request prefilled alone would get, so every row's caches hold the
//! same numbers as on the serial lane); the first admission's chunk always runs, and a
//! chunk that would overrun the budget waits for the next tick. So the rows already
//! decoding wait for at most one prefill step's worth of prompt tokens between two of
//! their steps, and short prompts — or prompts mostly in the prompt cache — are admitted
//! many per tick.
//!
//! An admission whose caches hold all its prompt but the last token joins the batch (all
//! that are ready in a tick join at once), its last token fed by the next batched step,
//! which samples its first id — as BatchGenerator's generation batch takes the last prompt
//! tokens. A one-token prompt with nothing cached has no caches to join with: its token is
//! stepped alone and its first id sampled there.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{Lane, Outcome, Row};
use crate::generate::decode::Decoder;
use crate::generate::sampler::Sampler;
use crate::generate::{Finish, Session};
use crate::serve::emit::{Emitter, Outbox};
use crate::serve::error::ApiError;
use crate::serve::worker::{Job, Worker};

/// Requests in prefill at once at most (mlx_lm.server's default prompt concurrency).
pub const PREFILL_BATCH: usize = 8;

/// A request being admitted: its prompt is prefilled chunk by chunk.
pub(super) struct Admission<'w> {
    row: Row<'w>,
    session: Session<'w>,
    prompt: Vec<u32>,
    /// Prompt tokens in the session's caches.
    fed: usize,
}

impl Admission<'_> {
    /// The prompt tokens the caches take before the row joins: all but the last.
    fn to_feed(&self) -> usize {
        self.prompt.len() - 1 - self.fed
    }
}

impl Worker {
    /// Starts admitting waiting requests while there are free slots, up to PREFILL_BATCH
    /// in prefill at once.
    pub(super) fn start_admissions<'w>(&'w self, lane: &mut Lane<'w>) {
        while lane.admissions.len() < PREFILL_BATCH
            && lane.rows.len() + lane.admissions.len() < lane.slots
        {
            let Some(job) = lane.waiting.pop_front() else {
                break;
            };
            if let Some(adm) = self.start(job) {
                lane.admissions.push(adm);
            }
        }
    }

    /// Starts admitting a request: its limits checked, prompt cache consulted, session made.
    fn start<'w>(&'w self, job: Job) -> Option<Admission<'w>> {
        let Job {
            request,
            prompt_ids: prompt,
            events,
            deadline,
            queued,
        } = job;
        drop(queued);
        let Some(out) = Outbox::new(events, deadline) else {
            self.counters.cancelled.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let max_tokens = request.max_tokens.min(self.context - prompt.len());
        let mut emit = Emitter::new(
            &self.limits,
            &self.tokenizer,
            &request,
            out,
            self.shape(&prompt, max_tokens),
        );
        if emit.check() {
            emit.end_cut(&self.counters);
            return None;
        }
        let sampler = match Sampler::new(request.sampling.clone()) {
            Ok(s) => s,
            Err(e) => {
                self.counters.failed.fetch_add(1, Ordering::Relaxed);
                emit.fail(ApiError::server(e.to_string()));
                return None;
            }
        };
        emit.started(prompt.len());
        self.counters.running.fetch_add(1, Ordering::Relaxed);
        let (caches, cached) = match self.cache_take(&prompt) {
            Some(h) => (h.caches, h.reused),
            None => (self.make_caches(), 0),
        };
        let mut session = Session::with_caches(self.model.as_ref(), &self.opts, caches);
        session.prefill_step = self.prefill_step;
        let row = Row {
            emit,
            dec: Decoder::new(&prompt, max_tokens, &self.tokenizer.eos_token_ids, sampler),
            prompt_tokens: prompt.len(),
            cached,
            next: 0,
            since: Instant::now(),
        };
        Some(Admission {
            row,
            session,
            prompt,
            fed: cached,
        })
    }

    /// One tick of prefill: admissions get their next chunks within the tick's budget (one
    /// prefill step of tokens); those whose prompts are in (but the last token) join the
    /// batch together.
    pub(super) fn prefill_tick<'w>(&'w self, lane: &mut Lane<'w>) {
        let budget = self.prefill_step;
        let mut spent = 0;
        let mut ready = Vec::new();
        for mut adm in std::mem::take(&mut lane.admissions) {
            // A long prompt's admission spans ticks: its client may leave or its time run out.
            if adm.row.emit.check() {
                self.close(adm.row, Outcome::Done(Finish::Stop));
                continue;
            }
            let n = adm.to_feed().min(adm.session.prefill_step);
            if n > 0 && spent > 0 && spent + n > budget {
                lane.admissions.push(adm);
                continue;
            }
            if n > 0 {
                let chunk = &adm.prompt[adm.fed..adm.fed + n];
                if let Err(e) = adm.session.prefill_chunk(chunk) {
                    let e = ApiError::server(format!("generation failed: {e}"));
                    self.close(adm.row, Outcome::Failed(e));
                    continue;
                }
                spent += n;
                adm.fed += n;
            }
            if adm.to_feed() > 0 {
                lane.admissions.push(adm);
            } else if adm.fed == 0 {
                ready.extend(self.first_alone(adm));
            } else {
                adm.row.next = adm.prompt[adm.fed];
                ready.push((adm.row, adm.session));
            }
        }
        self.join_rows(lane, ready);
    }

    /// A one-token prompt with nothing cached: its token stepped alone, its first id
    /// sampled and emitted. The row and session to join, unless it is over already.
    fn first_alone<'w>(&'w self, mut adm: Admission<'w>) -> Option<(Row<'w>, Session<'w>)> {
        let outcome = match adm.session.step(&adm.prompt) {
            Ok(logits) => self.advance(&mut adm.row, &logits),
            Err(e) => Outcome::Failed(ApiError::server(format!("generation failed: {e}"))),
        };
        match outcome {
            Outcome::Continue => Some((adm.row, adm.session)),
            done => {
                let finished = matches!(done, Outcome::Done(_)) && !adm.row.emit.gone;
                let produced = adm.row.emit.produced.clone();
                self.close(adm.row, done);
                if finished {
                    self.keep_caches(adm.session, &adm.prompt, produced);
                }
                None
            }
        }
    }

    /// Rows whose caches hold all they were fed but `next` join the batch (after its rows).
    fn join_rows<'w>(&'w self, lane: &mut Lane<'w>, ready: Vec<(Row<'w>, Session<'w>)>) {
        if ready.is_empty() {
            return;
        }
        let (rows, sessions): (Vec<Row<'w>>, Vec<Session<'w>>) = ready.into_iter().unzip();
        match lane.batch.join(sessions) {
            Ok(()) => {
                let now = Instant::now();
                lane.rows.extend(rows.into_iter().map(|mut r| {
                    r.since = now;
                    r
                }));
                self.counters
                    .batch_peak
                    .fetch_max(lane.rows.len(), Ordering::Relaxed);
            }
            Err(e) => {
                for row in rows {
                    self.close(row, Outcome::Failed(ApiError::server(e.to_string())));
                }
            }
        }
    }
}
