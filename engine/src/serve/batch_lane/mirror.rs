//! The batch lane under a distributed group (mlx.launch): rank 0 runs the lane and decides
//! everything that rests on facts only it sees (arrivals, free slots, clients behind or
//! gone, stop strings, time slices, sampling); every other rank mirrors the lane's model
//! work op by op, so each forward — and every collective in it — has the same shape on
//! every rank, as mlx_lm.server's ranks each run one BatchGenerator on shared requests.
//!
//! Rank 0 records a [`LaneOp`] for each change to the lane's caches, in order, and shares
//! them in its round plans (`dist_plan`): an op that runs a forward is shared before rank 0
//! runs it (with the ops noted since the last plan); the others wait for the next plan.
//! The ids a step feeds go with it, on the host: a follower samples nothing, so sampling
//! (seeds, grammars, penalties) stays rank 0's alone. A follower's [`Mirror`] holds the
//! batch, the admissions in prefill and the parked rows, keyed by rank 0's row keys, and
//! applies each op with the same calls rank 0 made; each forward is evaluated on the spot,
//! in plan order (rank 0 queues its own before its next plan), so the collectives meet.
//! Prompt-store takes and keeps happen at the same points of the op order on every rank,
//! so every rank's store holds the same entries.

use std::collections::HashMap;

use mlx_rs::error::Exception;
use mlx_rs::Array;

use crate::cache::Cache;
use crate::generate::batch::Batch;
use crate::generate::Session;
pub(super) use crate::serve::dist_plan::LaneOp;
use crate::serve::error::ApiError;
use crate::serve::worker::Worker;

/// A prompt-store entry: the tokens its caches hold, and the caches.
pub(super) type Entry = (Vec<u32>, Vec<Box<dyn Cache>>);

/// Row `row`'s caches to keep as it ends with `history` fed (the last id maybe not):
/// the tokens they hold and the caches (`Worker::settle`; the same on every rank).
pub(super) fn ended_entry(batch: &mut Batch<'_>, row: usize, history: &[u32]) -> Option<Entry> {
    let caches = batch.row_caches(row, history.len() as i32).ok()?;
    let fed = caches.first().map_or(0, |c| c.offset()) as usize;
    Some((history[..fed.min(history.len())].to_vec(), caches))
}

/// The ids of one decode step as every rank feeds them: [rows], u32 (rank 0's host ids).
pub(super) fn step_ids(ids: &[u32]) -> Array {
    Array::from_slice(ids, &[ids.len() as i32])
}

impl Worker {
    /// Under a group, records `op` (built only there): shared now, with the ops noted before
    /// it, when it runs a forward (before rank 0 runs it), else with the next plan. A
    /// failed share loses the group (the caller fails what it was doing).
    pub(super) fn mirror(&self, op: impl FnOnce() -> LaneOp) -> Result<(), Exception> {
        let Some(lead) = &self.dist else {
            return Ok(());
        };
        // No collective runs after a failed one: the lane ends at its next tick, and what
        // was about to run fails here.
        if let Some(why) = lead.lost() {
            return Err(Exception::custom(crate::serve::dist_plan::lost_message(
                &why,
            )));
        }
        let op = op();
        if !op.runs_forward() {
            lead.defer(crate::serve::dist_plan::Op::Lane(op));
            return Ok(());
        }
        lead.send(Some(crate::serve::dist_plan::Op::Lane(op)))
            .inspect_err(|e| {
                lead.lose(e);
            })
    }

    /// The lane's batch starts afresh (after a failure), on every rank.
    pub(super) fn fresh_batch<'w>(&'w self, lane: &mut super::Lane<'w>) {
        // A failed share has lost the group: the lane ends at its next tick.
        let _ = self.mirror(|| LaneOp::Reset);
        lane.batch = Batch::for_lane(self.model.as_ref());
    }

    /// Under a group, queues the evaluation of a forward's `logits` now, so that its
    /// collectives run before the next plan's even where no sample of it is evaluated
    /// (every row's sampling failed).
    pub(super) fn queue_forward(&self, logits: &Array) {
        if self.dist.is_some() {
            let _ = mlx_rs::transforms::async_eval([logits]);
        }
    }

    /// Under a group, a failed forward loses the group: the lane ends every request at its
    /// next tick and the process exits (`lane_lost`). True under a group.
    pub(super) fn lose_group(&self, e: &dyn std::fmt::Display) -> bool {
        match &self.dist {
            Some(lead) => {
                lead.lose(e);
                true
            }
            None => false,
        }
    }
}

