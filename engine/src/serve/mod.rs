//! `engine serve`: an OpenAI-compatible HTTP server, a drop-in for `mlx_lm.server`:
//! `/v1/chat/completions`, `/chat/completions`, `/v1/completions`, `/v1/models`, `/health`,
//! `/stats`; also `/metrics` (Prometheus), `/tokenize`, `/detokenize` (llama.cpp's). HTTP
//! runs on tokio + axum; the model runs on its own thread (`worker`).

mod adapter_routes;
pub mod adapters;
mod api;
mod args;
mod batch_lane;
pub mod budget;
mod dist_plan;
mod embeddings;
mod emit;
mod encode;
pub mod error;
mod fleet;
mod follower;
pub mod guard;
pub mod images;
mod lead;
mod lost;
pub mod messages;
pub mod metrics;
pub mod progress;
pub mod request;
pub mod responses;
mod routes;
pub mod store;
mod tokenize;
pub mod tools;
pub mod turn;
pub mod worker;
mod write_deadline;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::cache::prompt::PromptCache;
use crate::generate::SessionOptions;
use crate::load::config::ModelConfig;
use crate::load::template::ChatTemplate;
use crate::load::tokenizer::Tokenizer;

pub use args::ServeArgs;

/// The server's limits on a request, shared by the HTTP side and the model thread.
pub struct Limits {
    /// How long a client may read nothing before its request is cut (`--stall-timeout`).
    pub stall: Duration,
    /// A request's wall-clock limit from arrival (`--request-timeout`; None: none).
    pub request_timeout: Option<Duration>,
    /// Serial lane: how many requests take turns (`--interleave`).
    pub interleave: usize,
    /// Set on SIGTERM / Ctrl-C: new requests are refused.
    pub draining: AtomicBool,
    /// Set when the drain deadline passes: every request still running is cut.
    pub cut_all: AtomicBool,
}

impl Limits {
    fn from_args(args: &ServeArgs) -> anyhow::Result<Arc<Self>> {
        Ok(Arc::new(Limits {
            stall: seconds("stall-timeout", args.stall_timeout)?.unwrap_or(Duration::MAX),
            request_timeout: seconds("request-timeout", args.request_timeout)?,
            interleave: args.interleave.max(1),
            draining: Default::default(),
            cut_all: Default::default(),
        }))
    }
}

/// Counters for `/stats`.
#[derive(Default)]
pub struct Counters {
    pub requests: AtomicU64,
    pub completed: AtomicU64,
    pub failed: AtomicU64,
    pub cancelled: AtomicU64,
    pub rejected: AtomicU64,
    /// Refused with 429 because the queue was full (`--max-queue`).
    pub throttled: AtomicU64,
    /// Cut because the client stopped reading (`--stall-timeout`; also in `cancelled`).
    pub stalled: AtomicU64,
    /// Stopped at `--request-timeout`.
    pub timed_out: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub queued: AtomicUsize,
    pub running: AtomicUsize,
    /// Rows of the batch lane (0: serial lane only), and the most that decoded together.
    pub batch_slots: AtomicUsize,
    /// Why `--batch N` still serves on the serial lane (what the batch lane does not take).
    pub serial_reason: std::sync::OnceLock<&'static str>,
    pub batch_peak: AtomicUsize,
    /// Batch lane: rows that gave their slot up to a waiting request (parked).
    pub batch_parks: AtomicU64,
    /// Batch lane: steps its only row took alone (a single-sequence step, `Batch::for_lane`).
    pub batch_lone_steps: AtomicU64,
    /// Batch lane: rows stepped alone after a batched forward failed (`batch_lane::contain`).
    pub batch_retried_alone: AtomicU64,
    /// Batch lane: uncached prompts prefilled together, in one batched forward per step.
    pub batch_prompt_batches: AtomicU64,
    /// Speculative decoding (`--draft-model`): drafts proposed and accepted, verify passes,
    /// and requests that ran without it (their logits processors need the plain path).
    pub spec_drafted: AtomicU64,
    pub spec_accepted: AtomicU64,
    pub spec_target_calls: AtomicU64,
    pub spec_fallbacks: AtomicU64,
    /// Serial lane: one-token steps its requests ran through the compiled graph (the
    /// `WherePays` probe's choice, per request: `Session::compiled_steps`).
    pub compiled_steps: AtomicU64,
}

