//! `engine serve`: an OpenAI-compatible HTTP server, a drop-in for `mlx_lm.server`:
//! `/v1/chat/completions`, `/chat/completions`, `/v1/completions`, `/v1/models`, `/health`,
//! `/stats`. HTTP runs on tokio + axum; the model runs on its own thread (`worker`).

mod batch_lane;
mod emit;
pub mod error;
pub mod guard;
pub mod request;
mod routes;
pub mod store;
pub mod worker;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::time::Instant;

use anyhow::Context;

use crate::load::config::ModelConfig;
use crate::load::template::ChatTemplate;
use crate::load::tokenizer::Tokenizer;

/// `engine serve` flags (mlx_lm.server's, where they mean the same here).
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Model directory in Hugging Face layout.
    #[arg(long)]
    pub model: PathBuf,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0 picks a free one; the address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Default max_tokens of a request.
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    /// Default sampling temperature.
    #[arg(long, default_value_t = 0.0)]
    pub temp: f64,
    /// Default nucleus sampling top-p.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// Default top-k (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: i32,
    /// Default min-p (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f64,
    /// A chat template (Jinja source) to use instead of the tokenizer's.
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Prompt cache: how many entries (conversations' KV caches) to keep in RAM (0 = off).
    #[arg(long, default_value_t = 10)]
    pub prompt_cache_size: usize,
    /// Prompt cache: a cap on the bytes its entries hold (default: none).
    #[arg(long)]
    pub prompt_cache_bytes: Option<usize>,
    /// Prompt tokens per prefill chunk (mlx_lm.server's --prefill-step-size); in the batch
    /// lane, one chunk of an admitted prompt runs per decode step.
    #[arg(long, default_value_t = 2048)]
    pub prefill_step_size: usize,
    /// Batch lane: up to this many requests decode together in one forward (1 = the serial
    /// lane only). Full-attention models with dense caches only; others stay serial.
    #[arg(long, alias = "decode-concurrency", default_value_t = 1)]
    pub batch: usize,
    /// Speculative decoding: a smaller model sharing the tokenizer drafts tokens that the
    /// model verifies (mlx_lm.server's --draft-model). Requests run on the serial lane;
    /// requests with logits processors (penalties, logit bias) run without drafting.
    #[arg(long)]
    pub draft_model: Option<PathBuf>,
    /// Tokens drafted per verify pass (γ).
    #[arg(long, default_value_t = 3)]
    pub num_draft_tokens: usize,
    /// SSD tier: keep conversation prefixes in kv-store files under this directory, so a
    /// restarted server resumes them (docs/kv-store.md). Off without it.
    #[arg(long)]
    pub ssd_cache: Option<PathBuf>,
    /// SSD tier: the most it may hold, in GiB.
    #[arg(long, default_value_t = 32.0)]
    pub ssd_cache_max: f64,
    /// SSD tier: also check every tensor's SHA-256 when restoring (the header hash and
    /// every tensor's xxh3-64 checksum are always checked).
    #[arg(long)]
    pub ssd_cache_verify: bool,
    /// SSD tier: write a finished conversation to disk once no request has arrived for this
    /// many milliseconds (RAM evictions and shutdown write at once).
    #[arg(long, default_value_t = 500)]
    pub ssd_cache_debounce_ms: u64,
    /// Do not open the chat page in a browser (it opens by default when stdout is an
    /// interactive terminal).
    #[arg(long)]
    pub no_open: bool,
    /// Require `Authorization: Bearer KEY` on every API route (OpenAI clients send their
    /// api_key so); the chat page asks for it. Also read from ENGINE_API_KEY.
    #[arg(long, env = "ENGINE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Largest request body accepted, in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// Cut a request whose client has read nothing for this many seconds while its answer
    /// waits (0 = never).
    #[arg(long, default_value_t = 5.0)]
    pub stall_timeout: f64,
    /// Requests that may wait for the model (arrived, not yet running); more get 429 with
    /// Retry-After (0 = no cap).
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// A request's wall-clock limit in seconds from arrival, queueing included (0 = none);
    /// past it the request ends with a 504 error.
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout: f64,
    /// On SIGTERM / Ctrl-C: seconds running requests may take to finish before they are
    /// cut and the server exits.
    #[arg(long, default_value_t = 30.0)]
    pub drain_timeout: f64,
    /// Serial lane: up to this many requests take turns, one token each (1 = one at a time,
    /// in arrival order).
    #[arg(long, default_value_t = 8)]
    pub interleave: usize,
    #[command(flatten)]
    pub tier: crate::tiers::TierArgs,
}

