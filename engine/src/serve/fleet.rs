//! Many models in one server, loaded on demand (docs/serve.md, "Many models"): several
//! `--model`s or a `--models-dir`. Each loaded model is what a single-model server is (its
//! `AppState`, its model thread, its router); a front router (`front`) reads a request's
//! `model`, loads that model when it is not loaded and forwards the request, unchanged, to
//! its router. What Ollama and LM Studio's servers do for a local machine: a request names
//! a model, the least recently used model is unloaded to make room (`--max-models`), idle
//! ones after `--model-ttl`, never a `--pin`ned one.
//!
//! - A load runs off the tokio threads (its model thread takes the MLX turn, `turn`), one
//!   at a time; requests for a model being loaded wait for that load (up to
//!   `--load-timeout`), so a model never loads twice at once. A failed load fails the
//!   requests that waited for it, naming why; the next request tries again.
//! - A request holds a `Lease` on its model until its response's body ends (a stream's
//!   last event): a model with leases is never unloaded; room waits for one to go idle.
//! - Unloading closes the model's job queue and joins its model thread, which drops the
//!   model and its caches and clears MLX's buffer cache.
//! - A model's counters outlive its loads: /stats counts its requests across reloads.
//! - `--memory-budget`: one budget for every model (`budget`). Before a load, idle models
//!   are unloaded by LRU until the loaded weights, MLX's buffer cache, the new model's
//!   weights (its *.safetensors' sizes, an upper bound, until its load measures them) and
//!   one request's least need fit; a model that cannot fit is refused with the numbers:
//!   503 + Retry-After while busy models hold the room (they will free it), 400 when only
//!   pinned models hold it or the model alone is too big (no retry can help: the
//!   server's flags must change, as for a request too big for the budget).

mod catalog;
mod front;
mod room;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::StatusCode;

use super::error::ApiError;
use super::{AppState, Counters, Limits, ServeArgs};
use crate::plant::{self, Defect};
use catalog::Catalog;

/// Whether the flags ask for more than one model (one plain `--model` serves as before).
pub fn wanted(args: &ServeArgs) -> bool {
    args.models.len() > 1
        || args.models_dir.is_some()
        || args.max_models.is_some()
        || !args.pin.is_empty()
        || args.model_ttl != 0.0
}

