//! The model thread. MLX is not thread-safe, so one thread owns the model and runs every
//! request on it (the serial lane): up to `--interleave` requests take turns, one token
//! each, admitted in arrival order, so a long answer never holds up a short one. Requests
//! arrive as jobs holding their prompt ids (encoded on the HTTP side: `Encoder`); results
//! leave as events on the job's bounded channel (`emit`), which the thread never waits on.
//! A client that has gone away, stopped reading, or whose request ran out of time is
//! noticed at the next token and its generation stops there. A request that fails — an
//! MLX error, even a panic — fails alone; the thread goes on.

pub mod adapters;
mod embed;
mod image;

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::Sender;

use super::emit::{Emitter, Event, Outbox};
pub use super::encode::{prompt_bytes, Encoder};
use super::error::ApiError;
use super::request::GenRequest;
use super::store::PromptStore;
use super::tools::machine::Machine;
use super::tools::Markers;
use super::{Counters, Limits};
use crate::generate::decode::Decoder;
use crate::generate::drafter::Decode;
use crate::generate::{Finish, Session, SessionOptions};
use crate::load::tokenizer::Tokenizer;
use crate::model::LanguageModel;
pub use embed::{EmbedJob, Pending};
pub(in crate::serve) use image::ImageSteps;

/// Requests held per `--interleave` / `--batch` slot at most, counting those waiting on
/// their clients (paused or parked; each holds its KV caches until its stall timeout).
pub const PAUSED_PER_SLOT: usize = 4;

/// What the model thread is sent: a generation, or an embeddings request (`embed`).
/// Unboxed: a generation was sent by value before, and the queue holds few.
#[allow(clippy::large_enum_variant)]
pub enum Work {
    Generate(Job),
    Embed(EmbedJob),
    /// Mount or unmount an adapter, between two steps (`adapters::lane`).
    Adapter(adapters::Op),
    /// `--memory-budget`: trim the prompt cache to its room (another model's request
    /// waits for it: `budget::caches`).
    Trim,
}

pub struct Job {
    pub request: GenRequest,
    /// The prompt, encoded on the HTTP side.
    pub prompt_ids: Vec<u32>,
    /// Bounded (`EVENT_SLOTS`); the model thread only ever try-sends on it.
    pub events: Sender<Event>,
    /// Arrival plus `--request-timeout`.
    pub deadline: Option<Instant>,
    /// Counts the job as queued until the model thread admits it (or it is dropped).
    pub queued: QueueSlot,
    /// The adapter the request's `model` picked (None: the base model).
    pub adapter: Option<super::adapters::Use>,
    /// Its share of `--memory-budget`, held until the request ends (`budget`).
    pub budget: Option<super::budget::Reservation>,
}

/// One place in the queue (`/stats` `queued`, `--max-queue`): taken by the HTTP side when a
/// request arrives, given back when the request leaves the queue however it leaves.
pub struct QueueSlot(Arc<Counters>);

impl QueueSlot {
    /// A place, unless `max` requests are queued already.
    pub fn take(counters: &Arc<Counters>, max: usize) -> Option<Self> {
        counters
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                (q < max).then_some(q + 1)
            })
            .ok()
            .map(|_| QueueSlot(counters.clone()))
    }
}

impl Drop for QueueSlot {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::AcqRel);
    }
}

pub struct Worker {
    /// The prompt cache's RAM and SSD tiers (`store`): on this thread only, as it holds
    /// MLX arrays.
    pub store: std::cell::RefCell<PromptStore>,
    pub model: Box<dyn LanguageModel>,
    /// Speculative decoding's drafter and γ (`--draft-model`, `--num-draft-tokens`); its
    /// caches follow the model's in every prompt-cache entry (as mlx_lm.server keeps them).
    pub draft: Option<(crate::generate::drafter::Drafter, usize)>,
    pub tokenizer: Arc<Tokenizer>,
    /// Reasoning and tool-call markers, and their state machine (shared by every request).
    pub markers: Arc<Markers>,
    pub machine: Arc<Machine>,
    pub opts: SessionOptions,
    pub context: usize,
    pub prefill_step: usize,
    pub counters: Arc<Counters>,
    pub limits: Arc<Limits>,
    /// Rank 0 of a distributed group: what it shares with the followers (`dist_plan`).
    pub dist: Option<super::dist_plan::Leader>,
    /// Embeddings requests being answered, one input per round (`embeddings`).
    pub embeds: Pending,
    /// The LoRA adapters mounted (`--adapter`, `/v1/adapters`) and the one on the model.
    pub adapters: adapters::Loaded,
    /// `--memory-budget`: the prompt cache is trimmed to what it leaves.
    pub budget: Option<super::budget::Share>,
    /// The model with its vision tower, for requests with images (`image`; None: the
    /// server reads no images, `serve::images::served`).
    pub vision: Option<crate::vision::model::ImageModel>,
}