impl Counters {
    /// A request that ended in `e`: rejected when it is the request's fault (4xx), failed
    /// when it is the server's.
    pub fn count_error(&self, e: &error::ApiError) {
        let counter = match e.status.is_client_error() {
            true => &self.rejected,
            false => &self.failed,
        };
        counter.fetch_add(1, Ordering::Release);
    }

    /// A request refused before any handler counted it (the API-key guard): counted as a
    /// request, then as rejected, so `/stats` never shows more rejected than requests.
    pub fn refused_at_the_door(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.rejected.fetch_add(1, Ordering::Release);
    }
}

/// What the HTTP side shares.
pub struct AppState {
    pub model_id: String,
    pub created: u64,
    pub started: Instant,
    pub defaults: request::Defaults,
    /// The model thread's queue; taken (closed) when the server stops.
    pub jobs: std::sync::Mutex<Option<mpsc::Sender<worker::Work>>>,
    pub counters: Arc<Counters>,
    pub prompt_cache: Arc<std::sync::Mutex<crate::cache::prompt::PromptCacheStats>>,
    pub ssd_cache: Arc<std::sync::Mutex<Option<crate::cache::ssd::SsdStats>>>,
    pub next_id: std::sync::atomic::AtomicU64,
    /// API key, Host and Content-Type checks (`guard`).
    pub guard: guard::Guard,
    /// Timeouts, drain state (shared with the model thread).
    pub limits: Arc<Limits>,
    /// `--max-queue`.
    pub max_queue: usize,
    /// Prompt encoding, done on the HTTP side.
    pub encoder: Arc<worker::Encoder>,
    /// Big prompts are encoded one at a time.
    pub big_prompts: tokio::sync::Semaphore,
    /// The conversations of past `/v1/responses` answers (`previous_response_id`).
    pub responses: responses::store::Store,
    /// `/metrics` (`metrics`): this model's series in its server's registry.
    pub metrics: metrics::ModelMetrics,
    /// SSE keep-alive comments' interval (`--sse-keep-alive`; None: off): `progress::sse`.
    pub sse_keep_alive: Option<Duration>,
    /// `--embedding-pooling`.
    pub embedding_pooling: crate::embed::Pooling,
    /// The LoRA adapters mounted: names and use counts (`adapters`).
    pub adapters: adapters::Registry,
    /// `--memory-budget` (None: off).
    pub budget: Option<Arc<budget::Budget>>,
}

/// Seconds from a flag (0 = none); refuses what is not a finite, non-negative number.
fn seconds(flag: &str, secs: f64) -> anyhow::Result<Option<Duration>> {
    anyhow::ensure!(
        secs.is_finite() && secs >= 0.0,
        "--{flag} must be a number of seconds, 0 or more"
    );
    Ok((secs > 0.0).then(|| Duration::from_secs_f64(secs)))
}

/// What `run` works out from the flags before anything loads.
struct Config {
    context: usize,
    opts: SessionOptions,
    model_id: String,
    limits: Arc<Limits>,
    drain_timeout: Duration,
    tokenizer: Arc<Tokenizer>,
    template: Option<ChatTemplate>,
    /// The model's "tool_use" template, for requests with tools (transformers picks it).
    tool_template: Option<ChatTemplate>,
    /// Reasoning and tool-call markers (`tools::Markers`).
    markers: Arc<tools::Markers>,
    /// `--chat-template-args`.
    template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// `--sse-keep-alive`.
    sse_keep_alive: Option<Duration>,
    /// `--memory-budget`.
    budget: Option<Arc<budget::Budget>>,
}

