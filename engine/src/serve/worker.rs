//! The model thread. MLX is not thread-safe, so one thread owns the model and runs every
//! request on it, one at a time, in arrival order (the serial lane). Requests arrive as
//! jobs; results leave as events on the job's channel. A client that has gone away is
//! noticed at the next token (its channel is closed) and its generation stops there. A
//! request that fails — an MLX error, even a panic — fails alone; the thread goes on.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};

use mlx_rs::ops::argsort_axis;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use tokio::sync::mpsc::UnboundedSender;

use super::emit::Emitter;
use super::request::{GenRequest, Prompt};
use crate::cache::prompt::{PromptCache, PromptCacheStats};
use crate::generate::sampler::Sampler;
use crate::generate::{generate_in, Flow, Session, SessionOptions};
use crate::load::template::ChatTemplate;
use crate::load::tokenizer::Tokenizer;
use crate::model::LanguageModel;

/// One token's log-probability and its best alternatives.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TokenLogprob {
    pub id: u32,
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(u32, String, f32)>,
}

#[derive(Debug)]
pub enum Event {
    /// The prompt was encoded: its length.
    Started {
        prompt_tokens: usize,
    },
    Text {
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    Done {
        finish_reason: &'static str,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Prompt tokens served from the prompt cache.
        cached_tokens: usize,
    },
    Failed(super::error::ApiError),
}

pub struct Job {
    pub request: GenRequest,
    pub events: UnboundedSender<Event>,
}

/// Counters for `/stats`.
#[derive(Default)]
pub struct Counters {
    pub requests: AtomicU64,
    pub completed: AtomicU64,
    pub failed: AtomicU64,
    pub cancelled: AtomicU64,
    pub rejected: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub queued: AtomicUsize,
    pub running: AtomicUsize,
    /// Rows of the batch lane (0: serial lane only), and the most that decoded together.
    pub batch_slots: AtomicUsize,
    pub batch_peak: AtomicUsize,
    /// Speculative decoding (`--draft-model`): drafts proposed and accepted, verify passes,
    /// and requests that ran without it (their logits processors need the plain path).
    pub spec_drafted: AtomicU64,
    pub spec_accepted: AtomicU64,
    pub spec_target_calls: AtomicU64,
    pub spec_fallbacks: AtomicU64,
}

pub struct Worker {
    pub prompt_cache: std::cell::RefCell<PromptCache>,
    /// The SSD tier (`--ssd-cache`), if on.
    pub ssd: std::cell::RefCell<Option<crate::cache::ssd::SsdStore>>,
    pub ssd_stats: Arc<std::sync::Mutex<Option<crate::cache::ssd::SsdStats>>>,
    /// Write-behind: RAM entries (namespace, tokens) not yet on the SSD tier. They are
    /// written once no request has arrived for `ssd_debounce` (never on the token loop), when
    /// the RAM tier evicts them, and when the server stops.
    pub ssd_pending: std::cell::RefCell<Vec<(String, Vec<u32>)>>,
    pub ssd_debounce: std::time::Duration,
    /// The prompt cache's numbers, mirrored for `/stats` (the cache itself holds MLX arrays
    /// and stays on this thread).
    pub prompt_cache_stats: Arc<std::sync::Mutex<PromptCacheStats>>,
    pub model: Box<dyn LanguageModel>,
    /// Speculative decoding's drafter and γ (`--draft-model`, `--num-draft-tokens`); its
    /// caches follow the model's in every prompt-cache entry (as mlx_lm.server keeps them).
    pub draft: Option<(crate::generate::drafter::Drafter, usize)>,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    pub opts: SessionOptions,
    pub context: usize,
    pub prefill_step: usize,
    pub counters: Arc<Counters>,
}

impl Worker {
    /// Serves jobs until every sender is gone.
    pub fn run(self, jobs: mpsc::Receiver<Job>) {
        while let Some(job) = self.next_job(&jobs) {
            self.counters.queued.fetch_sub(1, Ordering::Relaxed);
            self.counters.running.fetch_add(1, Ordering::Relaxed);
            let events = job.events.clone();
            let outcome = catch_unwind(AssertUnwindSafe(|| self.serve(job)));
            let failure = match outcome {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e),
                Err(panic) => Some(super::error::ApiError::server(format!(
                    "the model failed on this request: {}",
                    panic
                        .downcast_ref::<String>()
                        .map(String::as_str)
                        .or_else(|| panic.downcast_ref::<&str>().copied())
                        .unwrap_or("panic")
                ))),
            };
            if let Some(e) = failure {
                if e.status.is_client_error() {
                    self.counters.rejected.fetch_add(1, Ordering::Relaxed);
                } else {
                    self.counters.failed.fetch_add(1, Ordering::Relaxed);
                }
                let _ = events.send(Event::Failed(e));
            }
            self.counters.running.fetch_sub(1, Ordering::Relaxed);
        }
    }