/// The refusal of a request with images that names an adapter.
pub const ADAPTER_WITH_IMAGES: &str = "adapters apply to the text model only: send images to \
     the base model, or the adapter's request without images";

/// How a serial-lane request makes its tokens: the text decode core, or a prompt with
/// images (`image`). Unboxed: a lane holds a few turns at most.
#[allow(clippy::large_enum_variant)]
enum Steps<'w> {
    Text(Decode<'w>),
    Image(image::ImageSteps<'w>),
}

/// A serial-lane request between two of its steps: its decoding (`Decode`: its sessions
/// and policy) and its `Decoder`, so the lane can run one step — or one speculative round
/// — of each request in turn, with the same MLX calls in the same order per request as
/// when it runs alone, so every answer is unchanged.
struct Turn<'w> {
    /// The request's id in the round plans (under a group).
    id: u64,
    emit: Emitter<'w>,
    steps: Steps<'w>,
    dec: Decoder<'w>,
    prompt_ids: Vec<u32>,
    cached: usize,
    /// The drafter's caches, behind (this request runs without drafting).
    draft_caches: Option<Vec<Box<dyn crate::cache::Cache>>>,
    /// The request's adapter, put on the model before each of its steps.
    adapter: Option<super::adapters::Use>,
    /// Its `--memory-budget` reservation, released when it ends.
    budget: Option<super::budget::Reservation>,
}

pub(super) fn panic_error(panic: Box<dyn std::any::Any + Send>) -> ApiError {
    ApiError::server(format!(
        "the model failed on this request: {}",
        panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("panic")
    ))
}

impl Worker {
    /// Serves jobs until every sender is gone: up to `--interleave` requests take turns,
    /// one token each; a new one is admitted (prefilled) at most once per round. A request
    /// whose client has not taken its events yet gets no tokens until it does (its stall
    /// clock runs) and does not count against `--interleave`, so clients that stop reading
    /// never keep others from being admitted.
    pub fn run(self, jobs: mpsc::Receiver<Work>) {
        let slots = self.limits.interleave.max(1);
        let mut turns: VecDeque<Turn<'_>> = VecDeque::new();
        let mut held: Option<Job> = None;
        // Jobs a gate's set-up gathered (`SerialGathersFour`), taken before new ones.
        let mut gathered: VecDeque<Job> = VecDeque::new();
        crate::dist::arm("the first round plan");
        loop {
            // Another model's thread may have a step to run (`turn`).
            super::turn::pass();
            if let Some(why) = self.dist.as_ref().and_then(|l| l.lost()) {
                self.peer_lost(&mut turns, held.take(), &jobs, &why);
            }
            if turns.is_empty() && held.is_none() && gathered.is_empty() {
                match self.next_job(&jobs) {
                    Some(job) => held = Some(job),
                    None => return,
                }
                if crate::plant::is(crate::plant::Defect::SerialGathersFour) {
                    gathered.extend(self.gather_four(&jobs, 1));
                }
            }
            if held.is_none() {
                held = gathered.pop_front().or_else(|| self.try_job(&jobs));
            }
            if held.is_some() {
                let mut active = 0;
                for t in turns.iter_mut() {
                    active += usize::from(!t.emit.backlogged());
                }
                if active < slots && turns.len() < PAUSED_PER_SLOT * slots {
                    if let Some(turn) = held.take().and_then(|job| self.guarded_begin(job)) {
                        turns.push_back(turn);
                    }
                }
            }
            let mut ticked = false;
            for _ in 0..turns.len() {
                let Some(mut turn) = turns.pop_front() else {
                    break;
                };
                if turn.emit.backlogged() {
                    if turn.emit.check() {
                        self.guarded_end(turn, Ok(Finish::Stop));
                    } else {
                        turns.push_back(turn);
                    }
                    continue;
                }
                ticked = true;
                let result = match catch_unwind(AssertUnwindSafe(|| self.turn(&mut turn))) {
                    Ok(Ok(None)) => {
                        turns.push_back(turn);
                        continue;
                    }
                    Ok(Ok(Some(finish))) => Ok(finish),
                    Ok(Err(e)) => Err(e),
                    Err(panic) => Err(self.lose_on_panic(panic)),
                };
                self.guarded_end(turn, result);
            }
            // One embeddings input per round, between the generations' steps.
            let ticked = self.embed_tick() || ticked;
            if let (false, Some(lead)) = (ticked, &self.dist) {
                if let Err(e) = lead.heartbeat() {
                    lead.lose(&e);
                }
            }
            if !ticked && !turns.is_empty() {
                // Every request waits on its client: wait a moment (or for a new job).
                let pause = Duration::from_millis(5);
                let sleep = || super::turn::outside(|| std::thread::sleep(pause));
                if held.is_some() {
                    sleep();
                } else {
                    match self.job_within(&jobs, pause) {
                        Ok(job) => held = Some(job),
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                        Err(mpsc::RecvTimeoutError::Disconnected) => sleep(),
                    }
                }
            }
        }
    }