/// `--chat-template-args`: a JSON object.
fn template_args(text: &str) -> anyhow::Result<serde_json::Map<String, serde_json::Value>> {
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Object(o)) => Ok(o),
        _ => anyhow::bail!(
            "--chat-template-args must be a JSON object, e.g. '{{\"enable_thinking\": false}}'"
        ),
    }
}

impl Config {
    /// The session options and context length the model thread needs before the rest of
    /// the configuration (it starts loading while the tokenizer loads).
    fn model_plan(args: &ServeArgs) -> anyhow::Result<(SessionOptions, usize)> {
        let config = ModelConfig::read(&args.model)?;
        let context = config.raw["max_position_embeddings"]
            .as_u64()
            .unwrap_or(131_072) as usize;
        // One memo for the process: every request's session after a probe takes its choice.
        let opts = args.tier.resolve(&args.model)?.sharing_probe_choices();
        Ok((opts, context))
    }

    fn from_args(args: &ServeArgs) -> anyhow::Result<Self> {
        let (opts, context) = Self::model_plan(args)?;
        let model_id = args
            .model
            .canonicalize()
            .unwrap_or_else(|_| args.model.clone())
            .display()
            .to_string();
        let limits = Limits::from_args(args)?;
        let drain_timeout = seconds("drain-timeout", args.drain_timeout)?.unwrap_or_default();
        // The tokenizer and template hold no MLX state: loaded here, shared by the HTTP side
        // (which encodes prompts) and the model thread (which decodes).
        let tokenizer = Arc::new(Tokenizer::load(&args.model)?);
        tokenizer.prepare_in_background();
        let template = match &args.chat_template {
            Some(src) => Some(ChatTemplate::new(src, &tokenizer)?),
            None => ChatTemplate::from_tokenizer(&tokenizer)?,
        };
        let names: Vec<&str> = tokenizer.chat_template_names().collect();
        let tool_template = match (&args.chat_template, names.contains(&"tool_use")) {
            (None, true) => Some(ChatTemplate::named(&tokenizer, "tool_use")?),
            _ => None,
        };
        // mlx-lm infers the tool parser from the template text when transformers exposes
        // one string (not a dict of named templates).
        let template_text = match &args.chat_template {
            Some(src) => Some(src.as_str()),
            None if names == ["default"] => tokenizer.chat_template(),
            None => None,
        };
        let markers = Arc::new(tools::Markers::detect(&tokenizer, template_text)?);
        let template_kwargs = template_args(&args.chat_template_args)?;
        anyhow::ensure!(
            args.draft_model.is_none() || args.num_draft_tokens >= 1,
            "--num-draft-tokens must be at least 1"
        );
        anyhow::ensure!(
            args.ssd_cache.is_none() || args.prompt_cache_size > 0,
            "--ssd-cache needs the RAM prompt cache (the SSD tier writes RAM entries behind): \
             drop --prompt-cache-size 0, or drop --ssd-cache"
        );
        let budget = budget::from_flag(args.memory_budget.as_deref())?;
        let budget_wait = seconds("budget-wait", args.budget_wait)?.unwrap_or_default();
        let budget = budget.map(|b| budget::Budget::new(b, budget_wait));
        Ok(Config {
            context,
            opts,
            model_id,
            limits,
            drain_timeout,
            tokenizer,
            template,
            tool_template,
            markers,
            template_kwargs,
            sse_keep_alive: seconds("sse-keep-alive", args.sse_keep_alive)?,
            budget,
        })
    }
}

/// What the model thread shares with the HTTP side.
struct Shared {
    tokenizer: Arc<Tokenizer>,
    markers: Arc<tools::Markers>,
    counters: Arc<Counters>,
    limits: Arc<Limits>,
    /// The prompt store's numbers, for /stats.
    mirror: store::StatsMirror,
    /// `--memory-budget`: measured and charged on the model thread at load.
    budget: Option<Arc<budget::Budget>>,
}

