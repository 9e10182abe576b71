//! Embeddings on the model thread. An embeddings request is one job (`EmbedJob`) set aside
//! by whichever lane receives it (`Worker::divert`); the lanes run one input of the oldest
//! job per round, between their generation steps (`Worker::embed_tick`), and a job goes to
//! the back after each input, so a request of many inputs neither holds a running
//! generation up nor a later small request. An idle worker embeds until a generation
//! arrives (`Worker::wait_job`). Under a distributed group embeddings are refused (the
//! followers run generation plans only).

use std::cell::{OnceCell, RefCell};
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use tokio::sync::oneshot;

use super::{panic_error, Job, QueueSlot, Work, Worker};
use crate::embed::{self, EmbedError, Pooling};
use crate::plant::{self, Defect};
use crate::serve::error::ApiError;

type Reply = oneshot::Sender<Result<Vec<Vec<f32>>, ApiError>>;

/// One embeddings request: its inputs' ids (tokenized, each checked), what is done so far.
pub struct EmbedJob {
    inputs: Vec<Vec<u32>>,
    pooling: Pooling,
    dimensions: Option<usize>,
    done: Vec<Vec<f32>>,
    reply: Reply,
    deadline: Option<Instant>,
    /// Held until the model thread starts the job (`/stats` queued, `--max-queue`).
    queued: Option<QueueSlot>,
    /// The adapter the request's `model` picked (None: the base model).
    pub adapter: Option<crate::serve::adapters::Use>,
    /// Its `--memory-budget` reservation (`budget::Budget::embed_need`): dropped with the
    /// job, however it ends (answered, refused, its client gone, the thread stopping).
    pub budget: Option<crate::serve::budget::Reservation>,
}

impl EmbedJob {
    pub fn new(
        inputs: Vec<Vec<u32>>,
        pooling: Pooling,
        dimensions: Option<usize>,
        reply: Reply,
        deadline: Option<Instant>,
        queued: QueueSlot,
    ) -> Self {
        EmbedJob {
            inputs,
            pooling,
            dimensions,
            done: Vec::new(),
            reply,
            deadline,
            queued: Some(queued),
            adapter: None,
            budget: None,
        }
    }
}

/// The embeddings jobs the model thread holds, and the model's hidden size (or its
/// family's refusal), learnt once.
#[derive(Default)]
pub struct Pending {
    jobs: RefCell<VecDeque<EmbedJob>>,
    hidden: OnceCell<Result<usize, String>>,
}

impl Pending {
    pub fn is_empty(&self) -> bool {
        self.jobs.borrow().is_empty()
    }
}

impl Worker {
    /// A generation job as it came; an embeddings job set aside (refused under a group).
    pub(in crate::serve) fn divert(&self, work: Work) -> Option<Job> {
        match work {
            Work::Generate(job) => Some(job),
            Work::Embed(job) if self.dist.is_some() => {
                let _ = job.reply.send(Err(ApiError::invalid(
                    "embeddings are not served by a distributed group (mlx.launch): serve the \
                     embedding model from one process",
                )));
                None
            }
            Work::Embed(job) => {
                self.embeds.jobs.borrow_mut().push_back(job);
                None
            }
            Work::Adapter(op) => {
                self.adapter_op(op);
                None
            }
            Work::Trim => {
                self.trim_to_budget();
                None
            }
        }
    }

    /// The next generation job already queued, if any (embeddings jobs set aside).
    pub(in crate::serve) fn try_job(&self, jobs: &Receiver<Work>) -> Option<Job> {
        while let Ok(work) = jobs.try_recv() {
            if let Some(job) = self.divert(work) {
                return Some(job);
            }
        }
        None
    }

    /// A gate's set-up (`BatchGathersFour`, `SerialGathersFour`): with `have` jobs in hand, the
    /// jobs that make them four, waiting a minute at most, so that a gate's requests arrive
    /// together whatever the machine's load.
    pub(in crate::serve) fn gather_four(&self, jobs: &Receiver<Work>, have: usize) -> Vec<Job> {
        let until = std::time::Instant::now() + Duration::from_secs(60);
        let mut got = Vec::new();
        while have + got.len() < 4 && std::time::Instant::now() < until {
            if let Ok(job) = self.job_within(jobs, Duration::from_millis(50)) {
                got.push(job);
            }
        }
        got
    }

    /// `recv_timeout` for generation jobs; an embeddings job arriving ends the wait early
    /// (as a timeout) so that the lane runs it.
    pub(in crate::serve) fn job_within(
        &self,
        jobs: &Receiver<Work>,
        timeout: Duration,
    ) -> Result<Job, RecvTimeoutError> {
        let work = crate::serve::turn::outside(|| jobs.recv_timeout(timeout))?;
        self.divert(work).ok_or(RecvTimeoutError::Timeout)
    }