impl Worker {
    /// Under a group whose collective failed (or whose forward did): every request of the
    /// lane fails — running, in prefill, parked, waiting — and the process exits
    /// (`Worker::end_lost`). No MLX work runs from here (a collective would hang).
    pub(super) fn lane_lost(
        &self,
        lane: super::Lane<'_>,
        jobs: &std::sync::mpsc::Receiver<crate::serve::worker::Work>,
        why: &str,
    ) -> ! {
        // This rank ends in order from here: the peer watch leaves the exit to it.
        crate::dist::done();
        let error = || ApiError::server(crate::serve::dist_plan::lost_message(why));
        let super::Lane {
            rows,
            admissions,
            parked,
            images,
            waiting,
            ..
        } = lane;
        let rows = rows
            .into_iter()
            .chain(admissions.into_iter().map(|a| a.row))
            .chain(parked.into_iter().map(|(r, _)| r))
            .chain(images.into_iter().map(|(r, _)| r));
        for row in rows {
            self.close(row, super::Outcome::Failed(error()));
        }
        self.end_lost(waiting, jobs, why)
    }
}

/// A request a follower holds outside the batch: in prefill, or parked.
struct Held<'w> {
    session: Session<'w>,
    prompt: Vec<u32>,
    /// Prompt tokens in the session's caches.
    fed: usize,
}

/// A follower's copy of rank 0's batch lane (module header).
pub struct Mirror<'w> {
    worker: &'w Worker,
    batch: Batch<'w>,
    held: HashMap<u64, Held<'w>>,
}

impl<'w> Mirror<'w> {
    pub fn new(worker: &'w Worker) -> Self {
        Mirror {
            worker,
            batch: Batch::for_lane(worker.model.as_ref()),
            held: HashMap::new(),
        }
    }