/// Loads the model, starts the model thread and serves until interrupted.
pub fn run(mut args: ServeArgs) -> anyhow::Result<()> {
    #[cfg(feature = "plant")]
    crate::plant::on_from_env().map_err(anyhow::Error::msg)?;
    let work = crate::constrain::Work {
        compile_fuel: args.grammar_compile_fuel,
        step_fuel: args.grammar_step_fuel,
        step_items: args.grammar_step_items,
    };
    anyhow::ensure!(
        work.compile_fuel > 0 && work.step_fuel > 0 && work.step_items > 0,
        "--grammar-compile-fuel, --grammar-step-fuel and --grammar-step-items must be above 0"
    );
    anyhow::ensure!(
        crate::constrain::set_work(work),
        "the grammar limits were set already in this process"
    );
    args.check_images()?;
    if fleet::wanted(&args) {
        return fleet::run(args);
    }
    args.model = args.models[0].clone();
    let group = dist_plan::join(&args)?;
    anyhow::ensure!(
        group.is_none() || args.adapter.is_empty(),
        "--adapter is not served by a distributed group (mlx.launch): serve adapters from \
         one process"
    );
    // The startup probe runs forwards on every rank; not yet planned in lockstep.
    anyhow::ensure!(
        group.is_none() || args.memory_budget.is_none(),
        "--memory-budget is not supported under mlx.launch yet; drop it there"
    );
    if group.is_some_and(|g| g.rank != 0) {
        let config = Config::from_args(&args)?;
        let shared = shared(&args, &config, Arc::new(Counters::default()));
        let worker = load_worker(&args, config.opts.clone(), config.context, || Ok(shared))?;
        return follower::follow(worker);
    }
    if group.is_some() {
        crate::dist::on_lost(lost::fail_open_requests);
    }
    let started = start_model(&args, Host::default())?;
    let (state, model_thread) = (started.state, started.thread);
    let drain_timeout = started.drain_timeout;
    warn_if_reachable(&args.host, &state.guard);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let app = routes::router(state.clone(), args.max_body_bytes, extra_routes());
    let limits = state.limits.clone();
    runtime.block_on(serve_http(
        &args,
        app,
        &state.model_id,
        limits,
        drain_timeout,
    ))?;
    // Close the queue; the model thread finishes (writing pending SSD snapshots) and ends.
    if let Ok(mut jobs) = state.jobs.lock() {
        jobs.take();
    }
    let _ = model_thread.join();
    // Encodings still running on the blocking pool are not waited for.
    runtime.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}

/// What the model thread shares with the HTTP side, for `args.model`.
fn shared(args: &ServeArgs, config: &Config, counters: Arc<Counters>) -> Shared {
    Shared {
        tokenizer: config.tokenizer.clone(),
        markers: config.markers.clone(),
        counters,
        limits: config.limits.clone(),
        mirror: store::StatsMirror {
            ram: Arc::new(Mutex::new(
                PromptCache::new(args.prompt_cache_size, args.prompt_cache_bytes).stats(),
            )),
            ssd: Default::default(),
        },
        budget: config.budget.clone(),
    }
}

/// One model being served: its HTTP side's state and its model thread.
struct Started {
    state: Arc<AppState>,
    thread: std::thread::JoinHandle<()>,
    drain_timeout: Duration,
}

/// What a model shares with the other models of its server (`fleet`); each None (the
/// default): its own, from the flags.
#[derive(Default)]
struct Host {
    counters: Arc<Counters>,
    limits: Option<Arc<Limits>>,
    budget: Option<Arc<budget::Budget>>,
    /// The server's metrics and this model's place in them.
    metrics: Option<(Arc<metrics::Metrics>, usize)>,
}