    pub(super) fn prompt_ids(&self, prompt: &Prompt) -> Result<Vec<u32>, super::error::ApiError> {
        use super::error::ApiError;
        let (ids, field) = match prompt {
            Prompt::Chat(messages) => {
                let template = self.template.as_ref().ok_or_else(|| {
                    ApiError::invalid("this model has no chat template; use /v1/completions")
                })?;
                let rendered = template
                    .render(messages, true)
                    .map_err(|e| ApiError::field("messages", e.to_string()))?;
                (self.tokenizer.encode(&rendered, false), "messages")
            }
            Prompt::Text(text) => (self.tokenizer.encode(text, true), "prompt"),
        };
        let ids = ids.map_err(|e| ApiError::field(field, e.to_string()))?;
        if ids.is_empty() {
            return Err(ApiError::field(field, "the prompt encodes to no tokens"));
        }
        if ids.len() >= self.context {
            return Err(ApiError::field(
                field,
                format!(
                    "the prompt is {} tokens; this model's context is {} tokens",
                    ids.len(),
                    self.context
                ),
            ));
        }
        Ok(ids)
    }

    fn serve(&self, job: Job) -> Result<(), super::error::ApiError> {
        use super::error::ApiError;
        let Job { request, events } = job;
        let prompt_ids = self.prompt_ids(&request.prompt)?;
        let mut sampler =
            Sampler::new(request.sampling.clone()).map_err(|e| ApiError::server(e.to_string()))?;
        let _ = events.send(Event::Started {
            prompt_tokens: prompt_ids.len(),
        });
        // Never past the context.
        let max_tokens = request.max_tokens.min(self.context - prompt_ids.len());
        let mut emit = Emitter::new(self, &request, events);
        let mut failure: Option<ApiError> = None;
        let (mut caches, cached) = match self.cache_take(&prompt_ids) {
            Some(h) => (h.caches, h.reused),
            None => (self.make_caches(), 0),
        };
        let mut draft_caches = Some(caches.split_off(self.model_layers()));
        let mut session = Session::with_caches(self.model.as_ref(), &self.opts, caches);
        session.prefill_step = self.prefill_step;
        let mut on_token = |id: u32, logprobs: &Array| match emit.token(self, id, logprobs) {
            Ok(flow) => Ok(flow),
            Err(e) => {
                failure = Some(e);
                Ok(Flow::Stop)
            }
        };
        // Drafting unless the request turns it off (num_draft_tokens 0) or has logits
        // processors, which the speculative executor does not run.
        let gamma = self
            .draft
            .as_ref()
            .map(|(_, g)| request.num_draft_tokens.unwrap_or(*g));
        let spec = self
            .draft
            .as_ref()
            .zip(gamma)
            .filter(|&(_, g)| g > 0 && !sampler.has_processors());
        if self.draft.is_some() && spec.is_none() {
            self.counters.spec_fallbacks.fetch_add(1, Ordering::Relaxed);
        }
        let (finish, drafter_caches) = match spec {
            None => {
                let (_, finish) = generate_in(
                    &mut session,
                    &prompt_ids,
                    cached,
                    max_tokens,
                    &self.tokenizer.eos_token_ids,
                    &mut sampler,
                    on_token,
                )
                .map_err(|e| ApiError::server(format!("generation failed: {e}")))?;
                (finish, None)
            }
            Some(((draft, _), gamma)) => {
                let (_, stats, finish, caches) = draft
                    .generate(
                        &mut session,
                        draft_caches.take().unwrap_or_default(),
                        &self.opts,
                        &prompt_ids,
                        cached,
                        gamma,
                        max_tokens,
                        &self.tokenizer.eos_token_ids,
                        &mut sampler,
                        |id, logprobs, _| on_token(id, logprobs),
                    )
                    .map_err(|e| ApiError::server(format!("generation failed: {e}")))?;
                let c = &self.counters;
                c.spec_drafted
                    .fetch_add(stats.drafted as u64, Ordering::Relaxed);
                c.spec_accepted
                    .fetch_add(stats.accepted as u64, Ordering::Relaxed);
                c.spec_target_calls
                    .fetch_add(stats.target_calls as u64, Ordering::Relaxed);
                (finish, Some(caches))
            }
        };
        if let Some(e) = failure {
            return Err(e);
        }
        if emit.gone {
            self.counters.cancelled.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        let generated = emit.finish(finish, prompt_ids.len(), cached)?;
        let tokens_len = prompt_ids.len();
        let mut tokens = prompt_ids;
        tokens.extend(&emit.produced);
        let mut caches = std::mem::take(&mut session.caches);
        let drafter_caches = match (drafter_caches, &self.draft, draft_caches) {
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
        self.count_done(tokens_len, generated);
        Ok(())
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
    fn model_layers(&self) -> usize {
        self.model.make_caches().len()
    }

    pub(super) fn count_done(&self, prompt_tokens: usize, generated: usize) {
        self.counters
            .prompt_tokens
            .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        self.counters
            .completion_tokens
            .fetch_add(generated as u64, Ordering::Relaxed);
        self.counters.completed.fetch_add(1, Ordering::Relaxed);
    }

    /// Waits for the next job. Pending write-behind snapshots are written once the lane has
    /// been idle for the debounce time, and before returning None (every sender gone).
    pub(super) fn next_job(&self, jobs: &mpsc::Receiver<Job>) -> Option<Job> {
        if !self.ssd_pending.borrow().is_empty() {
            match jobs.recv_timeout(self.ssd_debounce) {
                Ok(job) => return Some(job),
                Err(mpsc::RecvTimeoutError::Timeout) => self.flush_ssd(),
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    self.flush_ssd();
                    return None;
                }
            }
        }
        let job = jobs.recv().ok();
        if job.is_none() {
            self.flush_ssd();
        }
        job
    }

    /// Writes the pending write-behind snapshots still in RAM (an entry a later request took
    /// is gone from RAM: that request keeps a longer one).
    pub(super) fn flush_ssd(&self) {
        let pending = std::mem::take(&mut *self.ssd_pending.borrow_mut());
        let mut ssd = self.ssd.borrow_mut();
        let Some(store) = ssd.as_mut() else {
            return;
        };
        let ram = self.prompt_cache.borrow();
        for (ns, tokens) in pending {
            if let Some(caches) = ram.peek(&ns, &tokens) {
                Self::write_ssd(store, &ns, &tokens, caches);
            }
        }
        drop((ram, ssd));
        self.sync_cache_stats();
    }

    /// Writes an entry to the SSD tier unless it already holds these tokens (or all but the
    /// last: a prompt's last token is always fed again, so that entry serves as well).
    fn write_ssd(
        store: &mut crate::cache::ssd::SsdStore,
        ns: &str,
        tokens: &[u32],
        caches: &[Box<dyn crate::cache::Cache>],
    ) {
        let covered = store
            .find(ns, tokens)
            .is_some_and(|(_, n)| n + 1 >= tokens.len());
        if !covered {
            store.store(ns, tokens, caches, &crate::clock::now_utc());
        }
    }

    /// Keeps finished caches holding `tokens` for later requests: in the RAM tier, with the
    /// SSD tier (if on) getting what RAM evicts now and a write-behind snapshot later.
    pub(super) fn keep(
        &self,
        ns: &str,
        tokens: Vec<u32>,
        caches: Vec<Box<dyn crate::cache::Cache>>,
    ) {
        let mut ssd = self.ssd.borrow_mut();
        if ssd.is_some() {
            let mut pending = self.ssd_pending.borrow_mut();
            // Coalesced: an earlier pending prefix of the same conversation is superseded.
            pending.retain(|(n, t)| !(n == ns && tokens.starts_with(t)));
            pending.push((ns.to_owned(), tokens.clone()));
        }
        let evicted = self.prompt_cache.borrow_mut().put(ns, tokens, caches);
        if let Some(store) = ssd.as_mut() {
            for e in evicted {
                Self::write_ssd(store, &e.ns, &e.tokens, &e.caches);
                self.ssd_pending
                    .borrow_mut()
                    .retain(|(n, t)| !(*n == e.ns && *t == e.tokens));
            }
        }
        drop(ssd);
        self.sync_cache_stats();
    }

    /// Puts the session's caches in the prompt cache under the tokens they hold: the prompt
    /// and the generated ids fed back (a final EOS id may have been fed too; it is trimmed
    /// off, since it is not in `produced`).
    pub(super) fn keep_caches(&self, mut session: Session, prompt: &[u32], produced: Vec<u32>) {
        let mut tokens = prompt.to_vec();
        tokens.extend(produced);
        let caches = std::mem::take(&mut session.caches);
        drop(session);
        self.keep_fed(caches, tokens);
    }

    /// Keeps `caches` under the first tokens of `tokens` that every cache holds: caches
    /// holding more (an EOS fed, drafts past the last verify) are trimmed to that count;
    /// if one cannot be, nothing is kept.
    fn keep_fed(&self, mut caches: Vec<Box<dyn crate::cache::Cache>>, mut tokens: Vec<u32>) {
        let fed = crate::cache::common_len(&caches, tokens.len());
        for c in caches.iter_mut() {
            let extra = c.offset() - fed as i32;
            if extra > 0 && c.trim(extra) != extra {
                return;
            }
        }
        tokens.truncate(fed);
        self.keep("", tokens, caches);
    }

    /// Takes the longest usable cached prefix of `prompt`: from RAM, or from the SSD tier
    /// when it holds a strictly longer one (restored and trimmed to the match).
    pub(super) fn cache_take(&self, prompt: &[u32]) -> Option<crate::cache::prompt::Hit> {
        // No adapters yet: every request is in the base model's namespace.
        let hit = self.prompt_cache.borrow_mut().take("", prompt);
        let ram = hit.as_ref().map_or(0, |h| h.reused);
        let mut ssd = self.ssd.borrow_mut();
        let from_disk = ssd.as_mut().and_then(|store| {
            let (index, usable) = store.find("", prompt).filter(|&(_, n)| n > ram)?;
            let sdpa = self
                .opts
                .kv_quant
                .as_ref()
                .map_or(crate::cache::QuantSdpa::MlxLm, |p| p.sdpa);
            let caches = store.restore(index, usable, sdpa)?;
            Some(crate::cache::prompt::Hit {
                caches,
                reused: usable,
            })
        });
        drop(ssd);
        self.sync_cache_stats();
        from_disk.or(hit)
    }

    /// Mirrors the prompt cache's and the SSD tier's numbers for /stats.
    fn sync_cache_stats(&self) {
        if let Ok(mut stats) = self.prompt_cache_stats.lock() {
            *stats = self.prompt_cache.borrow().stats();
        }
        if let Ok(mut stats) = self.ssd_stats.lock() {
            *stats = self.ssd.borrow().as_ref().map(|s| s.stats());
        }
    }

    /// The chosen token's log-probability and the `top` most likely ones.
    pub(super) fn logprob(
        &self,
        id: u32,
        logprobs: &Array,
        top: usize,
    ) -> Result<TokenLogprob, mlx_rs::error::Exception> {
        let flat = logprobs.reshape(&[-1])?.as_dtype(mlx_rs::Dtype::Float32)?;
        let chosen = flat.index(id as i32);
        chosen.eval()?;
        // mlx_lm.server names tokens by their vocabulary strings (`Ġsky`), not decoded text.
        let decode = |i: u32| self.tokenizer.id_to_token(i).unwrap_or_default();
        let mut alternatives = Vec::new();
        if top > 0 {
            let order = argsort_axis(flat.negative()?, -1)?.index(..top as i32);
            let values = flat.take_axis(&order, 0)?;
            mlx_rs::transforms::eval([&order, &values])?;
            for (&i, &v) in order.as_slice::<u32>().iter().zip(values.as_slice::<f32>()) {
                alternatives.push((i, decode(i), v));
            }
        }
        Ok(TokenLogprob {
            id,
            token: decode(id),
            logprob: chosen.as_slice::<f32>()[0],
            top: alternatives,
        })
    }
}