    /// `end_turn`, with a panic failing the request alone.
    fn guarded_end(&self, turn: Turn<'_>, result: Result<Finish, ApiError>) {
        if let Some(why) = self.dist.as_ref().and_then(|l| l.lost()) {
            // No MLX work after a failed collective (a later one would hang): it fails as is.
            let e = ApiError::server(super::dist_plan::lost_message(&why));
            return self.end_failed(turn.emit, e);
        }
        let (id, prompt_len) = (turn.id, turn.prompt_ids.len());
        if catch_unwind(AssertUnwindSafe(|| self.end_turn(turn, result))).is_err() {
            self.counters.failed.fetch_add(1, Ordering::Release);
            self.counters.running.fetch_sub(1, Ordering::Relaxed);
        }
        if let Some(lead) = &self.dist {
            lead.ended(id, prompt_len);
        }
    }

    /// `begin`, with a panic failing the request alone.
    fn guarded_begin<'w>(&'w self, job: Job) -> Option<Turn<'w>> {
        let events = job.events.clone();
        match catch_unwind(AssertUnwindSafe(|| self.begin(job))) {
            Ok(turn) => turn,
            Err(panic) => {
                self.counters.failed.fetch_add(1, Ordering::Release);
                let _ = events.try_send(Event::Failed(self.lose_on_panic(panic)));
                self.counters.running.fetch_sub(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// The request's prompt lookup, where this worker can run it: on one process only (a
    /// group's followers decode plainly). Recurrent states are rolled back by checkpoint
    /// (`generate::rollback`), so every model can.
    pub(super) fn lookup_for(
        &self,
        request: &GenRequest,
    ) -> Option<crate::generate::lookup::LookupParams> {
        request.prompt_lookup.filter(|_| self.dist.is_none())
    }

    /// Admits a job: its limits checked, the prompt cache consulted, the prompt prefilled
    /// (and, decoding plainly, its first id sampled). With `--draft-model` it drafts unless
    /// it turns that off (`num_draft_tokens` 0) or has logits processors, which the
    /// speculative policies do not run.
    fn begin<'w>(&'w self, job: Job) -> Option<Turn<'w>> {
        let Job {
            request,
            prompt_ids,
            events,
            deadline,
            queued,
            adapter,
            budget,
        } = job;
        drop(queued);
        self.counters.running.fetch_add(1, Ordering::Relaxed);
        let Some(out) = Outbox::new(events, deadline) else {
            self.counters.cancelled.fetch_add(1, Ordering::Release);
            self.counters.running.fetch_sub(1, Ordering::Relaxed);
            return None;
        };
        // Never past the context.
        let max_tokens = request.max_tokens.min(self.context - prompt_ids.len());
        let mut emit = Emitter::new(
            &self.limits,
            &self.tokenizer,
            &request,
            out,
            self.shape(&prompt_ids, max_tokens),
        );
        if emit.check() {
            emit.end_cut(&self.counters);
            self.counters.running.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        let sampler = self.markers.sampler(&request, &self.tokenizer);
        let sampler = match sampler {
            Ok(s) => s,
            Err(e) => {
                self.end_failed(emit, ApiError::generation(e));
                return None;
            }
        };
        if let Err(e) = self.use_adapter(adapter.as_ref()) {
            self.end_failed(emit, e);
            return None;
        }
        emit.started(prompt_ids.len());
        if !request.images.is_empty() {
            let t = (emit, prompt_ids, max_tokens, adapter, budget);
            return self.begin_image(&request, sampler, t);
        }
        let opts = self.opts_for(adapter.as_ref());
        let (mut caches, cached) = match self.cache_take(&prompt_ids) {
            Some(h) => (h.caches, h.reused),
            None => (self.make_caches(), 0),
        };
        let mut draft_caches = Some(caches.split_off(self.model_layers()));
        let mut session = Session::with_caches(self.model.as_ref(), &opts, caches);
        session.prefill_step = self.prefill_step;
        session.on_prefill = super::progress::prefill_hook(
            emit.weak_events(),
            prompt_ids.len(),
            cached,
            request.return_progress,
        );
        let draft = self
            .drafting(&request, &sampler)
            .map(|(draft, gamma)| (draft, gamma, draft_caches.take().unwrap_or_default()));
        let eos = &self.tokenizer.eos_token_ids;
        let mut dec = Decoder::new(&prompt_ids, max_tokens, eos, sampler);
        let id = match self.share_admission(&request, &prompt_ids, max_tokens, cached) {
            Ok(id) => id,
            Err(e) => {
                self.end_failed(emit, e);
                return None;
            }
        };
        let lookup = self.lookup_for(&request);
        match Decode::start_with(session, draft, lookup, &opts, &mut dec, &prompt_ids, cached) {
            Err(e) => {
                self.end_failed(emit, self.model_error(e));
                None
            }
            Ok(decode) => Some(Turn {
                id,
                emit,
                steps: Steps::Text(decode),
                dec,
                prompt_ids,
                cached,
                draft_caches,
                adapter,
                budget,
            }),
        }
    }

    /// The drafter and γ a request drafts with: none without `--draft-model`, with
    /// `num_draft_tokens` 0, prompt lookup, or logits processors the speculative policies
    /// do not run (a fallback, counted).
    pub(super) fn drafting(
        &self,
        request: &GenRequest,
        sampler: &crate::generate::sampler::Sampler,
    ) -> Option<(&crate::generate::drafter::Drafter, usize)> {
        let (draft, gamma) = self.draft.as_ref()?;
        let gamma = request.num_draft_tokens.unwrap_or(*gamma);
        let drafts = gamma > 0
            && crate::generate::drafter::can_draft(sampler, draft)
            && request.prompt_lookup.is_none();
        if !drafts {
            self.counters.spec_fallbacks.fetch_add(1, Ordering::Relaxed);
        }
        drafts.then_some((draft, gamma))
    }

    /// Admits a request with images (`image`): the drafter, prompt lookup and the prompt
    /// cache sit out; `t` is its emitter, prompt ids, token limit, adapter and reservation.
    #[allow(clippy::type_complexity)]
    fn begin_image<'w>(
        &'w self,
        request: &GenRequest,
        sampler: crate::generate::sampler::Sampler,
        t: (
            Emitter<'w>,
            Vec<u32>,
            usize,
            Option<super::adapters::Use>,
            Option<super::budget::Reservation>,
        ),
    ) -> Option<Turn<'w>> {
        let (emit, prompt_ids, max_tokens, adapter, budget) = t;
        if adapter.is_some() {
            let e = ApiError::invalid(ADAPTER_WITH_IMAGES);
            self.end_failed(emit, e);
            return None;
        }
        let eos = &self.tokenizer.eos_token_ids;
        let mut dec = Decoder::new(&prompt_ids, max_tokens, eos, sampler);
        match self.start_image(request, &prompt_ids, &mut dec) {
            Err(e) => {
                self.end_failed(emit, e);
                None
            }
            Ok(steps) => Some(Turn {
                id: 0,
                emit,
                steps: Steps::Image(steps),
                dec,
                prompt_ids,
                cached: 0,
                draft_caches: None,
                adapter,
                budget,
            }),
        }
    }

    /// One step (or speculative round) of one request. Some(finish) when it is over.
    fn turn(&self, t: &mut Turn<'_>) -> Result<Option<Finish>, ApiError> {
        if !crate::plant::is(crate::plant::Defect::AdapterSetOnceAtAdmission) {
            self.use_adapter(t.adapter.as_ref())?;
        }
        let emit = &mut t.emit;
        let decode = match &mut t.steps {
            Steps::Text(decode) => decode,
            Steps::Image(steps) => {
                return steps.advance(&mut t.dec, &mut |id, logprobs| emit.token(id, logprobs))
            }
        };
        let Some(lead) = &self.dist else {
            return decode.advance(&mut t.dec, &mut |id, logprobs, _| emit.token(id, logprobs));
        };
        let step = super::dist_plan::Op::Step { id: t.id };
        lead.send(Some(step)).map_err(|e| lead.lose(&e))?;
        lead.emit_failed.set(false);
        let result = decode.advance(&mut t.dec, &mut |id, logprobs, _| {
            lead.flow(id, emit.token(id, logprobs))
                .unwrap_or_else(|e| Err(lead.lose(&e)))
        });
        match result {
            // A model error on one rank is a step the others did not finish the same way.
            Err(e) if !lead.emit_failed.get() && !super::dist_plan::fails_alone(&e) => {
                Err(lead.lose(&e.message))
            }
            other => other,
        }
    }

    /// Ends a request that left the turns: no MLX work left in flight, then its answer.
    fn end_turn(&self, t: Turn<'_>, result: Result<Finish, ApiError>) {
        // Its caches are kept under its adapter's namespace.
        let result = self.use_adapter(t.adapter.as_ref()).and(result);
        let Turn {
            emit,
            steps,
            prompt_ids,
            cached,
            draft_caches,
            budget,
            ..
        } = t;
        // Its bytes are free again before its caches join the prompt cache (trimmed then).
        drop(budget);
        let decode = match (steps, result) {
            (Steps::Text(decode), result) => (decode, result),
            (Steps::Image(steps), Err(e)) => {
                drop(steps);
                return self.end_failed(emit, e);
            }
            (Steps::Image(steps), Ok(finish)) => {
                let produced = self.finish_answer(emit, prompt_ids.len(), steps.cached, finish);
                if let Some(produced) = produced {
                    self.keep_image(steps, &produced);
                    self.counters.running.fetch_sub(1, Ordering::Relaxed);
                }
                return;
            }
        };
        let (decode, result) = decode;
        if let (Some(spec), Ok(_)) = (decode.spec_stats(), &result) {
            let c = &self.counters;
            c.spec_drafted
                .fetch_add(spec.drafted as u64, Ordering::Relaxed);
            c.spec_accepted
                .fetch_add(spec.accepted as u64, Ordering::Relaxed);
            c.spec_target_calls
                .fetch_add(spec.target_calls as u64, Ordering::Relaxed);
        }
        let ((session, fed), finish) = match (decode.end(), result) {
            (Err(e), _) => {
                return self.end_failed(emit, self.model_error(e));
            }
            (Ok(_), Err(e)) => return self.end_failed(emit, e),
            (Ok(ended), Ok(finish)) => (ended, finish),
        };
        let compiled = session.compiled_steps() as u64;
        self.counters
            .compiled_steps
            .fetch_add(compiled, Ordering::Relaxed);
        self.conclude(emit, session, prompt_ids, cached, finish, fed, draft_caches)
    }

    /// A failed request: its error sent, counted.
    fn end_failed(&self, mut emit: Emitter<'_>, e: ApiError) {
        self.counters.count_error(&e);
        emit.fail(e);
        self.counters.running.fetch_sub(1, Ordering::Relaxed);
    }

    /// A request whose generation ended: its answer finished (or its cut told), its caches
    /// kept for later requests. `fed`: the drafter's caches after a drafted run; `behind`:
    /// the drafter's caches of a run without drafting, caught up here.
    #[allow(clippy::too_many_arguments)]
    fn conclude(
        &self,
        emit: Emitter<'_>,
        mut session: Session<'_>,
        prompt_ids: Vec<u32>,
        cached: usize,
        finish: Finish,
        fed: Option<Vec<Box<dyn crate::cache::Cache>>>,
        behind: Option<Vec<Box<dyn crate::cache::Cache>>>,
    ) {
        let Some(produced) = self.finish_answer(emit, prompt_ids.len(), cached, finish) else {
            return;
        };
        let mut tokens = prompt_ids;
        tokens.extend(&produced);
        let mut caches = std::mem::take(&mut session.caches);
        drop(session);
        let drafter_caches = match (fed, &self.draft, behind) {
            (Some(fed), _, _) => Ok(fed),
            // A request that ran without drafting: the drafter's caches catch up on what the
            // model was fed, so the entry stays whole for the next drafted turn.
            (None, Some((draft, _)), Some(behind)) => {
                let fed = &tokens[..crate::cache::common_len(&caches, tokens.len())];
                draft.catch_up(behind, &self.opts, fed, self.prefill_step)
            }
            _ => Ok(Vec::new()),
        };
        match drafter_caches {
            Ok(drafter_caches) => {
                caches.extend(drafter_caches);
                self.keep_fed(caches, tokens);
            }
            // The answer is out already; only the cache entry is lost.
            Err(e) => eprintln!(
                "engine serve: not caching this conversation: drafter catch-up failed: {e}"
            ),
        }
        self.counters.running.fetch_sub(1, Ordering::Relaxed);
    }

    /// The end of a request's answer told (or its cut), counted: the ids it produced, or
    /// None when nothing is left to keep (cut or failed; no longer running then).
    fn finish_answer(
        &self,
        mut emit: Emitter<'_>,
        prompt_len: usize,
        cached: usize,
        finish: Finish,
    ) -> Option<Vec<u32>> {
        if emit.gone {
            emit.end_cut(&self.counters);
            self.counters.running.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        if let Err(e) = emit.finish(finish, prompt_len, cached, |n| {
            self.count_done(prompt_len, n)
        }) {
            self.end_failed(emit, e);
            return None;
        }
        Some(std::mem::take(&mut emit.produced))
    }

    /// How a request's output is split and limited (its Emitter's `Shape`).
    pub(super) fn shape<'a>(
        &'a self,
        prompt: &'a [u32],
        max_tokens: usize,
    ) -> super::emit::Shape<'a> {
        super::emit::Shape {
            markers: &self.markers,
            machine: &self.machine,
            prompt,
            max_tokens,
        }
    }

    /// The model's caches, then the drafter's (if any): one prompt-cache entry holds both.
    pub(super) fn make_caches(&self) -> Vec<Box<dyn crate::cache::Cache>> {
        let mut caches = self.model.make_caches();
        if let Some((draft, _)) = &self.draft {
            caches.extend(draft.make_caches());
        }
        caches
    }

    /// How many of an entry's caches are the model's (the rest are the drafter's).
    pub(super) fn model_layers(&self) -> usize {
        self.model.make_caches().len()
    }

    pub(super) fn count_done(&self, prompt_tokens: usize, generated: usize) {
        self.counters
            .prompt_tokens
            .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        self.counters
            .completion_tokens
            .fetch_add(generated as u64, Ordering::Relaxed);
        self.counters.completed.fetch_add(1, Ordering::Release);
    }

    /// Waits for the next job. Pending write-behind snapshots are written once the lane has
    /// been idle for the debounce time, and before returning None (every sender gone).
    pub(super) fn next_job(&self, jobs: &mpsc::Receiver<Work>) -> Option<Job> {
        match &self.dist {
            Some(lead) => self.lead_idle(lead, jobs),
            None => self.wait_job(jobs),
        }
    }

    /// Under a group, when a collective failed: every request in flight or waiting fails
    /// (a 500, or an error event mid-stream), the HTTP side gets a moment to send that,
    /// and the process exits with `dist::exit::PEER_LOST`.
    fn peer_lost(
        &self,
        turns: &mut VecDeque<Turn<'_>>,
        held: Option<Job>,
        jobs: &mpsc::Receiver<Work>,
        why: &str,
    ) -> ! {
        // This rank ends in order from here: the peer watch leaves the exit to it.
        crate::dist::done();
        for t in turns.iter_mut() {
            t.emit
                .fail(ApiError::server(super::dist_plan::lost_message(why)));
            self.counters.failed.fetch_add(1, Ordering::Release);
        }
        self.end_lost(held, jobs, why)
    }

    /// The end of `peer_lost` (and the batch lane's `lane_lost`), once the requests in
    /// flight have failed: the jobs not started fail too, the HTTP side gets a moment to
    /// send that, and the process exits.
    pub(super) fn end_lost(
        &self,
        held: impl IntoIterator<Item = Job>,
        jobs: &mpsc::Receiver<Work>,
        why: &str,
    ) -> ! {
        let error = || ApiError::server(super::dist_plan::lost_message(why));
        let queued = jobs.try_iter().filter_map(|w| self.divert(w));
        for job in held.into_iter().chain(queued) {
            let _ = job.events.try_send(Event::Failed(error()));
        }
        std::thread::sleep(Duration::from_millis(500));
        crate::dist::fatal(&why)
    }

    /// Puts the session's caches in the prompt cache under the tokens they hold: the prompt
    /// and the generated ids fed back (a final EOS id may have been fed too; it is trimmed
    /// off, since it is not in `produced`).
    pub(super) fn keep_caches(&self, mut session: Session, prompt: &[u32], produced: Vec<u32>) {
        let mut tokens = prompt.to_vec();
        tokens.extend(produced);
        let caches = std::mem::take(&mut session.caches);
        drop(session);
        if let Some(caches) = self.with_drafter(caches, &tokens, None) {
            self.keep_fed(caches, tokens);
        }
    }

    // Entries are kept and found under the namespace of the adapter on the model
    // (`adapters::lane`), which every caller has put on for its request.

    /// Keeps caches holding (at least) the first tokens of `tokens` (`PromptStore::keep_fed`).
    pub(super) fn keep_fed(&self, caches: Vec<Box<dyn crate::cache::Cache>>, tokens: Vec<u32>) {
        if let Some(lead) = &self.dist {
            *lead.kept.borrow_mut() = Some(tokens.clone());
        }
        self.store
            .borrow_mut()
            .keep_fed(&self.namespace(), caches, tokens);
        self.trim_to_budget();
    }

    /// Keeps caches holding exactly `tokens`, whole (`with_drafter`).
    pub(super) fn keep_whole(
        &self,
        tokens: Vec<u32>,
        caches: Vec<Box<dyn crate::cache::Cache>>,
        seed: Option<Vec<Box<dyn crate::cache::Cache>>>,
    ) {
        if let Some(caches) = self.with_drafter(caches, &tokens, seed) {
            self.keep(tokens, caches);
        }
    }

    /// An entry made whole: with a draft model, caches of the model's layers only (the
    /// batch lane's) get the drafter's caught up on the `tokens` they hold — from `seed`,
    /// the row's drafter caches, or from nothing — as the serial lane's entries have them.
    /// None (nothing to keep) when the catch-up fails.
    fn with_drafter(
        &self,
        mut caches: Vec<Box<dyn crate::cache::Cache>>,
        tokens: &[u32],
        seed: Option<Vec<Box<dyn crate::cache::Cache>>>,
    ) -> Option<Vec<Box<dyn crate::cache::Cache>>> {
        let Some((draft @ crate::generate::drafter::Drafter::Model(_), _)) = &self.draft else {
            return Some(caches);
        };
        if caches.len() != self.model_layers() {
            return Some(caches);
        }
        let fed = &tokens[..crate::cache::common_len(&caches, tokens.len())];
        let seed = seed.unwrap_or_else(|| draft.make_caches());
        match draft.catch_up(seed, &self.opts, fed, self.prefill_step) {
            Ok(drafter) => {
                caches.extend(drafter);
                Some(caches)
            }
            Err(e) => {
                eprintln!(
                    "engine serve: not caching this conversation: drafter catch-up failed: {e}"
                );
                None
            }
        }
    }

    /// Keeps caches holding exactly `tokens` (`PromptStore::keep`).
    pub(super) fn keep(&self, tokens: Vec<u32>, caches: Vec<Box<dyn crate::cache::Cache>>) {
        self.store
            .borrow_mut()
            .keep(&self.namespace(), tokens, caches);
        self.trim_to_budget();
    }

    /// The longest usable cached prefix of `prompt` (`PromptStore::take`).
    pub(super) fn cache_take(&self, prompt: &[u32]) -> Option<crate::cache::prompt::Hit> {
        // Before a prefill: the prompt cache gives way to the reservations.
        self.trim_to_budget();
        self.store.borrow_mut().take(&self.namespace(), prompt)
    }

    /// `--memory-budget`: the RAM prompt cache trimmed to what the budget leaves it.
    fn trim_to_budget(&self) {
        if let Some(b) = &self.budget {
            b.trim(
                |slack| self.store.borrow().ram_held(slack),
                |room, slack| self.store.borrow_mut().trim_ram(room, slack),
            );
        }
    }
}
