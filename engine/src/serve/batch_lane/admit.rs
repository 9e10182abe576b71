//! The batch lane's admissions: which waiting requests start, how much of their prompts is
//! prefilled per tick, and how they join the batch.
//!
//! Every waiting request there is a free slot for starts at once (mlx_lm.server's
//! BatchGenerator takes up to 8, its `--prompt-concurrency`, into one prompt batch; here
//! the bound is on prompt tokens instead). Each tick the requests in prefill get at most
//! one prefill step of prompt tokens in all (`--prefill-step-size`), in arrival order, each
//! prompt in its own chunks of up to that size (the chunks a request prefilled alone would
//! get, so every row's caches hold the same numbers as on the serial lane); the first
//! admission's chunk always runs, and a chunk that would overrun the budget waits for the
//! next tick. So the rows already decoding wait for at most one prefill step's worth of
//! prompt tokens between two of their steps, and short prompts — or prompts mostly in the
//! prompt cache — are admitted many per tick.
//!
//! Uncached prompts that fit one tick's budget together (rows × longest body; the shortest
//! first, so a long prompt does not keep the short ones apart) are
//! prefilled as one prompt batch instead (`prompt_batch`, `Batch::admit_prompts`: each row
//! bitwise its prefill alone, the `prompt_batch_rows` gate).
//!
//! Admissions whose caches hold all their prompts but the last token join the batch
//! together, as BatchGenerator admits a prompt batch (`Batch::admit`): one step of the
//! joining rows alone feeds their last prompt tokens, their first ids are sampled and sent
//! at once, and the rows are appended after the running ones; the next batched step feeds
//! those ids beside the running rows' queued samples. Into a running batch of standard K/V
//! rows such a row joins as it stands instead (`joins_running`): the next batched step feeds
//! its last prompt token beside the running rows' ids. A one-token prompt with nothing
//! cached has no caches to merge: its token is stepped alone and it joins as it stands.
//! A prompt-lookup row joins holding all its prompt but the last id, which its first round
//! feeds before its drafts (as the serial lane's first verify), and is never in a prompt
//! batch (a one-token prompt with nothing cached is stepped alone as above: the serial
//! lane's first verify of it has no drafts, and draws over the same one position).

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::mirror::LaneOp;
use super::{Lane, Outcome, Row};
use crate::generate::decode::Decoder;
use crate::generate::{Finish, Session};
use crate::serve::emit::{Emitter, Outbox};
use crate::serve::error::ApiError;
use crate::serve::request::GenRequest;
use crate::serve::worker::{Job, Worker};