/// A loaded model: its HTTP state, its router and its model thread.
struct Loaded {
    state: Arc<AppState>,
    router: axum::Router,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

enum Phase {
    Unloaded,
    Loading,
    Loaded(Arc<Loaded>),
    Unloading,
}

/// One model's life so far (under the entry's lock).
struct Life {
    phase: Phase,
    /// Requests holding the model (arrived, until their response ends).
    leases: usize,
    last_used: Instant,
    /// Seconds since the epoch of the last request's end or start (None: never used).
    last_used_unix: Option<u64>,
    /// Loads started, and the last failed one's number and reason (and the status its
    /// waiting requests get).
    attempts: u64,
    failed: Option<(u64, String)>,
    failed_status: StatusCode,
    /// With a budget: its least request need and MLX buffer cache as its last load
    /// measured them (what the next load makes room for beside its weights).
    least: Option<(u64, u64)>,
    /// The last try at loading it measured `least` for the first time.
    least_first_measured: bool,
    loads: u64,
    unloads: u64,
    load_ms: Option<f64>,
}

/// A configured model.
struct Entry {
    spec: catalog::Spec,
    pinned: bool,
    counters: Arc<Counters>,
    life: Mutex<Life>,
}

impl Entry {
    fn life(&self) -> std::sync::MutexGuard<'_, Life> {
        self.life.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The models and what decides which are loaded.
pub struct Fleet {
    args: ServeArgs,
    catalog: Catalog,
    entries: Vec<Entry>,
    max_models: usize,
    ttl: Option<Duration>,
    load_timeout: Duration,
    /// Shared by every model's state (drain, timeouts).
    limits: Arc<Limits>,
    /// `--memory-budget`, shared by every model (None: off).
    budget: Option<Arc<super::budget::Budget>>,
    /// Bumped on every change of a phase or a lease count; waiters watch it.
    changed: tokio::sync::watch::Sender<u64>,
    /// One load, or unload to make room, at a time.
    loader: tokio::sync::Mutex<()>,
    /// Every model's series, labelled by its name (`metrics`).
    metrics: Arc<super::metrics::Metrics>,
    started: Instant,
    /// Unix seconds at startup (`/v1/models`' `created`).
    created: u64,
}

/// A request's hold on its model (see the module doc).
pub struct Lease {
    fleet: Arc<Fleet>,
    index: usize,
    loaded: Arc<Loaded>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let entry = &self.fleet.entries[self.index];
        {
            let mut life = entry.life();
            life.leases -= 1;
            life.last_used = Instant::now();
            life.last_used_unix = Some(unix_now());
        }
        self.fleet.bump();
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn seconds(flag: &str, secs: f64) -> anyhow::Result<Option<Duration>> {
    super::seconds(flag, secs)
}

impl Fleet {
    fn new(args: ServeArgs) -> anyhow::Result<Self> {
        anyhow::ensure!(
            args.draft_model.is_none() && args.chat_template.is_none() && args.ssd_cache.is_none(),
            "--draft-model, --chat-template and --ssd-cache are one model's: serve that model \
             alone (one --model) to use them"
        );
        let catalog = Catalog::new(&args.models, args.models_dir.as_deref())?;
        let mut pinned = vec![false; catalog.specs.len()];
        for name in &args.pin {
            let i = catalog.exact(name).ok_or_else(|| {
                anyhow::anyhow!(
                    "--pin {name:?}: no such model; the models are {:?}",
                    catalog.names()
                )
            })?;
            pinned[i] = true;
        }
        let pins = pinned.iter().filter(|p| **p).count();
        // One model at a time unless pins need more: loading a second model must never run
        // a machine out of memory unasked; --max-models raises it.
        let max_models = args.max_models.unwrap_or(pins.max(1));
        anyhow::ensure!(max_models >= 1, "--max-models must be at least 1");
        anyhow::ensure!(
            pins <= max_models,
            "--pin names {pins} models but --max-models is {max_models}: pinned models are \
             never unloaded, so raise --max-models to at least {pins}"
        );
        let limits = Limits::from_args(&args)?;
        let budget_wait = seconds("budget-wait", args.budget_wait)?.unwrap_or_default();
        let budget = super::budget::from_flag(args.memory_budget.as_deref())?
            .map(|b| super::budget::Budget::new(b, budget_wait));
        let entries: Vec<Entry> = catalog
            .specs
            .iter()
            .zip(pinned)
            .map(|(spec, pinned)| Entry {
                spec: spec.clone(),
                pinned,
                counters: Default::default(),
                life: Mutex::new(Life {
                    phase: Phase::Unloaded,
                    leases: 0,
                    last_used: Instant::now(),
                    last_used_unix: None,
                    attempts: 0,
                    failed: None,
                    failed_status: StatusCode::INTERNAL_SERVER_ERROR,
                    least: None,
                    least_first_measured: false,
                    loads: 0,
                    unloads: 0,
                    load_ms: None,
                }),
            })
            .collect();
        let models = entries
            .iter()
            .map(|e| (e.spec.name.clone(), e.counters.clone()))
            .collect();
        Ok(Fleet {
            metrics: super::metrics::Metrics::new(models, budget.clone()),
            ttl: seconds("model-ttl", args.model_ttl)?,
            load_timeout: match plant::is(Defect::FleetLoadTimeoutIgnored) {
                true => Duration::MAX,
                false => seconds("load-timeout", args.load_timeout)?.unwrap_or(Duration::MAX),
            },
            args,
            catalog,
            entries,
            max_models,
            limits,
            budget,
            changed: tokio::sync::watch::channel(0).0,
            loader: Default::default(),
            started: Instant::now(),
            created: unix_now(),
        })
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A lease on model `i`, loading it (or waiting for its load) as needed.
    pub async fn acquire(self: &Arc<Self>, i: usize) -> Result<Lease, ApiError> {
        let entry = &self.entries[i];
        let deadline = tokio::time::Instant::now()
            .checked_add(self.load_timeout)
            .unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(86_400 * 365));
        let mut waited_on = None;
        loop {
            let mut changed = self.changed.subscribe();
            {
                let mut life = entry.life();
                match &life.phase {
                    Phase::Loaded(loaded) => {
                        let loaded = loaded.clone();
                        life.leases += 1;
                        life.last_used = Instant::now();
                        life.last_used_unix = Some(unix_now());
                        return Ok(Lease {
                            fleet: self.clone(),
                            index: i,
                            loaded,
                        });
                    }
                    Phase::Loading if plant::is(Defect::FleetLoadsTwice) && waited_on.is_none() => {
                        life.attempts += 1;
                        waited_on = Some(life.attempts);
                        tokio::spawn(self.clone().load(i));
                    }
                    Phase::Loading => {
                        waited_on.get_or_insert(life.attempts);
                    }
                    Phase::Unloading => {}
                    Phase::Unloaded => {
                        if let (Some(k), Some((failed, why))) = (waited_on, &life.failed) {
                            if *failed == k {
                                let e =
                                    format!("model {} could not be loaded: {why}", entry.spec.name);
                                return Err(match life.failed_status {
                                    StatusCode::BAD_REQUEST => ApiError::invalid(e),
                                    status => ApiError::server(e).with_status(status),
                                });
                            }
                        }
                        life.phase = Phase::Loading;
                        life.attempts += 1;
                        waited_on = Some(life.attempts);
                        tokio::spawn(self.clone().load(i));
                    }
                }
            }
            if tokio::time::timeout_at(deadline, changed.changed())
                .await
                .is_err()
            {
                return Err(ApiError::server(format!(
                    "model {} is not loaded yet after {:.0} s (--load-timeout); it goes on \
                     loading: retry later",
                    entry.spec.name,
                    self.load_timeout.as_secs_f64()
                ))
                .with_status(StatusCode::SERVICE_UNAVAILABLE));
            }
        }
    }