/// Loads `args.model` on a new model thread (returning once it has loaded) and builds its
/// HTTP side's state, sharing what `host` gives.
fn start_model(args: &ServeArgs, host: Host) -> anyhow::Result<Started> {
    let began = Instant::now();
    // The model thread loads the weights while this one loads the tokenizer and the
    // templates (on a 262 k vocabulary, half a second of the ready time; issue 43), then
    // hands it what the two sides share.
    let (opts, context) = Config::model_plan(args)?;
    let (shared_tx, shared_rx) = mpsc::channel::<Shared>();
    let (tx, rx) = mpsc::channel::<worker::Work>();
    let loading = spawn_model_thread(args, opts, context, shared_rx, rx)?;
    let mut config = match Config::from_args(args) {
        Ok(config) => config,
        Err(e) => {
            // The model thread stops once it sees no configuration coming.
            drop(shared_tx);
            let _ = loading.ready();
            return Err(e);
        }
    };
    if let Some(limits) = host.limits {
        config.limits = limits;
    }
    if host.budget.is_some() {
        config.budget = host.budget;
    }
    let shared = shared(args, &config, host.counters);
    let (counters, mirror) = (shared.counters.clone(), shared.mirror.clone());
    let _ = shared_tx.send(shared);
    let (thread, vocab) = loading.ready()?;
    let took = began.elapsed();
    let metrics = match host.metrics {
        Some((all, i)) => all.loaded(i, mirror.clone(), took),
        None => {
            let (name, budget) = (&config.model_id, config.budget.clone());
            metrics::ModelMetrics::single(name, counters.clone(), mirror.clone(), budget, took)
        }
    };
    let drain_timeout = config.drain_timeout;
    let state = Arc::new(app_state(
        args, config, counters, mirror, tx, vocab, metrics,
    ));
    register_pressure(&state);
    Ok(Started {
        state,
        thread,
        drain_timeout,
    })
}

/// Registers model `state`'s memory-budget pressure hook: a `Work::Trim` sent to its
/// thread while its queue is open (a weak reference: the hook never keeps an unloaded
/// model's state).
fn register_pressure(state: &Arc<AppState>) {
    let Some(b) = &state.budget else {
        return;
    };
    let weak: std::sync::Weak<AppState> = Arc::downgrade(state);
    b.on_pressure(&state.model_id, move || {
        let Some(s) = weak.upgrade() else {
            return;
        };
        let jobs = s.jobs.lock();
        if let Ok(Some(tx)) = jobs.as_deref() {
            let _ = tx.send(worker::Work::Trim);
        }
    });
}

/// The routes every model's router has beyond `routes::router`'s own.
fn extra_routes() -> axum::Router<Arc<AppState>> {
    responses::routes()
        .merge(messages::routes())
        .merge(metrics::routes())
        .merge(tokenize::routes())
        .merge(embeddings::routes())
        .merge(adapter_routes::routes())
}

/// Starts the model thread, which loads everything MLX touches itself (so MLX work stays
/// on it) and then serves `jobs`. Returns once it has loaded, with the model's vocabulary
/// size (request validation checks ids against it).
fn spawn_model_thread(
    args: &ServeArgs,
    opts: SessionOptions,
    context: usize,
    shared: mpsc::Receiver<Shared>,
    jobs: mpsc::Receiver<worker::Work>,
) -> anyhow::Result<Loading> {
    let args = args.clone();
    let (ready_tx, ready_rx) = mpsc::channel::<anyhow::Result<usize>>();
    let shared = move || {
        shared
            .recv()
            .context("the server's configuration did not load")
    };
    let thread = std::thread::Builder::new()
        .name("model".into())
        // The MLX turn is this thread's while it works (`turn`): from the load on.
        .spawn(
            move || match turn::keep(|| load_worker(&args, opts, context, shared)) {
                Ok(mut worker) => {
                    let slots = args.batch.max(1);
                    worker.dist = crate::dist::active().then(dist_plan::Leader::default);
                    // Why `--batch N` cannot batch, said before the server reports ready.
                    let lane = (slots > 1).then(|| worker.not_batchable());
                    match lane {
                        Some(Some(why)) => {
                            let _ = worker.counters.serial_reason.set(why);
                            eprintln!(
                                "engine serve: --batch {slots}: the batch lane does not take \
                                 {why}; requests are served one at a time"
                            );
                        }
                        // /stats shows the lane from the first request on.
                        Some(None) => worker.counters.batch_slots.store(slots, Ordering::Relaxed),
                        None => {}
                    }
                    let _ = ready_tx.send(Ok(worker.model.vocab_size()));
                    match lane {
                        Some(None) => {
                            worker.run_batched(jobs, slots);
                            drop(worker);
                        }
                        _ => worker.run(jobs),
                    }
                    // The model and its caches are dropped: MLX's buffer cache would keep
                    // their memory from the next model (`fleet` unloads so).
                    let _ = mlx_rs::memory::clear_cache();
                    turn::leave();
                }
                Err(e) => {
                    turn::leave();
                    let _ = ready_tx.send(Err(e));
                }
            },
        )?;
    Ok(Loading {
        thread,
        ready: ready_rx,
    })
}