    fn take(&mut self, key: u64) -> Result<Held<'w>, Exception> {
        self.held.remove(&key).ok_or_else(|| missing(key))
    }

    fn takes(&mut self, keys: &[u64]) -> Result<Vec<Held<'w>>, Exception> {
        keys.iter().map(|&k| self.take(k)).collect()
    }

    /// Holds `caches` under `key` as a session, with its prompt and the prompt tokens fed.
    fn hold(&mut self, key: u64, caches: Vec<Box<dyn Cache>>, prompt: Vec<u32>, fed: usize) {
        let w = self.worker;
        let mut session = Session::with_caches(w.model.as_ref(), &w.opts, caches);
        session.prefill_step = w.prefill_step;
        let held = Held {
            session,
            prompt,
            fed,
        };
        self.held.insert(key, held);
    }

    /// Applies one of rank 0's ops. An error is a forward (or a store) that did not go as
    /// on rank 0: the group cannot go on. Where rank 0 goes on after a failed cache move
    /// (its rows failed, its batch `Reset`), this rank goes on alike.
    pub fn apply(&mut self, op: LaneOp) -> Result<(), Exception> {
        let w = self.worker;
        match op {
            LaneOp::Open {
                key,
                prompt,
                cached,
            } => self.open(key, prompt, cached)?,
            LaneOp::Chunk { key, n } => {
                let h = self.held.get_mut(&key).ok_or_else(|| missing(key))?;
                let chunk = h
                    .prompt
                    .get(h.fed..h.fed + n)
                    .ok_or_else(|| Exception::custom("a prefill chunk past its prompt"))?;
                h.session.prefill_chunk(chunk)?;
                h.fed += n;
            }
            LaneOp::Alone { key } => {
                let h = self.held.get_mut(&key).ok_or_else(|| missing(key))?;
                h.session.step(&h.prompt)?.eval()?;
            }
            LaneOp::Close { key, keep } => {
                let h = self.take(key)?;
                if let Some(produced) = keep {
                    w.keep_caches(h.session, &h.prompt, produced);
                }
            }
            LaneOp::Join { keys } => {
                let sessions = self.takes(&keys)?.into_iter().map(|h| h.session).collect();
                // Rank 0 fails the rows of a join that fails, and goes on.
                let _ = self.batch.join(sessions);
            }
            LaneOp::Admit { keys } => self.admit(&keys)?,
            LaneOp::Together { keys } => {
                let held = self.takes(&keys)?;
                let prompts: Vec<&[u32]> = held.iter().map(|h| &h.prompt[..]).collect();
                self.batch.admit_prompts(&prompts, w.prefill_step)?.eval()?;
            }
            LaneOp::Step { mut ids } => {
                if crate::plant::is(crate::plant::Defect::FollowerRowsReversed) {
                    ids.reverse();
                }
                self.batch.step_ids(&step_ids(&ids))?.eval()?;
            }
            LaneOp::Settle { keep, ended } => self.settle(&keep, &ended),
            LaneOp::Park { row, fed, key } => self.park(row, fed, key),
            LaneOp::Rejoin { key } => {
                let h = self.take(key)?;
                let _ = self.batch.join(vec![h.session]);
            }
            LaneOp::GoSolo => {
                let _ = self.batch.go_solo(&w.opts);
            }
            LaneOp::Reset => self.batch = Batch::for_lane(w.model.as_ref()),
        }
        Ok(())
    }

    /// `Open`: the prompt store gives what it gave rank 0.
    fn open(&mut self, key: u64, prompt: Vec<u32>, cached: usize) -> Result<(), Exception> {
        let w = self.worker;
        let (mut caches, reused) = match w.cache_take(&prompt) {
            Some(hit) if hit.reused == cached => (hit.caches, hit.reused),
            // Rank 0 found nothing (as the serial follower: `follow_admit`): start afresh.
            _ if cached == 0 => (w.make_caches(), 0),
            hit => (Vec::new(), hit.map_or(0, |h| h.reused)),
        };
        if reused != cached {
            return Err(Exception::custom(format!(
                "the prompt stores diverged: rank 0 reused {cached} prompt tokens, this rank \
                 {reused}"
            )));
        }
        caches.truncate(w.model_layers());
        self.hold(key, caches, prompt, cached);
        Ok(())
    }

    /// `Admit`: the admissions' last prompt ids in one step of their own.
    fn admit(&mut self, keys: &[u64]) -> Result<(), Exception> {
        let held = self.takes(keys)?;
        let last = held
            .iter()
            .map(|h| h.prompt.get(h.fed).copied())
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| Exception::custom("an admission with its prompt all fed"))?;
        let sessions = held.into_iter().map(|h| h.session).collect();
        self.batch.admit(sessions, &last)?.eval()
    }

    /// `Settle`: the ended rows' caches kept, the rest of the rows kept in the batch.
    fn settle(&mut self, keep: &[usize], ended: &[(usize, Vec<u32>)]) {
        let kept: Vec<Entry> = ended
            .iter()
            .filter_map(|(row, history)| ended_entry(&mut self.batch, *row, history))
            .collect();
        // A failed keep fails rank 0's rows; its Reset follows.
        let _ = self.batch.keep(keep);
        for (tokens, caches) in kept {
            self.worker.keep_whole(tokens, caches, None);
        }
    }

    /// `Park`: row `row` out of the batch with its first `fed` tokens, held under `key`.
    fn park(&mut self, row: usize, fed: i32, key: u64) {
        let Ok(caches) = self.batch.row_caches(row, fed) else {
            return;
        };
        let rows = self.batch.rows();
        let keep: Vec<usize> = (0..rows).filter(|&k| k != row).collect();
        if self.batch.keep(&keep).is_ok() {
            self.hold(key, caches, Vec::new(), 0);
        }
    }
}

fn missing(key: u64) -> Exception {
    Exception::custom(format!(
        "the round plan names row {key}, which this rank does not hold"
    ))
}