    /// Loads model `i` (its phase is Loading), making room first. A first load under a
    /// budget makes room for an estimate (its weights' files, the least request of the
    /// models loaded); when its own check then finds its measured need does not fit, the
    /// load is tried once more, making room for what it measured (so the client gets the
    /// model, or a 400/503 with the numbers, not the failed check).
    async fn load(self: Arc<Self>, i: usize) {
        let _one = self.loader.lock().await;
        let entry = &self.entries[i];
        let mut result = self.try_load(i).await;
        if let Err((_, why)) = &result {
            let measured_now = self.budget.is_some() && entry.life().least_first_measured;
            if measured_now && !plant::is(Defect::FleetFirstLoadNotRetried) {
                eprintln!(
                    "engine serve: {} needs more than estimated ({why}); making room for \
                     its measured need and loading again",
                    entry.spec.name
                );
                result = self.try_load(i).await;
            }
        }
        {
            let mut life = entry.life();
            match result {
                Ok((started, took)) => {
                    let router = super::routes::router(
                        started.state.clone(),
                        self.args.max_body_bytes,
                        super::extra_routes(),
                    );
                    life.phase = Phase::Loaded(Arc::new(Loaded {
                        state: started.state,
                        router,
                        thread: Mutex::new(Some(started.thread)),
                    }));
                    life.loads += 1;
                    life.load_ms = Some(took.as_secs_f64() * 1e3);
                    life.last_used = Instant::now();
                    eprintln!(
                        "engine serve: loaded {} in {:.0} ms",
                        entry.spec.name,
                        took.as_secs_f64() * 1e3
                    );
                }
                Err((status, why)) => {
                    eprintln!("engine serve: cannot load {}: {why}", entry.spec.name);
                    life.phase = Phase::Unloaded;
                    life.failed = Some((life.attempts, why));
                    life.failed_status = status;
                }
            }
        }
        self.bump();
    }