/// A model thread that is loading.
struct Loading {
    thread: std::thread::JoinHandle<()>,
    ready: mpsc::Receiver<anyhow::Result<usize>>,
}

impl Loading {
    /// Waits for the load: the thread and the model's vocabulary size, or why it failed.
    fn ready(self) -> anyhow::Result<(std::thread::JoinHandle<()>, usize)> {
        let vocab = self
            .ready
            .recv()
            .context("the model thread exited while loading")??;
        Ok((self.thread, vocab))
    }
}

/// The model thread's worker: the model, the drafter (`--draft-model`) and the prompt
/// store, loaded on that thread.
fn load_worker(
    args: &ServeArgs,
    opts: SessionOptions,
    context: usize,
    shared: impl FnOnce() -> anyhow::Result<Shared>,
) -> anyhow::Result<worker::Worker> {
    // What the other models (fleet) hold before this one loads: not this one's weights.
    // (Taken whether or not a budget is kept: the configuration that says so comes later.)
    let before = budget::active()?;
    let model = crate::model::load(&args.model)?;
    let vision = match images::served(&args.model, args.text_only)? {
        // A tower that does not load leaves a text server: its image requests are refused.
        Ok(_) => match crate::vision::model::ImageModel::load(&args.model) {
            Ok(m) => Some(m),
            Err(e) => {
                eprintln!(
                    "engine serve: {}: the vision tower did not load ({e}); serving text only",
                    args.model.display()
                );
                None
            }
        },
        Err(_) => None,
    };
    let adapters = worker::adapters::Loaded::load(model.as_ref(), &args.adapter)?;
    // Other models' threads (fleet) take their steps meanwhile.
    let shared = turn::outside(shared)?;
    let draft = match &args.draft_model {
        None => None,
        Some(d) => Some((
            crate::generate::drafter::Drafter::load(d, model.as_ref(), &shared.tokenizer)
                .with_context(|| format!("loading the draft model from {}", d.display()))?,
            args.num_draft_tokens,
        )),
    };
    let ssd = open_ssd(args, model.as_ref(), draft.as_ref().map(|(d, _)| d), &opts)?;
    let sdpa = opts
        .kv_quant
        .as_ref()
        .map_or(crate::cache::QuantSdpa::MlxLm, |p| p.sdpa);
    let store = store::PromptStore::new(
        PromptCache::new(args.prompt_cache_size, args.prompt_cache_bytes),
        ssd,
        sdpa,
        Duration::from_millis(args.ssd_cache_debounce_ms),
        shared.mirror,
    );
    Ok(worker::Worker {
        store: std::cell::RefCell::new(store),
        model,
        draft,
        tokenizer: shared.tokenizer,
        markers: shared.markers.clone(),
        machine: Arc::new(shared.markers.machine()),
        opts,
        context,
        prefill_step: args.prefill_step_size.max(1),
        counters: shared.counters,
        limits: shared.limits,
        dist: None,
        embeds: Default::default(),
        adapters,
        budget: None,
        vision,
    })
    .and_then(|mut worker| {
        if let Some(b) = shared.budget {
            let loaded = budget::Loaded {
                model: worker.model.as_ref(),
                make_caches: &|| worker.make_caches(),
                opts: &worker.opts,
                prefill_step: worker.prefill_step,
                context: worker.context,
            };
            let key = budget::key(&args.model);
            budget::charge(loaded, &b, &key, before)?;
            worker.budget = Some(budget::Share { budget: b, key });
        }
        Ok(worker)
    })
}

