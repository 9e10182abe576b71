//! The batch lane (`engine serve --batch N`): up to N requests decode together, one forward
//! of [rows, 1] ids per step (`generate::batch`). Each scheduler tick starts every waiting
//! request there is a free slot for and gives the prompts in prefill at most one prefill
//! step's worth of tokens in all (`--prefill-step-size`; a long prompt goes on over several
//! ticks: `admit`), so the rows already running get a decode step between any two chunks.
//! Prompts whose tokens but the last are in their caches join the batch together as
//! BatchGenerator admits them (`Batch::admit`: their last tokens in one step of their own,
//! first ids sent at once). Rows that finish (EOS, max tokens, a
//! stop string, an error, a client gone) leave the batch at once, alone. Models the batch
//! does not take (`generate::batch::refusal`) are served by the serial lane instead. Under
//! a tensor-parallel group rank 0 runs the lane and the other ranks mirror its changes to
//! the caches (`mirror`); time slices and parking are in `slots`.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use super::emit::Emitter;
use super::error::ApiError;
use super::worker::{Job, Work, Worker};

mod admit;
mod contain;
mod draft;
mod images;
mod lookup;
mod mirror;
mod samples;
mod slots;
use crate::cache::Cache;
use crate::generate::batch::Batch;
use crate::generate::decode::Decoder;
use crate::generate::Finish;
pub(super) use mirror::Mirror;
use samples::Samples;

struct Row<'w> {
    emit: Emitter<'w>,
    /// The row's sampler, history (prompt and generated ids), limit and EOS ids: the
    /// decode core every path shares; this lane steps all rows in one forward and hands
    /// each its logits.
    dec: Decoder<'w>,
    prompt_tokens: usize,
    cached: usize,
    /// The id to feed at the next step.
    next: u32,
    /// When the row last took its slot (joined or rejoined the batch).
    since: Instant,
    /// The request's adapter: the lane's group's (`Lane::group`).
    adapter: Option<super::adapters::Use>,
    /// The request's prompt lookup (`lookup`: the lane's steps are lookup rounds then).
    lookup: Option<crate::generate::lookup::LookupParams>,
    /// Its γ when it drafts with `--draft-model` (the lane's drafter batch, `lookup`).
    draft: Option<usize>,
    /// The row's key in the drafter batch (unique in the lane's life).
    key: u64,
    /// Drafter caches to start its drafter row from (its cache entry's), or to keep with
    /// its entry when it ends (its drafter row's).
    draft_seed: Option<Vec<Box<dyn Cache>>>,
    /// Its `--memory-budget` reservation, released when the row is dropped.
    #[allow(dead_code)]
    budget: Option<crate::serve::budget::Reservation>,
}

/// Under contention (every slot busy, requests waiting), how long a row keeps its slot
/// before it yields it (parked) to the next waiting request.
const SLICE: Duration = Duration::from_millis(500);

enum Outcome {
    Continue,
    Done(Finish),
    Failed(ApiError),
}

/// The batch lane's state between ticks.
struct Lane<'w> {
    slots: usize,
    waiting: VecDeque<Job>,
    batch: Batch<'w>,
    rows: Vec<Row<'w>>,
    /// Samples of the last step, not yet emitted: one per row of that step, which are the
    /// first rows of `rows` (rows that joined since come after them).
    inflight: Option<Samples>,
    /// Whether the model's prompts can be prefilled together (`batch::takes_prompt_batches`).
    prompt_batches: bool,
    /// Whether its batch caches give positions back row by row (`batch::trims_rows`): rows
    /// that ask for prompt lookup, or draft with `--draft-model`, speculate (`lookup`).
    row_trims: bool,
    /// The draft model's rows (`--draft-model`: `generate::batch_draft`), one per row
    /// that drafts.
    drafter: Option<crate::generate::batch_draft::DraftBatch<'w>>,
    /// Requests whose prompts are being prefilled, in arrival order.
    admissions: Vec<admit::Admission<'w>>,
    /// Rows out of the batch, with their caches, while their clients catch up.
    parked: Vec<(Row<'w>, Vec<Box<dyn Cache>>)>,
    /// Requests with images: rows stepped by the vision model (`images`).
    images: Vec<(Row<'w>, crate::serve::worker::ImageSteps<'w>)>,
    steps: usize,
    /// The adapter every row, admission and parked row of the lane runs under (None: the
    /// base model): rows of one adapter decode together; a request of another waits until
    /// they are done, then the oldest waiting request's adapter runs.
    group: Option<String>,
}