/// The next row's key (`Row::key`).
static NEXT_KEY: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A request being admitted: its prompt is prefilled chunk by chunk.
pub(super) struct Admission<'w> {
    pub(super) row: Row<'w>,
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
    /// Starts admitting waiting requests while there are free slots.
    pub(super) fn start_admissions<'w>(&'w self, lane: &mut Lane<'w>) {
        while super::images::busy(lane) < lane.slots && lane.admissible() {
            let Some(job) = lane.waiting.pop_front() else {
                break;
            };
            if !job.request.images.is_empty() {
                self.start_image_row(lane, job);
                continue;
            }
            if lane.idle() {
                lane.group = job.adapter.as_ref().map(|u| u.name().to_owned());
            }
            if let Err(e) = self.use_named(lane.group.as_deref()) {
                self.counters.failed.fetch_add(1, Ordering::Release);
                let _ = job.events.try_send(crate::serve::emit::Event::Failed(e));
                continue;
            }
            if let Some(adm) = self.start(job) {
                lane.admissions.push(adm);
            }
        }
    }

    /// Starts admitting a request: its limits checked, prompt cache consulted, session made.
    fn start<'w>(&'w self, job: Job) -> Option<Admission<'w>> {
        let (row, request, prompt) = self.open_row(job)?;
        let (mut caches, cached) = match self.cache_take(&prompt) {
            Some(h) => (h.caches, h.reused),
            None => (self.make_caches(), 0),
        };
        let key = row.key;
        // A failed share has lost the group: the lane ends at its next tick.
        let _ = self.mirror(|| LaneOp::Open {
            key,
            prompt: prompt.clone(),
            cached,
        });
        // An entry's drafter layers (`--draft-model`) start the row's drafter row.
        let seed = caches.split_off(self.model_layers().min(caches.len()));
        let draft_seed = (row.draft.is_some() && !seed.is_empty()).then_some(seed);
        let opts = self.opts_for(row.adapter.as_ref());
        let mut session = Session::with_caches(self.model.as_ref(), &opts, caches);
        session.prefill_step = self.prefill_step;
        session.on_prefill = crate::serve::progress::prefill_hook(
            row.emit.weak_events(),
            prompt.len(),
            cached,
            request.return_progress,
        );
        Some(Admission {
            row: Row {
                cached,
                draft_seed,
                ..row
            },
            session,
            prompt,
            fed: cached,
        })
    }

    /// A request's row, once its limits are checked and its sampler made (it counts as
    /// running from here): the row, the request and its prompt ids.
    pub(super) fn open_row<'w>(&'w self, job: Job) -> Option<(Row<'w>, GenRequest, Vec<u32>)> {
        let Job {
            request,
            prompt_ids: prompt,
            events,
            deadline,
            queued,
            adapter,
            budget,
        } = job;
        drop(queued);
        let Some(out) = Outbox::new(events, deadline) else {
            self.counters.cancelled.fetch_add(1, Ordering::Release);
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
        let sampler = self.markers.sampler(&request, &self.tokenizer);
        let sampler = match sampler {
            Ok(s) => s,
            Err(e) => {
                let e = ApiError::generation(e);
                self.counters.count_error(&e);
                emit.fail(e);
                return None;
            }
        };
        emit.started(prompt.len());
        self.counters.running.fetch_add(1, Ordering::Relaxed);
        // A processor the API lets through beside lookup (a thinking budget) needs each
        // position's history, which a verify does not keep: that row decodes plainly.
        let lookup = self
            .lookup_for(&request)
            .filter(|_| !sampler.has_penalties());
        // With `--draft-model`, as the serial lane drafts (`Worker::drafting`); a request
        // with images is stepped by the vision model, without a drafter (as there).
        let draft = match request.images.is_empty() {
            true => self.drafting(&request, &sampler).map(|(_, gamma)| gamma),
            false => None,
        };
        let row = Row {
            emit,
            lookup,
            draft,
            key: NEXT_KEY.fetch_add(1, Ordering::Relaxed),
            draft_seed: None,
            dec: Decoder::new(&prompt, max_tokens, &self.tokenizer.eos_token_ids, sampler),
            prompt_tokens: prompt.len(),
            cached: 0,
            next: 0,
            since: Instant::now(),
            adapter,
            budget,
        };
        Some((row, request, prompt))
    }

    /// One tick of prefill: admissions get their next chunks within the tick's budget (one
    /// prefill step of tokens); those whose prompts are in (but the last token) join the
    /// batch together.
    pub(super) fn prefill_tick<'w>(&'w self, lane: &mut Lane<'w>) {
        let budget = self.prefill_step;
        let together = self.prompt_batch(lane, budget);
        let mut spent = together.len() * together.iter().map(|a| a.to_feed()).max().unwrap_or(0);
        let (mut ready, mut alone) = (Vec::new(), Vec::new());
        for mut adm in std::mem::take(&mut lane.admissions) {
            // A long prompt's admission spans ticks: its client may leave or its time run out.
            if adm.row.emit.check() {
                self.drop_admission(adm.row);
                continue;
            }
            let n = adm.to_feed().min(adm.session.prefill_step);
            if n > 0 && spent > 0 && spent + n > budget {
                lane.admissions.push(adm);
                continue;
            }
            if n > 0 {
                let chunk = &adm.prompt[adm.fed..adm.fed + n];
                let key = adm.row.key;
                let prefilled = self
                    .mirror(|| LaneOp::Chunk { key, n })
                    .and_then(|()| adm.session.prefill_chunk(chunk));
                if let Err(e) = prefilled {
                    self.lose_group(&e);
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
                alone.extend(self.first_alone(adm));
            } else if adm.row.lookup.is_some()
                // Planted: the lookup row's first id is sampled as it joins.
                && !crate::plant::is(crate::plant::Defect::BatchLookupFirstIdAtAdmission)
            {
                // A lookup row joins holding its prompt but the last id, which its first
                // round feeds before its drafts, as the serial lane's first verify does
                // (`LookupRound::start`): a sampled row then draws its first ids over the
                // same shape, so its seeded answer is the serial lane's.
                adm.row.next = adm.prompt[adm.fed];
                alone.push((adm.row, adm.session));
            } else if joins_running(lane, &adm, self.opts.kv_quant.is_some()) {
                // Its last prompt token is fed by the next batched step beside the running
                // rows: no forward of its own, and no wait for its first id.
                adm.row.next = match crate::plant::is(crate::plant::Defect::JoinedRowRefeeds) {
                    true => adm.prompt[adm.fed - 1],
                    false => adm.prompt[adm.fed],
                };
                alone.push((adm.row, adm.session));
            } else {
                ready.push(adm);
            }
        }
        self.join_rows(lane, alone);
        self.admit_rows(lane, ready);
        self.admit_together(lane, together);
    }

    /// Uncached prompts that arrived together and fit the tick's budget padded to the
    /// longest (rows × longest body ≤ one prefill step): at least two of them, taken out of
    /// the admissions in arrival order to be prefilled in one batched forward. None where
    /// the model's caches have no batched prefill or the lane quantizes its KV.
    fn prompt_batch<'w>(&self, lane: &mut Lane<'w>, budget: usize) -> Vec<Admission<'w>> {
        if !lane.prompt_batches || self.opts.kv_quant.is_some() {
            return Vec::new();
        }
        let bodies: Vec<Option<usize>> = lane
            .admissions
            .iter()
            .map(|a| {
                let body = a.to_feed();
                // Planted (as in `prefill_tick`): lookup rows prefill in prompt batches.
                let first_id_at_admission =
                    crate::plant::is(crate::plant::Defect::BatchLookupFirstIdAtAdmission);
                let batched = a.fed == 0 && (a.row.lookup.is_none() || first_id_at_admission);
                (batched && body > 0 && body <= a.session.prefill_step).then_some(body)
            })
            .collect();
        let picked = pick_prompt_batch(&bodies, budget);
        let mut out = Vec::with_capacity(picked.len());
        for (k, i) in picked.into_iter().enumerate() {
            out.push(lane.admissions.remove(i - k));
        }
        out
    }

    /// Prefills `together` as mlx_lm.server's BatchGenerator prefills a prompt batch
    /// (`Batch::admit_prompts`: the bodies right-padded into one forward per prefill step,
    /// then their last tokens in one step; each row's numbers are its single prefill's, the
    /// `batched_prefill` gate) and seats the rows with their first ids.
    fn admit_together<'w>(&'w self, lane: &mut Lane<'w>, together: Vec<Admission<'w>>) {
        let mut kept = Vec::with_capacity(together.len());
        for mut a in together {
            // As in the tick's loop: a client gone or out of time is ended, not prefilled.
            if a.row.emit.check() {
                self.drop_admission(a.row);
            } else {
                kept.push(a);
            }
        }
        let together = kept;
        if together.is_empty() {
            return;
        }
        let prompts: Vec<&[u32]> = together.iter().map(|a| &a.prompt[..]).collect();
        let keys = together.iter().map(|a| a.row.key).collect();
        let admitted = self
            .mirror(|| LaneOp::Together { keys })
            .and_then(|()| lane.batch.admit_prompts(&prompts, self.prefill_step));
        let logits = match admitted {
            Ok(l) => l,
            Err(e) => {
                self.lose_group(&e);
                let e = format!("generation failed: {e}");
                for a in together {
                    self.close(a.row, Outcome::Failed(ApiError::server(e.clone())));
                }
                return;
            }
        };
        self.queue_forward(&logits);
        self.counters
            .batch_prompt_batches
            .fetch_add(1, Ordering::Relaxed);
        let rows = together
            .into_iter()
            .map(|mut a| {
                if let Some(hook) = a.session.on_prefill.as_mut() {
                    hook(a.prompt.len() - 1);
                }
                a.row
            })
            .collect();
        self.seat(lane, rows, &logits);
    }

    /// Admissions whose prompts are in but the last token join (`Batch::admit`): their
    /// first ids sampled, sent, and fed by the next step; rows that end there leave.
    fn admit_rows<'w>(&'w self, lane: &mut Lane<'w>, ready: Vec<Admission<'w>>) {
        if ready.is_empty() {
            return;
        }
        let last: Vec<u32> = ready.iter().map(|a| a.prompt[a.fed]).collect();
        let (rows, sessions): (Vec<Row<'w>>, Vec<Session<'w>>) =
            ready.into_iter().map(|a| (a.row, a.session)).unzip();
        let keys = rows.iter().map(|r| r.key).collect();
        let admitted = self
            .mirror(|| LaneOp::Admit { keys })
            .and_then(|()| lane.batch.admit(sessions, &last));
        let logits = match admitted {
            Ok(l) => l,
            Err(e) => {
                self.lose_group(&e);
                let e = format!("generation failed: {e}");
                for row in rows {
                    self.close(row, Outcome::Failed(ApiError::server(e.clone())));
                }
                return;
            }
        };
        self.queue_forward(&logits);
        self.seat(lane, rows, &logits);
    }

    /// Rows just appended to the batch, with their first logits (row i of `logits`): their
    /// first ids sampled and sent; they join the running rows; rows that end there leave.
    fn seat<'w>(&'w self, lane: &mut Lane<'w>, mut rows: Vec<Row<'w>>, logits: &mlx_rs::Array) {
        let outcomes = self.first_ids(&mut rows, logits);
        let now = Instant::now();
        let mut all: Vec<Option<Outcome>> = lane.rows.iter().map(|_| None).collect();
        all.extend(outcomes);
        lane.rows.extend(rows.into_iter().map(|mut r| {
            r.since = now;
            r
        }));
        self.counters
            .batch_peak
            .fetch_max(lane.rows.len(), Ordering::Relaxed);
        // Only joined rows can end here: the queued samples still match the rows before.
        if !self.settle(&mut lane.rows, &mut lane.batch, all, None) {
            self.fresh_batch(lane);
            lane.inflight = None;
        }
    }

    /// Samples, evaluates and sends each joining row's first id from its logits (row i of
    /// `logits`); the outcome of each row.
    fn first_ids(&self, rows: &mut [Row<'_>], logits: &mlx_rs::Array) -> Vec<Option<Outcome>> {
        use mlx_rs::ops::indexing::IndexOp;
        let picked: Vec<Result<(mlx_rs::Array, mlx_rs::Array), ApiError>> = rows
            .iter_mut()
            .enumerate()
            .map(|(i, row)| {
                logits
                    .index(i as i32)
                    .reshape(&[1, -1])
                    .map_err(|e| ApiError::server(e.to_string()))
                    .and_then(|l| Self::sample(row, &l))
            })
            .collect();
        let ys: Vec<&mlx_rs::Array> = picked.iter().flatten().map(|(y, _)| y).collect();
        if let Err(e) = mlx_rs::transforms::eval(ys) {
            self.lose_group(&e);
            let msg = format!("generation failed: {e}");
            return rows
                .iter()
                .map(|_| Some(Outcome::Failed(ApiError::server(msg.clone()))))
                .collect();
        }
        rows.iter_mut()
            .zip(picked)
            .map(|(row, p)| match p {
                Err(e) => Some(Outcome::Failed(e)),
                Ok((y, lp)) => match Self::emit_next(row, y.as_slice::<u32>()[0], &lp) {
                    Outcome::Continue if !row.emit.gone => None,
                    Outcome::Continue => Some(Outcome::Done(Finish::Stop)),
                    other => Some(other),
                },
            })
            .collect()
    }

    /// A one-token prompt with nothing cached: its token stepped alone, its first id
    /// sampled and emitted. The row and session to join, unless it is over already.
    fn first_alone<'w>(&'w self, mut adm: Admission<'w>) -> Option<(Row<'w>, Session<'w>)> {
        let key = adm.row.key;
        let stepped = self
            .mirror(|| LaneOp::Alone { key })
            .and_then(|()| adm.session.step(&adm.prompt));
        let outcome = match stepped {
            Ok(logits) => {
                self.queue_forward(&logits);
                self.advance(&mut adm.row, &logits)
            }
            Err(e) => {
                self.lose_group(&e);
                Outcome::Failed(ApiError::server(format!("generation failed: {e}")))
            }
        };
        match outcome {
            Outcome::Continue => Some((adm.row, adm.session)),
            done => {
                let finished = matches!(done, Outcome::Done(_)) && !adm.row.emit.gone;
                let produced = adm.row.emit.produced.clone();
                let keep = finished.then(|| produced.clone());
                let _ = self.mirror(|| LaneOp::Close { key, keep });
                self.close(adm.row, done);
                if finished {
                    self.keep_caches(adm.session, &adm.prompt, produced);
                }
                None
            }
        }
    }

    /// An admission whose client left or ran out of time before it joined: ended.
    fn drop_admission(&self, row: Row<'_>) {
        let (key, keep) = (row.key, None);
        let _ = self.mirror(|| LaneOp::Close { key, keep });
        self.close(row, Outcome::Done(Finish::Stop));
    }

    /// Rows whose caches hold all they were fed but `next` join the batch as they stand.
    fn join_rows<'w>(&'w self, lane: &mut Lane<'w>, ready: Vec<(Row<'w>, Session<'w>)>) {
        if ready.is_empty() {
            return;
        }
        let (rows, sessions): (Vec<Row<'w>>, Vec<Session<'w>>) = ready.into_iter().unzip();
        let keys = rows.iter().map(|r| r.key).collect();
        let _ = self.mirror(|| LaneOp::Join { keys });
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