/// What the HTTP side shares.
pub struct AppState {
    pub model_id: String,
    pub created: u64,
    pub started: Instant,
    pub defaults: request::Defaults,
    /// The model thread's queue; taken (closed) when the server stops.
    pub jobs: std::sync::Mutex<Option<mpsc::Sender<worker::Job>>>,
    pub counters: Arc<worker::Counters>,
    pub prompt_cache: Arc<std::sync::Mutex<crate::cache::prompt::PromptCacheStats>>,
    pub ssd_cache: Arc<std::sync::Mutex<Option<crate::cache::ssd::SsdStats>>>,
    pub next_id: std::sync::atomic::AtomicU64,
    /// API key, Host and Content-Type checks (`guard`).
    pub guard: guard::Guard,
    /// Timeouts, drain state (shared with the model thread).
    pub limits: Arc<worker::Limits>,
    /// `--max-queue`.
    pub max_queue: usize,
    /// Prompt encoding, done on the HTTP side.
    pub encoder: Arc<worker::Encoder>,
    /// Big prompts are encoded one at a time.
    pub big_prompts: tokio::sync::Semaphore,
}

/// Seconds from a flag (0 = none); refuses what is not a finite, non-negative number.
fn seconds(flag: &str, secs: f64) -> anyhow::Result<Option<std::time::Duration>> {
    anyhow::ensure!(
        secs.is_finite() && secs >= 0.0,
        "--{flag} must be a number of seconds, 0 or more"
    );
    Ok((secs > 0.0).then(|| std::time::Duration::from_secs_f64(secs)))
}