    /// One try at loading model `i`: room made, weights held, the model started; its
    /// measured least need recorded even when its own check refused it.
    async fn try_load(
        self: &Arc<Self>,
        i: usize,
    ) -> Result<(super::Started, Duration), (StatusCode, String)> {
        let entry = &self.entries[i];
        let estimate = self
            .budget
            .as_ref()
            .map(|_| room::weights_estimate(&entry.spec.path));
        let key = super::budget::key(&entry.spec.path);
        let made = match self.make_room(i, estimate).await {
            // Held until the load measures the weights (`budget::charge` replaces it).
            Ok(()) => self.hold_weights(&key, estimate).await,
            Err(why) => Err(why),
        };
        let result = match made {
            Err(why) => Err(why),
            Ok(()) => {
                let mut args = self.args.clone();
                args.model = entry.spec.path.clone();
                // `--adapter`s are the default model's; other models mount theirs at run
                // time (`POST /v1/adapters` with the model named).
                if i != 0 && !plant::is(Defect::FleetAdaptersOnEveryModel) {
                    args.adapter.clear();
                }
                let host = super::Host {
                    counters: entry.counters.clone(),
                    limits: Some(self.limits.clone()),
                    budget: self.budget.clone(),
                    metrics: Some((self.metrics.clone(), i)),
                };
                let started = Instant::now();
                tokio::task::spawn_blocking(move || {
                    super::start_model(&args, host).map(|s| (s, started.elapsed()))
                })
                .await
                .map_err(|e| format!("the load stopped: {e}"))
                .and_then(|r| r.map_err(|e| format!("{e:#}")))
                .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e))
            }
        };
        let least = self.budget.as_ref().and_then(|b| b.least(&key));
        if let (Err(_), Some(b)) = (&result, &self.budget) {
            b.release_weights(&key);
        }
        // Measured even when the load's own check refused it: the next try makes room for
        // what it really needs.
        let mut life = entry.life();
        life.least_first_measured = life.least.is_none() && least.is_some();
        life.least = least.or(life.least);
        result
    }

    /// Unloads least recently used models until model `keep` fits in `--max-models`
    /// (never a pinned one, never one with leases: those are waited for, up to
    /// `--load-timeout`) and, with a memory budget, until `bytes` (model `keep`'s weights'
    /// estimate) fit beside the loaded models (see the module doc).
    async fn make_room(&self, keep: usize, bytes: Option<u64>) -> Result<(), (StatusCode, String)> {
        let deadline = tokio::time::Instant::now()
            .checked_add(self.load_timeout)
            .unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(86_400 * 365));
        loop {
            let mut changed = self.changed.subscribe();
            let mut held = 0;
            let mut victim: Option<(usize, Instant)> = None;
            let mut busy = 0;
            for (j, e) in self.entries.iter().enumerate() {
                if j == keep {
                    continue;
                }
                let life = e.life();
                if matches!(life.phase, Phase::Unloaded) {
                    continue;
                }
                held += 1;
                if !matches!(life.phase, Phase::Loaded(_)) || e.pinned {
                    continue;
                }
                if life.leases > 0 {
                    busy += 1;
                } else if victim.is_none_or(|(_, t)| life.last_used < t) {
                    victim = Some((j, life.last_used));
                }
            }
            let short = self.memory_short(keep, bytes);
            if held < self.max_models && short.is_none() {
                return Ok(());
            }
            if let Some((j, _)) = victim {
                self.unload(j).await;
                continue;
            }
            if busy == 0 {
                return Err(match short {
                    Some(why) => (
                        StatusCode::BAD_REQUEST,
                        format!(
                            "{why}; start the server with a bigger --memory-budget or fewer --pin"
                        ),
                    ),
                    None => (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!(
                            "every one of the {} model slots holds a pinned model; raise \
                             --max-models",
                            self.max_models
                        ),
                    ),
                });
            }
            if tokio::time::timeout_at(deadline, changed.changed())
                .await
                .is_err()
            {
                let why = match short {
                    Some(why) => format!(
                        "{why}, and the models holding it stayed busy for {:.0} s \
                         (--load-timeout); retry later, or start the server with a bigger \
                         --memory-budget",
                        self.load_timeout.as_secs_f64()
                    ),
                    None => format!(
                        "the {} loaded models stayed busy for {:.0} s (--load-timeout); raise \
                         --max-models or retry later",
                        self.max_models,
                        self.load_timeout.as_secs_f64()
                    ),
                };
                return Err((StatusCode::SERVICE_UNAVAILABLE, why));
            }
        }
    }