/// Whether admission `adm` (its prompt in but the last token) joins the running batch as
/// it stands instead of stepping its last token in a batch of its own (`Batch::admit`):
/// where rows are running and every cache is standard K/V, unquantized, whose rows give the
/// same numbers either way (a ring or a recurrent state is laid out as BatchGenerator lays
/// it out only by `admit`; quantized batches are gated on `admit` only). The admit step is a forward of its own, and its first ids are
/// read back before the next batched step can be queued: with rows coming and going, a few
/// per cent of the lane's throughput (docs/serve.md). Rows that draft keep `admit` (their
/// drafter rows start from it).
fn joins_running(lane: &Lane<'_>, adm: &Admission<'_>, quantized: bool) -> bool {
    lane.row_trims && !quantized && !lane.rows.is_empty() && adm.row.draft.is_none() && adm.fed > 0
}

/// Which of the candidate bodies (None: not a candidate) form the prompt batch, as indices
/// in arrival order: the most rows whose count × longest body fits `budget` — the shortest
/// first, so one long prompt does not keep the short ones from batching — and none unless
/// at least two fit.
fn pick_prompt_batch(bodies: &[Option<usize>], budget: usize) -> Vec<usize> {
    let mut by_length: Vec<(usize, usize)> = bodies
        .iter()
        .enumerate()
        .filter_map(|(i, b)| Some((i, (*b)?)))
        .collect();
    by_length.sort_by_key(|&(_, body)| body);
    let fits = by_length
        .iter()
        .enumerate()
        .take_while(|&(k, &(_, body))| (k + 1) * body <= budget)
        .count();
    if fits < 2 {
        return Vec::new();
    }
    let mut picked: Vec<usize> = by_length[..fits].iter().map(|&(i, _)| i).collect();
    picked.sort_unstable();
    picked
}

#[cfg(test)]
mod tests {
    use super::pick_prompt_batch;

    /// A long prompt first in line does not keep three short ones from one batch; it is
    /// left for its own prefill.
    #[test]
    fn a_long_prompt_first_leaves_the_short_ones_their_batch() {
        let bodies = [Some(2600), Some(10), None, Some(12), Some(9)];
        assert_eq!(pick_prompt_batch(&bodies, 4096), vec![1, 3, 4]);
    }

    /// As many rows as fit: the padded size is rows × the longest taken.
    #[test]
    fn the_batch_takes_as_many_rows_as_fit_padded() {
        let bodies = [Some(100), Some(300), Some(200), Some(150)];
        // 3 × 200 = 600 fits 700; 4 × 300 = 1200 does not.
        assert_eq!(pick_prompt_batch(&bodies, 700), vec![0, 2, 3]);
        // One row is no batch.
        assert_eq!(pick_prompt_batch(&bodies, 150), Vec::<usize>::new());
        assert_eq!(
            pick_prompt_batch(&[None, Some(5)], 4096),
            Vec::<usize>::new()
        );
    }
}