    /// The idle worker's wait for the next generation job (None once every sender is gone
    /// and every embeddings job is answered): meanwhile one input is embedded per look at
    /// the queue.
    pub(in crate::serve) fn wait_job(&self, jobs: &Receiver<Work>) -> Option<Job> {
        loop {
            if self.embeds.is_empty() {
                // The store's borrow ends before `divert` (a `Work::Trim` trims the store).
                let work = self.store.borrow_mut().recv(jobs)?;
                if let Some(job) = self.divert(work) {
                    return Some(job);
                }
                continue;
            }
            match jobs.try_recv() {
                Ok(work) => {
                    if let Some(job) = self.divert(work) {
                        return Some(job);
                    }
                }
                Err(TryRecvError::Empty) => {
                    self.embed_tick();
                }
                Err(TryRecvError::Disconnected) => while self.embed_tick() {},
            }
        }
    }

    /// Embeds one input of the oldest embeddings job (answering it when it was its last);
    /// false when none is waiting. A job whose client has gone, or past its deadline,
    /// ends here without more work.
    pub(in crate::serve) fn embed_tick(&self) -> bool {
        let Some(mut job) = self.embeds.jobs.borrow_mut().pop_front() else {
            return false;
        };
        if job.queued.take().is_some() {
            self.counters.running.fetch_add(1, Ordering::Relaxed);
        }
        if job.reply.is_closed() {
            self.counters.cancelled.fetch_add(1, Ordering::Release);
            self.counters.running.fetch_sub(1, Ordering::Relaxed);
            return true;
        }
        if job.deadline.is_some_and(|d| Instant::now() >= d) {
            self.counters.timed_out.fetch_add(1, Ordering::Release);
            let late = ApiError::invalid("the request ran past the server's --request-timeout")
                .with_status(StatusCode::REQUEST_TIMEOUT);
            self.answer(job, Err(late));
            return true;
        }
        if let Err(e) = self.check_dimensions(job.dimensions) {
            self.answer(job, Err(e));
            return true;
        }
        if let Err(e) = self.use_adapter(job.adapter.as_ref()) {
            self.answer(job, Err(e));
            return true;
        }
        // Under a budget the request's reservation excludes this model's own prompt cache,
        // which gives way here, as before a generation's prompt lookup.
        if job.budget.is_some() {
            self.trim_to_budget();
        }
        let model = self.model.as_ref();
        loop {
            let ids = &job.inputs[job.done.len()];
            match catch_unwind(AssertUnwindSafe(|| {
                embed::embed(model, ids, job.pooling, job.dimensions)
            })) {
                Ok(Ok(v)) => job.done.push(v),
                Ok(Err(e)) => {
                    self.answer(job, Err(refusal(e)));
                    return true;
                }
                Err(panic) => {
                    self.answer(job, Err(panic_error(panic)));
                    return true;
                }
            }
            // Planted: the whole request in this turn.
            let planted = plant::is(Defect::EmbedHoldsTheLane);
            if !planted || job.done.len() == job.inputs.len() {
                break;
            }
        }
        if job.done.len() == job.inputs.len() {
            let vectors = std::mem::take(&mut job.done);
            self.answer(job, Ok(vectors));
        } else {
            self.embeds.jobs.borrow_mut().push_back(job);
        }
        true
    }

    /// `dimensions` within the model's hidden size; the family's refusal when it cannot
    /// embed (learnt from one probe token, once).
    fn check_dimensions(&self, dimensions: Option<usize>) -> Result<(), ApiError> {
        let hidden = self.embeds.hidden.get_or_init(|| {
            catch_unwind(AssertUnwindSafe(|| embed::hidden_size(self.model.as_ref())))
                .unwrap_or_else(|_| Err(EmbedError::Model("a probe token panicked".into())))
                .map_err(|e| e.to_string())
        });
        match (hidden, dimensions) {
            (Err(why), _) => Err(ApiError::invalid(why.clone())),
            (Ok(h), Some(d)) if d > *h => Err(refusal(EmbedError::Dimensions {
                asked: d,
                hidden: *h,
            })),
            _ => Ok(()),
        }
    }

    /// The job's answer sent and counted; it leaves the model thread.
    fn answer(&self, mut job: EmbedJob, result: Result<Vec<Vec<f32>>, ApiError>) {
        // Its forwards are over: the room is free before the client hears.
        drop(job.budget.take());
        let c = &self.counters;
        // A refusal or failure is counted by the HTTP side, which answers it.
        if result.is_ok() {
            let tokens: usize = job.inputs.iter().map(Vec::len).sum();
            c.prompt_tokens.fetch_add(tokens as u64, Ordering::Relaxed);
            c.completed.fetch_add(1, Ordering::Release);
        }
        let _ = job.reply.send(result);
        c.running.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A client's mistake is a 400 naming the field; the model failing is a 500.
fn refusal(e: EmbedError) -> ApiError {
    match e {
        EmbedError::Dimensions { .. } => ApiError::field("dimensions", e.to_string()),
        EmbedError::Empty => ApiError::field("input", e.to_string()),
        EmbedError::Unsupported(why) => ApiError::invalid(why),
        EmbedError::Model(why) => ApiError::server(format!("embedding failed: {why}")),
    }
}