/// Loads the model, starts the model thread and serves until interrupted.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let config = ModelConfig::read(&args.model)?;
    let context = config.raw["max_position_embeddings"]
        .as_u64()
        .unwrap_or(131_072) as usize;
    let opts = args.tier.resolve(&args.model)?;
    let model_id = args
        .model
        .canonicalize()
        .unwrap_or_else(|_| args.model.clone())
        .display()
        .to_string();
    let counters = Arc::new(worker::Counters::default());
    let limits = Arc::new(worker::Limits {
        stall: seconds("stall-timeout", args.stall_timeout)?.unwrap_or(std::time::Duration::MAX),
        request_timeout: seconds("request-timeout", args.request_timeout)?,
        interleave: args.interleave.max(1),
        draining: Default::default(),
        cut_all: Default::default(),
    });
    let drain_timeout = seconds("drain-timeout", args.drain_timeout)?.unwrap_or_default();
    // The tokenizer and template hold no MLX state: loaded here, shared by the HTTP side
    // (which encodes prompts) and the model thread (which decodes).
    let tokenizer = Arc::new(Tokenizer::load(&args.model)?);
    let template = match &args.chat_template {
        Some(src) => Some(ChatTemplate::new(src, &tokenizer)?),
        None => ChatTemplate::from_tokenizer(&tokenizer)?,
    };
    let worker_tokenizer = tokenizer.clone();
    let worker_limits = limits.clone();
    let (tx, rx) = mpsc::channel::<worker::Job>();
    // The model thread loads everything MLX touches itself, so MLX work stays on it.
    // Ready with the model's vocabulary size (request validation checks ids against it).
    let (ready_tx, ready_rx) = mpsc::channel::<anyhow::Result<usize>>();
    let model_dir = args.model.clone();
    let worker_counters = counters.clone();
    let slots = args.batch.max(1);
    let prefill_step = args.prefill_step_size;
    let cache_caps = (args.prompt_cache_size, args.prompt_cache_bytes);
    let prompt_cache = Arc::new(std::sync::Mutex::new(
        crate::cache::prompt::PromptCache::new(cache_caps.0, cache_caps.1).stats(),
    ));
    let worker_cache_stats = prompt_cache.clone();
    let ssd_cache = Arc::new(std::sync::Mutex::new(None));
    let worker_ssd_stats = ssd_cache.clone();
    let ssd_args = (
        args.ssd_cache.clone(),
        (args.ssd_cache_max * (1u64 << 30) as f64) as u64,
        args.ssd_cache_verify,
    );
    let ssd_debounce = std::time::Duration::from_millis(args.ssd_cache_debounce_ms);
    let draft_dir = args.draft_model.clone();
    let num_draft = args.num_draft_tokens;
    anyhow::ensure!(
        draft_dir.is_none() || num_draft >= 1,
        "--num-draft-tokens must be at least 1"
    );
    // What the SSD tier's entries must match (cache::fingerprint), computed on the model
    // thread with --ssd-cache only.
    let fingerprint_template = args.chat_template.clone();
    let model_thread = std::thread::Builder::new()
        .name("model".into())
        .spawn(move || {
            let setup = (|| -> anyhow::Result<worker::Worker> {
                let model = crate::model::load(&model_dir)?;
                let tokenizer = worker_tokenizer;
                let draft = match &draft_dir {
                    None => None,
                    Some(d) => Some((
                        crate::generate::drafter::Drafter::load(d, model.as_ref(), &tokenizer)
                            .with_context(|| {
                                format!("loading the draft model from {}", d.display())
                            })?,
                        num_draft,
                    )),
                };
                let ssd = match &ssd_args.0 {
                    None => None,
                    Some(dir) => {
                        let sources = crate::cache::fingerprint::Sources {
                            model: &model_dir,
                            draft: draft_dir.as_deref(),
                            adapters: &[],
                            chat_template: fingerprint_template.as_deref(),
                            kv_plan: opts.kv_quant.as_ref(),
                        };
                        let id = crate::cache::fingerprint::fingerprint(&sources, dir)?.identity;
                        // The session's caches: the model's, then a drafter model's (an
                        // assistant has none).
                        let mut models = vec![model.as_ref()];
                        if let Some((crate::generate::drafter::Drafter::Model(m), _)) = &draft {
                            models.push(m.as_ref());
                        }
                        let geometry =
                            crate::cache::ssd::Geometry::probe(&models, opts.kv_quant.as_ref())?;
                        Some(crate::cache::ssd::SsdStore::open(
                            dir, id, geometry, ssd_args.1, ssd_args.2,
                        )?)
                    }
                };
                let sdpa = opts
                    .kv_quant
                    .as_ref()
                    .map_or(crate::cache::QuantSdpa::MlxLm, |p| p.sdpa);
                let store = store::PromptStore::new(
                    crate::cache::prompt::PromptCache::new(cache_caps.0, cache_caps.1),
                    ssd,
                    sdpa,
                    ssd_debounce,
                    store::StatsMirror {
                        ram: worker_cache_stats,
                        ssd: worker_ssd_stats,
                    },
                );
                Ok(worker::Worker {
                    store: std::cell::RefCell::new(store),
                    model,
                    draft,
                    tokenizer,
                    opts,
                    context,
                    prefill_step: prefill_step.max(1),
                    counters: worker_counters,
                    limits: worker_limits,
                })
            })();
            match setup {
                Ok(worker) => {
                    let _ = ready_tx.send(Ok(worker.model.vocab_size()));
                    if slots > 1 && worker.batchable() {
                        worker.run_batched(rx, slots);
                    } else {
                        worker.run(rx);
                    }
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })?;
    let vocab = ready_rx
        .recv()
        .context("the model thread exited while loading")??;
    let state = Arc::new(AppState {
        model_id,
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
        },
        jobs: std::sync::Mutex::new(Some(tx)),
        counters,
        prompt_cache,
        ssd_cache,
        next_id: Default::default(),
        guard: guard::Guard::new(&args.host, args.api_key.clone()),
        limits: limits.clone(),
        max_queue: if args.max_queue == 0 {
            usize::MAX
        } else {
            args.max_queue
        },
        encoder: Arc::new(worker::Encoder {
            tokenizer,
            template,
            context,
            vocab,
        }),
        big_prompts: tokio::sync::Semaphore::new(1),
    });
    if !state.guard.loopback_only {
        eprintln!(
            "engine serve: warning: --host {} is reachable from other machines; this server \
             implements only basic security checks{}",
            args.host,
            if state.guard.api_key.is_none() {
                " and anyone who reaches it can use it (set --api-key)"
            } else {
                ""
            }
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let served = state.clone();
    runtime.block_on(async move {
        let addr: SocketAddr = format!("{}:{}", args.host, args.port)
            .parse()
            .with_context(|| format!("--host {} --port {}", args.host, args.port))?;
        let listener = listen(addr).with_context(|| {
            format!("cannot listen on {addr} (is another server using that port? try --port)")
        })?;
        let local = listener.local_addr()?;
        println!("engine serve: {} on http://{local}", served.model_id);
        if !args.no_open && std::io::IsTerminal::is_terminal(&std::io::stdout()) {
            open_browser(&local);
        }
        let limits = served.limits.clone();
        let app = routes::router(served, args.max_body_bytes);
        // A stop signal starts the drain: no new connections or requests, running ones go
        // on until they end or the deadline cuts them.
        let stopping = Arc::new(tokio::sync::Notify::new());
        let (signalled, marked) = (stopping.clone(), limits.clone());
        let server = axum::serve(listener, app).with_graceful_shutdown(async move {
            stop_signal().await;
            marked
                .draining
                .store(true, std::sync::atomic::Ordering::Relaxed);
            signalled.notify_one();
        });
        let mut server = std::pin::pin!(std::future::IntoFuture::into_future(server));
        tokio::select! {
            served = &mut server => served?,
            _ = async {
                stopping.notified().await;
                tokio::time::sleep(drain_timeout).await;
            } => {
                limits
                    .cut_all
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                // The cut requests' last events get a moment to reach clients that read;
                // connections of clients that do not are dropped with the runtime.
                let _ = tokio::time::timeout(std::time::Duration::from_secs(2), &mut server).await;
            }
        }
        anyhow::Ok(())
    })?;
    // Close the queue; the model thread finishes (writing pending SSD snapshots) and ends.
    if let Ok(mut jobs) = state.jobs.lock() {
        jobs.take();
    }
    let _ = model_thread.join();
    // Encodings still running on the blocking pool are not waited for.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
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