/// The SSD tier (`--ssd-cache`), if on. Its entries must match this model, drafter, chat
/// template and KV plan (`cache::fingerprint`) and the caches' geometry.
fn open_ssd(
    args: &ServeArgs,
    model: &dyn crate::model::LanguageModel,
    draft: Option<&crate::generate::drafter::Drafter>,
    opts: &SessionOptions,
) -> anyhow::Result<Option<crate::cache::ssd::SsdStore>> {
    let Some(dir) = &args.ssd_cache else {
        return Ok(None);
    };
    // Entries are kept per adapter (their namespaces); the startup adapters are part of
    // the store's identity too.
    let adapter_dirs: Vec<std::path::PathBuf> =
        args.adapter.iter().map(|f| f.dir.clone()).collect();
    let sources = crate::cache::fingerprint::Sources {
        model: &args.model,
        draft: args.draft_model.as_deref(),
        adapters: &adapter_dirs,
        chat_template: args.chat_template.as_deref(),
        kv_plan: opts.kv_quant.as_ref(),
    };
    let id = crate::cache::fingerprint::fingerprint(&sources, dir)?.identity;
    // The session's caches: the model's, then a drafter model's (an assistant has none).
    let mut models = vec![model];
    if let Some(crate::generate::drafter::Drafter::Model(m)) = draft {
        models.push(m.as_ref());
    }
    let geometry = crate::cache::ssd::Geometry::probe(&models, opts.kv_quant.as_ref())?;
    if crate::cache::ssd::CacheSource::probe_caches(model)?
        .iter()
        .any(|c| c.snapshot().is_none())
    {
        eprintln!(
            "engine serve: --ssd-cache: this model's caches are never stored by the SSD tier \
             (dynamic RoPE recomputes its base from each call's last position, so a stored \
             prefix would not continue like a fresh prefill); the RAM prompt cache still serves"
        );
    }
    let max_bytes = (args.ssd_cache_max * (1u64 << 30) as f64) as u64;
    Ok(Some(crate::cache::ssd::SsdStore::open(
        dir,
        id,
        geometry,
        max_bytes,
        args.ssd_cache_verify,
    )?))
}

/// The HTTP side's state.
fn app_state(
    args: &ServeArgs,
    config: Config,
    counters: Arc<Counters>,
    mirror: store::StatsMirror,
    jobs: mpsc::Sender<worker::Work>,
    vocab: usize,
    metrics: metrics::ModelMetrics,
) -> AppState {
    let context = config.context;
    // The model thread loaded (or not) the vision tower by the same rule.
    let images = images::served(&args.model, args.text_only).unwrap_or_else(|e| Err(e.to_string()));
    AppState {
        adapters: adapters::Registry::new(&config.model_id, &args.adapter),
        model_id: config.model_id,
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        started: Instant::now(),
        defaults: request::Defaults {
            max_tokens: args.max_tokens,
            temp: args.temp,
            top_p: args.top_p,
            top_k: args.top_k,
            min_p: args.min_p,
            context,
            vocab,
            template_kwargs: config.template_kwargs,
            images: args.image_rules(images.as_ref().err().cloned()),
        },
        jobs: Mutex::new(Some(jobs)),
        counters,
        prompt_cache: mirror.ram,
        ssd_cache: mirror.ssd,
        next_id: Default::default(),
        guard: guard::Guard::new(&args.host, args.api_key.clone()),
        limits: config.limits,
        max_queue: if args.max_queue == 0 {
            usize::MAX
        } else {
            args.max_queue
        },
        encoder: Arc::new(worker::Encoder {
            tokenizer: config.tokenizer,
            template: config.template,
            tool_template: config.tool_template,
            markers: config.markers,
            context,
            vocab,
            images: images.ok(),
        }),
        big_prompts: tokio::sync::Semaphore::new(1),
        responses: Default::default(),
        metrics,
        sse_keep_alive: config.sse_keep_alive,
        embedding_pooling: args.embedding_pooling,
        budget: config.budget,
    }
}