impl Lane<'_> {
    /// No row running, being admitted or parked: the next request may switch the group.
    fn idle(&self) -> bool {
        self.rows.is_empty() && self.admissions.is_empty() && self.parked.is_empty()
    }

    /// Whether the oldest waiting request may start now: it runs under the group's adapter
    /// (or the lane is idle).
    fn admissible(&self) -> bool {
        self.waiting.front().is_some_and(|job| {
            self.idle()
                || crate::plant::is(crate::plant::Defect::AdapterBatchMixed)
                || job.adapter.as_ref().map(|u| u.name()) == self.group.as_deref()
        })
    }
}

impl Worker {
    /// Why this worker cannot take the batch lane (what it holds that the lane lacks), or
    /// None when it can.
    pub fn not_batchable(&self) -> Option<&'static str> {
        use crate::generate::batch::trims_rows;
        use crate::generate::drafter::Drafter;
        match &self.draft {
            Some((Drafter::Assistant(_), _)) => {
                return Some("speculative decoding with an assistant drafter (--draft-model)")
            }
            Some((Drafter::Model(m), _))
                if !trims_rows(self.model.as_ref()) || !trims_rows(m.as_ref()) =>
            {
                return Some(
                    "speculative decoding (--draft-model) where the model's or the drafter's \
                     caches cannot give positions back row by row (sliding-window or \
                     recurrent layers)",
                )
            }
            Some((Drafter::Model(_), _)) if self.opts.kv_quant.is_some() => {
                return Some("speculative decoding (--draft-model) with quantized KV")
            }
            _ => {}
        }
        crate::generate::batch::refusal(self.model.as_ref(), &self.opts)
    }

    /// Samples `row`'s next id from its logits [1, vocab], lazily: (id [1], log-probs).
    fn sample(row: &mut Row<'_>, logits: &Array) -> Result<(Array, Array), ApiError> {
        row.dec.pick(logits).map_err(ApiError::from)
    }

    /// Emits `row`'s next id (`logprobs`: what it was sampled from) and says whether the
    /// row goes on.
    fn emit_next(row: &mut Row<'_>, id: u32, logprobs: &Array) -> Outcome {
        row.next = id;
        let emit = &mut row.emit;
        match row
            .dec
            .emit(id, logprobs, false, &mut |id, lp, _| emit.token(id, lp))
        {
            Err(e) => Outcome::Failed(e),
            Ok(None) => Outcome::Continue,
            Ok(Some(finish)) => Outcome::Done(finish),
        }
    }

    /// Samples and emits the next id of one row (admission: right after its prefill).
    fn advance(&self, row: &mut Row<'_>, logits: &Array) -> Outcome {
        match Self::sample(row, logits).and_then(|(y, lp)| {
            y.eval().map_err(ApiError::from)?;
            Ok((y, lp))
        }) {
            Ok((y, lp)) => Self::emit_next(row, y.as_slice::<u32>()[0], &lp),
            Err(e) => Outcome::Failed(e),
        }
    }

    /// Ends a row: Done (or the error) to its client, counters updated.
    fn close(&self, mut row: Row<'_>, outcome: Outcome) {
        match outcome {
            Outcome::Continue => {}
            Outcome::Done(_) if row.emit.gone => row.emit.end_cut(&self.counters),
            Outcome::Done(finish) => {
                match row.emit.finish(finish, row.prompt_tokens, row.cached, |n| {
                    self.count_done(row.prompt_tokens, n)
                }) {
                    Ok(()) => {}
                    Err(e) => {
                        self.counters.failed.fetch_add(1, Ordering::Release);
                        row.emit.fail(e);
                    }
                }
            }
            Outcome::Failed(e) => {
                self.counters.count_error(&e);
                row.emit.fail(e);
            }
        }
        // Last, so that `running` 0 in /stats means every outcome is counted.
        self.counters.running.fetch_sub(1, Ordering::Relaxed);
    }

    /// Removes the rows whose outcome is given (closing them) from `rows` and `batch`;
    /// `samples`, if given, keeps the kept rows' entries. Returns false if the batch broke
    /// (then every row has been failed and the lane is empty).
    fn settle<'w>(
        &self,
        rows: &mut Vec<Row<'w>>,
        batch: &mut Batch<'_>,
        mut outcomes: Vec<Option<Outcome>>,
        samples: Option<&mut Samples>,
    ) -> bool {
        if outcomes.iter().all(Option::is_none) {
            return true;
        }
        let keep: Vec<usize> = (0..rows.len()).filter(|&i| outcomes[i].is_none()).collect();
        // Rows that finished well leave their caches to the prompt cache (and SSD tier).
        let ended: Vec<usize> = (0..rows.len())
            .filter(|&i| matches!(outcomes[i], Some(Outcome::Done(_))) && !rows[i].emit.gone)
            .collect();
        // A failed share has lost the group: the lane ends at its next tick.
        let _ = self.mirror(|| mirror::LaneOp::Settle {
            keep: keep.clone(),
            ended: ended
                .iter()
                .map(|&i| (i, rows[i].dec.history().to_vec()))
                .collect(),
        });
        let mut kept = Vec::new();
        for i in ended {
            let row = &mut rows[i];
            if let Some((tokens, caches)) = mirror::ended_entry(batch, i, row.dec.history()) {
                kept.push((tokens, caches, row.draft_seed.take()));
            }
        }
        let mut broke = batch.keep(&keep).err();
        if let (None, Some(samples)) = (&broke, samples) {
            let old = std::mem::replace(samples, Samples::PerRow(Vec::new()));
            match old.keep(&keep) {
                Ok(kept) => *samples = kept,
                Err(e) => broke = Some(e),
            }
        }
        match &broke {
            Some(e) => {
                for row in rows.drain(..) {
                    self.close(row, Outcome::Failed(ApiError::server(e.to_string())));
                }
            }
            None => {
                let old = std::mem::take(rows);
                for (row, outcome) in old.into_iter().zip(outcomes.iter_mut()) {
                    match outcome.take() {
                        None => rows.push(row),
                        Some(o) => self.close(row, o),
                    }
                }
            }
        }
        // Kept even when the batch broke: the caches are copies taken before, and a
        // follower's mirror keeps them alike (`Mirror::settle`).
        for (tokens, caches, draft_seed) in kept {
            self.keep_whole(tokens, caches, draft_seed);
        }
        broke.is_none()
    }

    /// Evaluates `samples` (one per row) and emits them; the outcome of each row.
    fn emit_all(&self, rows: &mut [Row<'_>], samples: &Samples) -> Vec<Option<Outcome>> {
        let ids = match samples.host_ids() {
            Ok(ids) => ids,
            // Under a group the rows fail as the lane ends, at its next tick (`lane_lost`).
            Err(e) if self.lose_group(&e) => return rows.iter().map(|_| None).collect(),
            Err(e) => {
                let msg = format!("generation failed: {e}");
                return rows
                    .iter()
                    .map(|_| Some(Outcome::Failed(ApiError::server(msg.clone()))))
                    .collect();
            }
        };
        rows.iter_mut()
            .zip(ids)
            .enumerate()
            .map(
                |(i, (row, id))| match Self::emit_next(row, id, &samples.logprobs(i)) {
                    Outcome::Continue if !row.emit.gone => None,
                    Outcome::Continue => Some(Outcome::Done(Finish::Stop)),
                    other => Some(other),
                },
            )
            .collect()
    }

    /// Serves jobs with up to `slots` rows decoding together, until every sender is gone.
    ///
    /// Pipelined as generate_step is: a step's forward for every row is queued (async eval)
    /// before the ids it feeds are read back and emitted, so host work overlaps the model.
    /// Rows that join feed their first ids to the next step beside the queued samples;
    /// whenever a row's logits processors need its history, the queued samples are
    /// emitted first.
    pub fn run_batched(&self, jobs: mpsc::Receiver<Work>, slots: usize) {
        let mut lane = Lane {
            slots,
            waiting: VecDeque::new(),
            batch: Batch::for_lane(self.model.as_ref()),
            rows: Vec::new(),
            inflight: None,
            prompt_batches: crate::generate::batch::takes_prompt_batches(self.model.as_ref()),
            row_trims: crate::generate::batch::trims_rows(self.model.as_ref()),
            drafter: self.drafter_batch(),
            admissions: Vec::new(),
            parked: Vec::new(),
            images: Vec::new(),
            steps: 0,
            group: None,
        };
        // Under a group: the step watchdog and the peer watch, as on the serial lane.
        crate::dist::arm("the first round plan");
        loop {
            // Another model's thread may have a step to run (`turn`).
            super::turn::pass();
            if let Some(why) = self.dist.as_ref().and_then(|l| l.lost()) {
                self.lane_lost(lane, &jobs, &why);
            }
            if !self.receive(&mut lane, &jobs) {
                return;
            }
            // One embeddings input per tick, between decode steps.
            self.embed_tick();
            // The rows' MLX work from here on runs under their group's adapter.
            if let Err(e) = self.use_named(lane.group.as_deref()) {
                for row in lane.rows.drain(..) {
                    self.close(row, Outcome::Failed(e.clone()));
                }
                self.fresh_batch(&mut lane);
                lane.inflight = None;
            }
            let stepping = !lane.images.is_empty();
            if lane.rows.is_empty() && lane.admissions.is_empty() && !stepping && !lane.admissible()
            {
                // Waiting for parked rows of the group to catch up or be cut.
                std::thread::sleep(Duration::from_millis(5));
            }
            // Parked rows are cut as any other (stalled, gone, out of time).
            for (mut row, caches) in std::mem::take(&mut lane.parked) {
                if row.emit.check() {
                    let (key, keep) = (row.key, None);
                    let _ = self.mirror(|| mirror::LaneOp::Close { key, keep });
                    self.close(row, Outcome::Done(Finish::Stop));
                } else {
                    lane.parked.push((row, caches));
                }
            }
            self.share_slots(&mut lane);
            self.start_admissions(&mut lane);
            let needs_history = lane
                .rows
                .iter_mut()
                .any(|r| r.dec.sampler().has_processors());
            if needs_history {
                self.flush(&mut lane);
            }
            // At most one prefill step of prompt tokens per tick, between decode steps.
            self.prefill_tick(&mut lane);
            self.image_tick(&mut lane);
            if !lane.rows.is_empty() {
                self.decode_step(&mut lane);
            } else {
                lane.inflight = None;
            }
            // Followers wait on the next plan: one at least every HEARTBEAT (none once the
            // group is lost: no collective runs after a failed one).
            if let Some(lead) = self.dist.as_ref().filter(|l| l.lost().is_none()) {
                if let Err(e) = lead.heartbeat() {
                    lead.lose(&e);
                }
            }
        }
    }

    /// Takes new jobs (waiting for one when the lane is idle). False once every sender is
    /// gone and nothing is left to do.
    fn receive<'w>(&'w self, lane: &mut Lane<'w>, jobs: &mpsc::Receiver<Work>) -> bool {
        let idle = lane.rows.is_empty() && lane.admissions.is_empty() && lane.images.is_empty();
        if idle && lane.waiting.is_empty() {
            if lane.parked.is_empty() {
                match self.next_job(jobs) {
                    Some(job) => lane.waiting.push_back(job),
                    None => return false,
                }
            } else if let Ok(job) = self.job_within(jobs, Duration::from_millis(5)) {
                lane.waiting.push_back(job);
            }
        }
        while let Some(job) = self.try_job(jobs) {
            lane.waiting.push_back(job);
        }
        // A gate's set-up: the idle lane starts on four arrivals at once.
        if idle && crate::plant::is(crate::plant::Defect::BatchGathersFour) {
            let more = self.gather_four(jobs, lane.waiting.len());
            lane.waiting.extend(more);
        }
        true
    }

    /// Emits the queued samples of the last step (if any) and settles the rows they end.
    fn flush<'w>(&'w self, lane: &mut Lane<'w>) {
        if let Some(pending) = lane.inflight.take() {
            let mut outcomes = self.emit_all(&mut lane.rows, &pending);
            // Rows that joined after that step have nothing to emit.
            outcomes.resize_with(lane.rows.len(), || None);
            if !self.settle(&mut lane.rows, &mut lane.batch, outcomes, None) {
                self.fresh_batch(lane);
            }
        }
    }

    /// The ids of the next step, [rows]: the queued samples (still lazy) of the rows of
    /// the last step, then the ids on the host (`next`) of the rows after them — every row
    /// after a flush, the rows that have joined since that step otherwise.
    fn feed(lane: &Lane<'_>) -> Result<Array, mlx_rs::error::Exception> {
        let queued = lane.inflight.as_ref().map_or(0, Samples::len);
        let ids: Vec<u32> = lane.rows[queued..].iter().map(|r| r.next).collect();
        let host = Array::from_slice(&ids, &[ids.len() as i32]);
        let Some(pending) = lane.inflight.as_ref().filter(|p| p.len() > 0) else {
            return Ok(host);
        };
        let pending = pending.ids()?;
        if ids.is_empty() {
            return Ok(pending);
        }
        mlx_rs::ops::concatenate(&[&pending, &host], 0)
    }

    /// `feed`, shared: under a group the ids are read back (the followers feed them too)
    /// and the step shared before it runs.
    fn feed_shared(&self, lane: &Lane<'_>) -> Result<Array, mlx_rs::error::Exception> {
        let fed = Self::feed(lane)?;
        if self.dist.is_some() {
            fed.eval()?;
            let ids = fed.as_slice::<u32>().to_vec();
            self.mirror(|| mirror::LaneOp::Step { ids })?;
        }
        Ok(fed)
    }

    /// Every row's next id from the step's logits [rows, vocab], lazily: all at once when
    /// every row samples plain greedy (`Samples::Whole`), else each with its own sampler
    /// (a row whose sampling fails gets its outcome; the others are unaffected).
    fn sample_rows(
        rows: &mut [Row<'_>],
        logits: &Array,
    ) -> Result<(Samples, Vec<Option<Outcome>>), mlx_rs::error::Exception> {
        if rows.len() > 1 && rows.iter_mut().all(|r| r.dec.plain_greedy()) {
            let (ids, logprobs) = crate::generate::decode::greedy_rows(logits)?;
            let samples = Samples::Whole {
                ids,
                logprobs,
                rows: rows.len(),
            };
            return Ok((samples, rows.iter().map(|_| None).collect()));
        }
        let mut next: Vec<(Array, Array)> = Vec::with_capacity(rows.len());
        let mut outcomes: Vec<Option<Outcome>> = Vec::with_capacity(rows.len());
        let lone = rows.len() == 1 && logits.shape()[0] == 1;
        for (i, row) in rows.iter_mut().enumerate() {
            let sampled = if lone {
                // Already [1, vocab]: no view ops for a lone row.
                Ok(logits.clone())
            } else {
                logits
                    .index(i as i32)
                    .reshape(&[1, -1])
                    .map_err(|e| ApiError::server(e.to_string()))
            }
            .and_then(|l| Self::sample(row, &l));
            match sampled {
                Ok(pair) => {
                    next.push(pair);
                    outcomes.push(None);
                }
                Err(e) => {
                    next.push((Array::from_slice(&[0u32], &[1]), Array::from_f32(0.0)));
                    outcomes.push(Some(Outcome::Failed(e)));
                }
            }
        }
        Ok((Samples::PerRow(next), outcomes))
    }

    /// One batched decode step: the queued samples (still lazy) or, after a flush, the
    /// emitted ids are fed; every row's next id is sampled and queued; while that runs,
    /// what was fed is emitted, and rows that finished leave.
    fn decode_step<'w>(&'w self, lane: &mut Lane<'w>) {
        if self.lookup_round(lane) {
            return;
        }
        // Its flush may have ended every row.
        if lane.rows.is_empty() {
            lane.inflight = None;
            return;
        }
        // A lone lookup row stays in batch form between its rounds (they verify there).
        let lone = lane.rows.len() == 1 && !Self::lookup_due(lane);
        if let (true, [row]) = (lone, &lane.rows[..]) {
            // One row left of several: it goes on alone (`Batch::for_lane`).
            if !lane.batch.is_solo() {
                let _ = self.mirror(|| mirror::LaneOp::GoSolo);
            }
            if let Err(e) = lane.batch.go_solo(&self.opts_for(row.adapter.as_ref())) {
                eprintln!("engine serve: the lone row stays in the batch: {e}");
            }
        }
        if lane.batch.is_solo() {
            self.counters
                .batch_lone_steps
                .fetch_add(1, Ordering::Relaxed);
        }
        let logits = match self.feed_shared(lane).and_then(|f| lane.batch.step_ids(&f)) {
            Ok(l) => l,
            Err(e) => {
                // A failed forward is not pinned on every row: each is retried alone.
                self.contain(lane, &e);
                return;
            }
        };
        self.queue_forward(&logits);
        let (mut next, mut outcomes) = match Self::sample_rows(&mut lane.rows, &logits) {
            Ok(sampled) => sampled,
            Err(e) => {
                self.contain(lane, &e);
                return;
            }
        };
        next.queue();
        // While that step runs: emit what was fed to it.
        if let Some(pending) = lane.inflight.take() {
            for (o, emitted) in outcomes
                .iter_mut()
                .zip(self.emit_all(&mut lane.rows, &pending))
            {
                if o.is_none() {
                    *o = emitted;
                }
            }
        }
        if !self.settle(&mut lane.rows, &mut lane.batch, outcomes, Some(&mut next)) {
            self.fresh_batch(lane);
            return;
        }
        lane.inflight = (!lane.rows.is_empty()).then_some(next);
        lane.steps += 1;
        if lane.steps.is_multiple_of(256) {
            let _ = mlx_rs::memory::clear_cache();
        }
    }
}