    /// Unloads model `j` if it is loaded and idle: closes its queue, joins its model thread
    /// (off the tokio threads). The caller holds `loader`.
    async fn unload(&self, j: usize) {
        let entry = &self.entries[j];
        let loaded = {
            let mut life = entry.life();
            match &life.phase {
                Phase::Loaded(l) if life.leases == 0 => {
                    let l = l.clone();
                    life.phase = Phase::Unloading;
                    l
                }
                _ => return,
            }
        };
        self.bump();
        let name = loaded.state.model_id.clone();
        let _ = tokio::task::spawn_blocking(move || stop(&loaded)).await;
        // Its model thread has ended: its weights and bounds leave the ledger.
        if let Some(b) = &self.budget {
            b.release_weights(&name);
        }
        {
            let mut life = entry.life();
            life.phase = Phase::Unloaded;
            life.unloads += 1;
        }
        self.metrics.unloaded(j);
        eprintln!("engine serve: unloaded {}", entry.spec.name);
        self.bump();
    }

    /// Unloads the idle models past `--model-ttl` (not pinned ones).
    async fn expire(&self) {
        let Some(ttl) = self.ttl else { return };
        if plant::is(Defect::FleetTtlIgnored) {
            return;
        }
        for (j, e) in self.entries.iter().enumerate() {
            let idle = {
                let life = e.life();
                !e.pinned
                    && matches!(life.phase, Phase::Loaded(_))
                    && life.leases == 0
                    && life.last_used.elapsed() >= ttl
            };
            if idle {
                let _one = self.loader.lock().await;
                let still = {
                    let life = e.life();
                    life.leases == 0 && life.last_used.elapsed() >= ttl
                };
                if still {
                    self.unload(j).await;
                }
            }
        }
    }

    /// Every loaded model's state (for shutdown).
    fn all_loaded(&self) -> Vec<Arc<Loaded>> {
        self.entries
            .iter()
            .filter_map(|e| match &e.life().phase {
                Phase::Loaded(l) => Some(l.clone()),
                _ => None,
            })
            .collect()
    }
}

/// Closes a model's queue and waits for its model thread to end (it finishes what it
/// holds, drops the model and clears MLX's buffer cache).
fn stop(loaded: &Loaded) {
    if let Ok(mut jobs) = loaded.state.jobs.lock() {
        jobs.take();
    }
    let thread = loaded.thread.lock().ok().and_then(|mut t| t.take());
    if let Some(thread) = thread {
        let _ = thread.join();
    }
}

/// Serves the configured models until interrupted.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        std::env::var_os("MLX_RANK").is_none(),
        "several models are not served under mlx.launch; serve one --model there"
    );
    let fleet = Arc::new(Fleet::new(args)?);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let guard = super::guard::Guard::new(&fleet.args.host, fleet.args.api_key.clone());
    super::warn_if_reachable(&fleet.args.host, &guard);
    runtime.block_on(async {
        // The pinned models, then the default where there is room: loaded before the
        // server reports its address, so that a ready server answers at once.
        let mut first: Vec<usize> = (0..fleet.entries.len())
            .filter(|&i| fleet.entries[i].pinned)
            .collect();
        if !fleet.entries[0].pinned && first.len() < fleet.max_models {
            first.push(0);
        }
        for i in first {
            fleet.entries[i].life().phase = Phase::Loading;
            fleet.entries[i].life().attempts += 1;
            fleet.clone().load(i).await;
            if let Some((_, why)) = &fleet.entries[i].life().failed {
                anyhow::bail!("{}: {why}", fleet.entries[i].spec.name);
            }
        }
        if let Some(ttl) = fleet.ttl {
            let tick = (ttl / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
            let f = fleet.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(tick).await;
                    f.expire().await;
                }
            });
        }
        let app = front::router(fleet.clone(), guard);
        let name = fleet.catalog.names().join(", ");
        let drain = seconds("drain-timeout", fleet.args.drain_timeout)?.unwrap_or_default();
        super::serve_http(&fleet.args, app, &name, fleet.limits.clone(), drain).await
    })?;
    for loaded in fleet.all_loaded() {
        stop(&loaded);
    }
    runtime.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}