/// Warns when `--host` is reachable from other machines.
fn warn_if_reachable(host: &str, guard: &guard::Guard) {
    if !guard.loopback_only {
        eprintln!(
            "engine serve: warning: --host {host} is reachable from other machines; this server \
             implements only basic security checks{}",
            if guard.api_key.is_none() {
                " and anyone who reaches it can use it (set --api-key)"
            } else {
                ""
            }
        );
    }
}

/// Serves HTTP until a stop signal; then drains: no new connections or requests, running
/// ones go on until they end or `drain_timeout` cuts them.
async fn serve_http(
    args: &ServeArgs,
    app: axum::Router,
    name: &str,
    limits: Arc<Limits>,
    drain_timeout: Duration,
) -> anyhow::Result<()> {
    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .with_context(|| format!("--host {} --port {}", args.host, args.port))?;
    let listener = listen(addr).with_context(|| {
        format!("cannot listen on {addr} (is another server using that port? try --port)")
    })?;
    let local = listener.local_addr()?;
    println!("engine serve: {name} on http://{local}");
    if !args.no_open && std::io::IsTerminal::is_terminal(&std::io::stdout()) {
        open_browser(&local);
    }
    let stopping = Arc::new(tokio::sync::Notify::new());
    let (signalled, marked) = (stopping.clone(), limits.clone());
    // Writes blocked for twice the stall timeout drop their connection (write_deadline):
    // twice, so that a blocked request is cut as stalled first, and counted so.
    let after = (limits.stall != Duration::MAX)
        .then(|| limits.stall.checked_mul(2))
        .flatten();
    let listener = write_deadline::Deadlined {
        inner: listener,
        after,
    };
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        stop_signal().await;
        marked.draining.store(true, Ordering::Relaxed);
        signalled.notify_one();
    });
    let mut server = std::pin::pin!(std::future::IntoFuture::into_future(server));
    tokio::select! {
        served = &mut server => served?,
        _ = async {
            stopping.notified().await;
            tokio::time::sleep(drain_timeout).await;
        } => {
            limits.cut_all.store(true, Ordering::Relaxed);
            // The cut requests' last events get a moment to reach clients that read;
            // connections of clients that do not are dropped with the runtime.
            let _ = tokio::time::timeout(Duration::from_secs(2), &mut server).await;
        }
    }
    Ok(())
}

/// What each connection's socket may hold unsent. Fixed (Linux grows an unset one to
/// megabytes), so that a client that stops reading fills it within a few hundred tokens
/// and the stall timeout sees it; accepted sockets inherit it from the listener.
const SEND_BUFFER: u32 = 16 << 10;

fn listen(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.set_send_buffer_size(SEND_BUFFER)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

/// Opens the chat page in the desktop's browser, if there is one (failures are ignored:
/// the address is printed anyway).
fn open_browser(addr: &SocketAddr) {
    let host = if addr.ip().is_unspecified() {
        "127.0.0.1".to_owned()
    } else {
        addr.ip().to_string()
    };
    let url = format!("http://{host}:{}/#/chat", addr.port());
    let opener = if cfg!(target_os = "macos") {
        "open"
    } else {
        "xdg-open"
    };
    let _ = std::process::Command::new(opener)
        .arg(&url)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn();
    println!("chat page: {url}");
}

/// Ctrl-C, or (Unix) SIGTERM — how a desktop shell or a service manager stops the server.
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
