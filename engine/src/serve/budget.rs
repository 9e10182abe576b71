//! `--memory-budget`: a bound on the memory a server's MLX work holds, never exceeded by
//! design (mlx-lm's server has none; a flood of long prompts grows its KV caches and prompt
//! cache until Metal aborts). The ledger, per server (one `Arc<Budget>`, shared by every
//! model a server loads):
//!
//! ```text
//! budget ≥ weights + mlx_cache + Σ reservations + prompt cache
//! reservation(request) = kv(T) + act(P, T),  P = prompt, T = prompt + max_tokens
//! kv(T)     = kv_fixed + kv_per_token × (T + 256)
//! act(P, T) = act_chunk + act_per_token × max(0, P − prefill_step)
//!             + ⌈act_per_token / prefill_step⌉ × T
//! mlx_cache = act_chunk
//! ```
//!
//! - `weights`: each loaded model's resident bytes (`reserve_weights`), measured on the model
//!   thread (MLX active memory with nothing else alive).
//! - `kv`: measured at startup (`probe`): fresh caches after 1 and after 257 prompt tokens;
//!   K/V buffers grow in steps of 256 (mlx-lm's `KVCache.step`), so a cache holding T
//!   tokens has at most T + 256 slots; constant-size states (recurrent layers, full sliding
//!   windows) land in `kv_fixed`, and a window that stops growing is over-counted (an upper
//!   bound). The caches' real dtype and quantization (`--kv-bits`) are what is measured.
//! - `act`: MLX's peak over one prefill chunk of `--prefill-step-size` tokens beyond what
//!   was held before it, measured at startup on fresh caches (`act_chunk`) and after
//!   `ACT_PROBE_OFFSET` tokens: a chunk's attention scores and its caches' growth (the old
//!   buffers live until the new ones are written) grow with the tokens it attends to,
//!   linearly for a fixed chunk (`act_per_token`); a decode step is a chunk of one token
//!   attending to at most T.
//! - `mlx_cache`: MLX's buffer cache (freed buffers it keeps for reuse) is capped to
//!   `act_chunk` (`mlx_rs::memory::set_cache_limit`).
//!
//! Admission (`admit`, on the HTTP side, before a request is queued): a request whose need
//! cannot fit even alone is refused (400, naming the numbers and the fix); otherwise it
//! waits for its reservation (up to `--budget-wait` or its request timeout), then gets 429
//! with Retry-After. The reservation travels with the job and is released when the request
//! ends, however it ends. The model thread trims the RAM prompt cache to
//! `budget − weights − mlx_cache − reserved` before each prompt lookup and after keeping an
//! entry (`Budget::prompt_cache_room`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::plant::{self, Defect};

/// K/V buffers grow by this many tokens (mlx-lm's `KVCache.step`).
pub const KV_STEP: u64 = 256;

/// `auto`: this share of physical memory (docs/serve.md says why).
pub const AUTO_PERCENT: f64 = 75.0;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecError {
    #[error(
        "--memory-budget {0:?}: not a size; accepted forms: bytes (123456), bytes with a unit \
         (6GB, 6GiB, 512MiB, 1.5G: KB/MB/GB/TB are powers of 1000, K/M/G/T and KiB/MiB/GiB/TiB \
         powers of 1024), a share of physical memory (70%), or auto ({AUTO_PERCENT}% of \
         physical memory)"
    )]
    Syntax(String),
    #[error("--memory-budget {0:?}: a share of physical memory must be over 0% and at most 100%")]
    Percent(String),
    #[error("--memory-budget {0:?}: must be more than 0 bytes")]
    Zero(String),
    #[error(
        "--memory-budget {0}: this system's physical memory size cannot be read \
         (/proc/meminfo or sysctl hw.memsize); give the budget in bytes, e.g. 6GB"
    )]
    NoPhysical(String),
}

/// A parsed `--memory-budget`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Spec {
    Bytes(u64),
    Percent(f64),
    Auto,
}

/// Parses `BYTES|PERCENT|auto` (see `SpecError::Syntax` for the forms).
pub fn parse(text: &str) -> Result<Spec, SpecError> {
    let t = text.trim();
    let syntax = || SpecError::Syntax(text.to_owned());
    if t.eq_ignore_ascii_case("auto") {
        return Ok(Spec::Auto);
    }
    if let Some(p) = t.strip_suffix('%') {
        let v: f64 = p.trim().parse().map_err(|_| syntax())?;
        if !(v.is_finite() && v > 0.0 && v <= 100.0) {
            return Err(SpecError::Percent(text.to_owned()));
        }
        return Ok(Spec::Percent(v));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let unit = unit.trim();
    let scale: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        _ => return Err(syntax()),
    };
    if number.is_empty() || number == "." {
        return Err(syntax());
    }
    let bytes = if number.contains('.') {
        let v: f64 = number.parse().map_err(|_| syntax())?;
        let b = v * scale as f64;
        if !(b.is_finite() && b < u64::MAX as f64) {
            return Err(syntax());
        }
        b as u64
    } else {
        let v: u64 = number.parse().map_err(|_| syntax())?;
        v.checked_mul(scale).ok_or_else(syntax)?
    };
    if bytes == 0 {
        return Err(SpecError::Zero(text.to_owned()));
    }
    Ok(Spec::Bytes(bytes))
}

impl Spec {
    /// The budget in bytes, given physical memory (None: unknown).
    pub fn resolve(self, text: &str, physical: Option<u64>) -> Result<u64, SpecError> {
        let share = |p: f64| {
            physical
                .map(|m| (m as f64 * p / 100.0) as u64)
                .ok_or_else(|| SpecError::NoPhysical(text.to_owned()))
        };
        match self {
            Spec::Bytes(b) => Ok(b),
            Spec::Percent(p) => share(p),
            Spec::Auto => share(AUTO_PERCENT),
        }
    }
}

/// `--memory-budget` as bytes (None: no budget).
pub fn from_flag(flag: Option<&str>) -> Result<Option<u64>, SpecError> {
    flag.map(|text| parse(text)?.resolve(text, physical_memory()))
        .transpose()
}

/// Physical memory in bytes: Linux's /proc/meminfo MemTotal, macOS's `sysctl hw.memsize`.
pub fn physical_memory() -> Option<u64> {
    if let Ok(info) = std::fs::read_to_string("/proc/meminfo") {
        return meminfo_field(&info, "MemTotal:");
    }
    let out = std::process::Command::new("sysctl")
        .args(["-n", "hw.memsize"])
        .output()
        .ok()?;
    String::from_utf8(out.stdout).ok()?.trim().parse().ok()
}

/// A `kB` field of /proc/meminfo or /proc/self/status, in bytes.
fn meminfo_field(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line[key.len()..].split_whitespace().next()?.parse().ok()?;
    Some(kb * 1024)
}

/// The process's peak resident set (Linux's VmHWM; None elsewhere).
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    meminfo_field(&status, "VmHWM:")
}

/// Tokens already in the caches when the second activation probe's chunk runs.
pub const ACT_PROBE_OFFSET: u64 = 512;

/// Activation bytes of a request of P prompt tokens and T in all: prefill chunks attend to
/// at most P tokens, decode steps (one token each) to at most T:
/// `at_chunk + per_token × max(0, P − chunk) + ⌈per_token / chunk⌉ × T`.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct ActBound {
    pub at_chunk: u64,
    pub per_token: u64,
    pub chunk: u64,
}

impl ActBound {
    /// From a chunk's peaks on fresh caches and after `ACT_PROBE_OFFSET` tokens.
    pub fn from_probe(chunk: u64, fresh: u64, deeper: u64) -> Self {
        ActBound {
            at_chunk: fresh,
            per_token: deeper.saturating_sub(fresh).div_ceil(ACT_PROBE_OFFSET),
            chunk,
        }
    }

    pub fn bytes(&self, prompt: u64, total: u64) -> u64 {
        let decode = self.per_token.div_ceil(self.chunk.max(1));
        self.at_chunk
            .saturating_add(
                self.per_token
                    .saturating_mul(prompt.saturating_sub(self.chunk)),
            )
            .saturating_add(decode.saturating_mul(total))
    }
}

/// KV bytes as a function of tokens held: `fixed + per_token × (T + KV_STEP)`.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct KvBound {
    pub fixed: u64,
    pub per_token: u64,
}

impl KvBound {
    /// From caches' bytes measured after 1 token (one step of slots) and after
    /// `KV_STEP + 1` tokens (two steps).
    pub fn from_probe(after_one: u64, after_step_plus_one: u64) -> Self {
        let per_token = after_step_plus_one
            .saturating_sub(after_one)
            .div_ceil(KV_STEP);
        KvBound {
            fixed: after_one.saturating_sub(per_token * KV_STEP),
            per_token,
        }
    }

    pub fn bytes(&self, tokens: u64) -> u64 {
        self.fixed
            .saturating_add(self.per_token.saturating_mul(tokens + KV_STEP))
    }
}

/// What a request needs reserved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Need {
    pub prompt_tokens: usize,
    pub max_tokens: usize,
    pub kv: u64,
    pub activations: u64,
}

impl Need {
    pub fn bytes(&self) -> u64 {
        self.kv + self.activations
    }
}

/// Why a request got no reservation.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Refusal {
    #[error(
        "this request cannot fit in the server's memory budget: {} prompt tokens + max_tokens \
         {} need {} bytes (KV cache {} + activations {}), and the budget of {} bytes holds \
         {} bytes of model weights and {} of MLX buffer cache, leaving {} bytes; send a \
         smaller max_tokens or a shorter prompt, or start the server with a bigger \
         --memory-budget",
        need.prompt_tokens, need.max_tokens, need.bytes(), need.kv, need.activations,
        budget, weights, mlx_cache, budget.saturating_sub(weights + mlx_cache)
    )]
    TooBig {
        need: Need,
        budget: u64,
        weights: u64,
        mlx_cache: u64,
    },
    #[error(
        "the server's memory budget is taken by running requests ({need} bytes needed, {free} \
         free of {budget}); retry later"
    )]
    Busy { need: u64, free: u64, budget: u64 },
}

#[derive(Debug, Default)]
struct Ledger {
    weights: BTreeMap<String, u64>,
    reserved: u64,
    reservations: usize,
    peak_reserved: u64,
    kv: KvBound,
    act: ActBound,
    mlx_cache: u64,
}

impl Ledger {
    fn fixed(&self) -> u64 {
        self.weights.values().sum::<u64>() + self.mlx_cache
    }
}

/// The server's memory budget and what holds it.
#[derive(Debug)]
pub struct Budget {
    pub limit: u64,
    /// How long a request waits for room before 429 (`--budget-wait`).
    pub wait: Duration,
    ledger: Mutex<Ledger>,
    freed: tokio::sync::Notify,
}

/// `/stats` `memory`'s budget part.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Snapshot {
    pub budget: u64,
    pub weights: u64,
    pub reserved: u64,
    pub reservations: usize,
    pub peak_reserved: u64,
    pub kv_fixed: u64,
    pub kv_per_token: u64,
    pub act_chunk: u64,
    pub act_per_token: u64,
    pub mlx_cache_limit: u64,
}

impl Budget {
    pub fn new(limit: u64, wait: Duration) -> Arc<Self> {
        Arc::new(Budget {
            limit,
            wait,
            ledger: Default::default(),
            freed: Default::default(),
        })
    }

    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a loaded model's resident bytes (a name loaded again replaces its count).
    pub fn reserve_weights(&self, name: &str, bytes: u64) {
        self.ledger().weights.insert(name.to_owned(), bytes);
    }

    /// Forgets an unloaded model's bytes.
    pub fn release_weights(&self, name: &str) {
        self.ledger().weights.remove(name);
        self.freed.notify_waiters();
    }

    /// Sets what the startup probe measured; the MLX buffer cache is capped to the
    /// activation bound.
    pub fn set_measured(&self, kv: KvBound, act: ActBound) {
        let mut l = self.ledger();
        l.kv = kv;
        l.act = act;
        l.mlx_cache = act.at_chunk;
    }

    pub fn weights(&self) -> u64 {
        self.ledger().weights.values().sum()
    }

    pub fn mlx_cache_limit(&self) -> u64 {
        self.ledger().mlx_cache
    }

    /// What a request of `prompt_tokens` + `max_tokens` needs.
    pub fn need(&self, prompt_tokens: usize, max_tokens: usize) -> Need {
        let l = self.ledger();
        Need {
            prompt_tokens,
            max_tokens,
            kv: l.kv.bytes((prompt_tokens + max_tokens) as u64),
            activations: l
                .act
                .bytes(prompt_tokens as u64, (prompt_tokens + max_tokens) as u64),
        }
    }

    /// Refuses a need that cannot fit even with nothing else running.
    pub fn check(&self, need: Need) -> Result<(), Refusal> {
        let l = self.ledger();
        if plant::is(Defect::BudgetIgnored) || l.fixed() + need.bytes() <= self.limit {
            return Ok(());
        }
        Err(Refusal::TooBig {
            need,
            budget: self.limit,
            weights: l.weights.values().sum(),
            mlx_cache: l.mlx_cache,
        })
    }

    /// A reservation of `need`, if it fits now.
    pub fn try_reserve(self: &Arc<Self>, need: Need) -> Result<Reservation, Refusal> {
        let bytes = need.bytes();
        let mut l = self.ledger();
        let free = self.limit.saturating_sub(l.fixed() + l.reserved);
        if bytes > free && !plant::is(Defect::BudgetIgnored) {
            return Err(Refusal::Busy {
                need: bytes,
                free,
                budget: self.limit,
            });
        }
        l.reserved += bytes;
        l.reservations += 1;
        l.peak_reserved = l.peak_reserved.max(l.reserved);
        Ok(Reservation {
            budget: self.clone(),
            bytes,
        })
    }

    /// A reservation of `need`: at once, or once running requests free enough, waiting
    /// until `wait` or `deadline` passes (then `Refusal::Busy`). A need that can never fit
    /// is refused at once (`check`).
    pub async fn reserve(
        self: &Arc<Self>,
        need: Need,
        deadline: Option<Instant>,
    ) -> Result<Reservation, Refusal> {
        self.check(need)?;
        let mut until = Instant::now() + self.wait;
        if let Some(d) = deadline {
            until = until.min(d);
        }
        loop {
            let freed = self.freed.notified();
            let mut freed = std::pin::pin!(freed);
            freed.as_mut().enable();
            let refused = match self.try_reserve(need) {
                Ok(r) => return Ok(r),
                Err(e) => e,
            };
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() || tokio::time::timeout(left, freed).await.is_err() {
                return Err(refused);
            }
        }
    }

    /// What the RAM prompt cache may hold now: the budget less weights, MLX's buffer cache
    /// and every reservation.
    pub fn prompt_cache_room(&self) -> u64 {
        if plant::is(Defect::BudgetIgnored) {
            return u64::MAX;
        }
        let l = self.ledger();
        self.limit.saturating_sub(l.fixed() + l.reserved)
    }

    /// Extra bytes an entry of the prompt cache may hold beyond its tokens' (its buffers'
    /// last partly filled step).
    pub fn entry_slack(&self) -> u64 {
        self.ledger().kv.per_token * KV_STEP
    }

    pub fn snapshot(&self) -> Snapshot {
        let l = self.ledger();
        Snapshot {
            budget: self.limit,
            weights: l.weights.values().sum(),
            reserved: l.reserved,
            reservations: l.reservations,
            peak_reserved: l.peak_reserved,
            kv_fixed: l.kv.fixed,
            kv_per_token: l.kv.per_token,
            act_chunk: l.act.at_chunk,
            act_per_token: l.act.per_token,
            mlx_cache_limit: l.mlx_cache,
        }
    }
}

/// Bytes of the budget held for one request's whole life; given back when dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<Budget>,
    bytes: u64,
}

impl Reservation {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        {
            let mut l = self.budget.ledger();
            l.reserved -= self.bytes;
            l.reservations -= 1;
        }
        self.budget.freed.notify_waiters();
    }
}

/// What the startup probe measured on the model thread.
#[derive(Debug, Clone, Copy)]
pub struct Probe {
    pub weights: u64,
    pub kv: KvBound,
    pub act: ActBound,
}

/// MLX's active bytes once its buffer cache is emptied.
fn active() -> anyhow::Result<u64> {
    mlx_rs::memory::clear_cache()?;
    Ok(mlx_rs::memory::active_memory()? as u64)
}

/// Measures, on the model thread, with nothing else alive: the resident bytes (weights),
/// the caches' bytes after 1 and after 257 prompt tokens (`KvBound`) and the peak over a
/// prefill chunk of `prefill_step` tokens beyond what was held before it, on fresh caches
/// and after `ACT_PROBE_OFFSET` tokens (`ActBound`). `make_caches` gives the caches a
/// request gets (the model's, then a drafter's); only the model's forward runs, so a
/// drafter's caches count as constant (`kv_fixed`) here and its weights are in `weights`.
pub fn probe(
    model: &dyn crate::model::LanguageModel,
    make_caches: &dyn Fn() -> Vec<Box<dyn crate::cache::Cache>>,
    opts: &crate::generate::SessionOptions,
    prefill_step: usize,
    context: usize,
) -> anyhow::Result<Probe> {
    let vocab = model.vocab_size().max(1) as u32;
    let ids = |n: usize| -> Vec<u32> { (0..n as u32).map(|i| (i * 7 + 3) % vocab).collect() };
    let layers = model.make_caches().len();
    let weights = active()?;
    // Feeds `before` tokens, then measures one chunk of `n`: (the caches' bytes after it,
    // the peak during it beyond what was held before it).
    let fed = |before: usize, n: usize| -> anyhow::Result<(u64, u64)> {
        let mut caches = make_caches();
        let rest = caches.split_off(layers);
        let mut session = crate::generate::Session::with_caches(model, opts, caches);
        for chunk in ids(before).chunks(n.max(1)) {
            session.prefill_chunk(chunk)?;
        }
        let held = active()?;
        mlx_rs::memory::reset_peak_memory()?;
        session.prefill_chunk(&ids(n))?;
        let peak = mlx_rs::memory::peak_memory()? as u64;
        let after = active()?;
        drop(session);
        drop(rest);
        Ok((after.saturating_sub(weights), peak.saturating_sub(held)))
    };
    let (one, _) = fed(0, 1)?;
    let (two, _) = fed(0, KV_STEP as usize + 1)?;
    let chunk = prefill_step.clamp(1, context.max(1));
    let (_, fresh) = fed(0, chunk)?;
    let (_, deeper) = fed(ACT_PROBE_OFFSET as usize, chunk)?;
    let extra: u64 = {
        // The drafter's caches (after the model's), empty: counted as constant.
        let mut caches = make_caches();
        let rest = caches.split_off(layers);
        rest.iter().map(|c| c.nbytes() as u64).sum()
    };
    let mut kv = KvBound::from_probe(one, two);
    kv.fixed += extra;
    mlx_rs::memory::reset_peak_memory()?;
    Ok(Probe {
        weights,
        kv,
        act: ActBound::from_probe(chunk as u64, fresh, deeper),
    })
}

/// `engine generate --memory-budget`: measures the model as the server does and refuses,
/// before any prefill, a prompt + max_tokens that cannot fit (the same numbers as the
/// server's 400).
pub fn check_alone(
    flag: &str,
    model: &dyn crate::model::LanguageModel,
    make_caches: &dyn Fn() -> Vec<Box<dyn crate::cache::Cache>>,
    opts: &crate::generate::SessionOptions,
    prefill_step: usize,
    prompt_tokens: usize,
    max_tokens: usize,
) -> anyhow::Result<()> {
    let limit = parse(flag)?.resolve(flag, physical_memory())?;
    let p = probe(
        model,
        make_caches,
        opts,
        prefill_step,
        prompt_tokens + max_tokens,
    )?;
    let budget = Budget::new(limit, Duration::ZERO);
    budget.reserve_weights("model", p.weights);
    budget.set_measured(p.kv, p.act);
    mlx_rs::memory::set_cache_limit(budget.mlx_cache_limit() as usize)?;
    budget.check(budget.need(prompt_tokens, max_tokens))?;
    Ok(())
}

/// Charges a loaded worker to `budget` under `name`: measures it (`probe`), counts its
/// weights, caps MLX's buffer cache. Refuses a budget the model alone already fills.
pub(super) fn charge(
    worker: &super::worker::Worker,
    budget: &Budget,
    name: &str,
) -> anyhow::Result<()> {
    let make = || worker.make_caches();
    let p = probe(
        worker.model.as_ref(),
        &make,
        &worker.opts,
        worker.prefill_step,
        worker.context,
    )?;
    budget.reserve_weights(name, p.weights);
    budget.set_measured(p.kv, p.act);
    mlx_rs::memory::set_cache_limit(budget.mlx_cache_limit() as usize)?;
    let fixed = budget.weights() + budget.mlx_cache_limit();
    let one = budget.need(1, 0).bytes();
    anyhow::ensure!(
        fixed + one <= budget.limit,
        "--memory-budget {} bytes: the model's weights ({} bytes), MLX's buffer cache ({}) and \
         one token's request ({}) do not fit; give a bigger --memory-budget",
        budget.limit,
        budget.weights(),
        budget.mlx_cache_limit(),
        one
    );
    eprintln!(
        "engine serve: --memory-budget {} bytes: weights {}, KV {} + {} per token, \
         activations {} + {} per token past {} (docs/serve.md \"Memory budget\")",
        budget.limit,
        p.weights,
        p.kv.fixed,
        p.kv.per_token,
        p.act.at_chunk,
        p.act.per_token,
        p.act.chunk
    );
    Ok(())
}

/// A request's reservation (None: no budget), or the answer refusing it: 400 when it can
/// never fit, 429 with Retry-After when the budget stayed full for `--budget-wait`.
pub(super) async fn admit(
    s: &super::AppState,
    prompt_tokens: usize,
    max_tokens: usize,
    deadline: Option<Instant>,
) -> Result<Option<Reservation>, axum::response::Response> {
    use axum::response::IntoResponse;
    use std::sync::atomic::Ordering;
    let Some(b) = &s.budget else {
        return Ok(None);
    };
    // As the model thread limits it: never past the context.
    let max_tokens = max_tokens.min(s.defaults.context.saturating_sub(prompt_tokens));
    let need = b.need(prompt_tokens, max_tokens);
    match b.reserve(need, deadline).await {
        Ok(r) => Ok(Some(r)),
        Err(e @ Refusal::TooBig { .. }) => {
            s.counters.rejected.fetch_add(1, Ordering::Relaxed);
            Err(super::error::ApiError::invalid(e.to_string()).into_response())
        }
        Err(e) => {
            s.counters.throttled.fetch_add(1, Ordering::Relaxed);
            let mut response = super::error::ApiError::server(e.to_string())
                .with_status(axum::http::StatusCode::TOO_MANY_REQUESTS)
                .into_response();
            let retry = b.wait.as_secs().clamp(1, 60).to_string();
            if let Ok(v) = axum::http::HeaderValue::from_str(&retry) {
                response
                    .headers_mut()
                    .insert(axum::http::header::RETRY_AFTER, v);
            }
            Err(response)
        }
    }
}

/// `/stats` `memory`: the budget's ledger (null without one), the prompt cache's bytes,
/// MLX's allocator counters and the process's peak RSS.
pub(super) fn stats(s: &super::AppState) -> serde_json::Value {
    let mlx = crate::runtime::memory().ok();
    let prompt_cache = s.prompt_cache.lock().map(|p| p.bytes).unwrap_or_default();
    serde_json::json!({
        "budget": s.budget.as_ref().map(|b| b.snapshot()),
        "prompt_cache_bytes": prompt_cache,
        "mlx_active": mlx.map(|m| m.active),
        "mlx_peak": mlx.map(|m| m.peak),
        "mlx_cache": mlx.map(|m| m.cache),
        "peak_rss": peak_rss(),
    })
}

/// `/metrics` gauges: the budget, what is reserved, MLX's active bytes.
#[derive(Debug)]
pub(super) struct Gauges(pub Arc<Budget>);

impl prometheus_client::collector::Collector for Gauges {
    fn encode(
        &self,
        mut e: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::gauge::ConstGauge;
        let snap = self.0.snapshot();
        let active = crate::runtime::memory().map_or(0, |m| m.active);
        let gauges = [
            (
                "memory_budget_bytes",
                "The server's --memory-budget",
                snap.budget,
            ),
            (
                "memory_reserved_bytes",
                "Bytes of the memory budget reserved by admitted requests",
                snap.reserved,
            ),
            (
                "memory_weights_bytes",
                "Bytes of the memory budget the loaded models' weights hold",
                snap.weights,
            ),
            (
                "mlx_active_memory_bytes",
                "MLX's active (allocated) bytes",
                active as u64,
            ),
        ];
        for (name, help, v) in gauges {
            let g = ConstGauge::new(v as i64);
            let m = e.encode_descriptor(name, help, None, g.metric_type())?;
            g.encode(m)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_in_every_accepted_form() {
        assert_eq!(parse("123456"), Ok(Spec::Bytes(123_456)));
        assert_eq!(parse("6GB"), Ok(Spec::Bytes(6_000_000_000)));
        assert_eq!(parse("6GiB"), Ok(Spec::Bytes(6 << 30)));
        assert_eq!(parse("6g"), Ok(Spec::Bytes(6 << 30)));
        assert_eq!(parse("512MiB"), Ok(Spec::Bytes(512 << 20)));
        assert_eq!(parse("512 MB"), Ok(Spec::Bytes(512_000_000)));
        assert_eq!(parse("1.5G"), Ok(Spec::Bytes(3 << 29)));
        assert_eq!(parse("10b"), Ok(Spec::Bytes(10)));
        assert_eq!(parse("70%"), Ok(Spec::Percent(70.0)));
        assert_eq!(parse("AUTO"), Ok(Spec::Auto));
    }

    #[test]
    fn bad_sizes_are_refused_naming_the_accepted_forms() {
        for bad in [
            "",
            "GB",
            "6XB",
            "-5",
            "1e9",
            "six",
            ".",
            "99999999999999999999",
        ] {
            let e = parse(bad).unwrap_err();
            assert!(matches!(e, SpecError::Syntax(_)), "{bad}: {e:?}");
            assert!(e.to_string().contains("70%"), "{e}");
        }
        assert!(matches!(parse("0"), Err(SpecError::Zero(_))));
        assert!(matches!(parse("0%"), Err(SpecError::Percent(_))));
        assert!(matches!(parse("101%"), Err(SpecError::Percent(_))));
        assert!(matches!(parse("nan%"), Err(SpecError::Percent(_))));
    }

    #[test]
    fn shares_resolve_against_physical_memory() {
        assert_eq!(Spec::Percent(50.0).resolve("50%", Some(1000)), Ok(500));
        assert_eq!(Spec::Auto.resolve("auto", Some(1000)), Ok(750));
        assert!(matches!(
            Spec::Auto.resolve("auto", None),
            Err(SpecError::NoPhysical(_))
        ));
        assert!(physical_memory().is_some_and(|m| m > 0));
    }

    #[test]
    fn the_kv_bound_covers_a_partly_filled_step() {
        // 10 fixed bytes, 4 per token: 1 token allocates a step, 257 two.
        let kv = KvBound::from_probe(10 + 4 * 256, 10 + 4 * 512);
        assert_eq!(
            kv,
            KvBound {
                fixed: 10,
                per_token: 4
            }
        );
        assert_eq!(kv.bytes(0), 10 + 4 * 256);
        assert!(kv.bytes(300) >= 10 + 4 * 512);
    }

    #[test]
    fn the_activation_bound_grows_past_the_chunk() {
        let act = ActBound::from_probe(256, 1000, 1000 + 512 * 3);
        assert_eq!(act.per_token, 3);
        // Decode steps: 3 bytes per token per 256-token chunk, rounded up: 1 per token.
        assert_eq!(act.bytes(100, 100), 1000 + 100);
        assert_eq!(act.bytes(256 + 10, 300), 1000 + 30 + 300);
        // Past the probed depth, as measured there and beyond.
        assert_eq!(act.bytes(256 + 512, 256 + 512), 1000 + 1536 + 768);
    }

    fn ledger() -> Arc<Budget> {
        let b = Budget::new(1000, Duration::from_millis(50));
        b.reserve_weights("m", 300);
        let act = ActBound {
            at_chunk: 50,
            per_token: 0,
            chunk: 16,
        };
        // kv(T) = T + 256, act = 50.
        b.set_measured(
            KvBound {
                fixed: 0,
                per_token: 1,
            },
            act,
        );
        b
    }

    #[test]
    fn the_ledger_refuses_what_never_fits_and_reserves_what_does() {
        let b = ledger();
        // 300 weights + 50 cache = 350 fixed; 650 left.
        let big = b.need(400, 100); // 756 + 50
        assert!(matches!(b.check(big), Err(Refusal::TooBig { .. })));
        let msg = b.check(big).unwrap_err().to_string();
        for part in [
            "400 prompt tokens",
            "max_tokens 100",
            "806 bytes",
            "1000",
            "300",
        ] {
            assert!(msg.contains(part), "{part} not in {msg}");
        }
        let small = b.need(10, 10); // 276 + 50 = 326
        let r1 = b.try_reserve(small).unwrap();
        assert_eq!(b.prompt_cache_room(), 1000 - 350 - 326);
        let r2 = b.try_reserve(small).unwrap_err();
        assert!(matches!(r2, Refusal::Busy { need: 326, .. }));
        drop(r1);
        assert_eq!(b.snapshot().reserved, 0);
        assert_eq!(b.snapshot().peak_reserved, 326);
        assert_eq!(b.prompt_cache_room(), 650);
        b.release_weights("m");
        assert_eq!(b.prompt_cache_room(), 950);
    }

    #[test]
    fn a_waiting_reservation_gets_the_bytes_a_finished_one_frees() {
        let b = ledger();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let need = b.need(10, 10);
        let held = b.try_reserve(need).unwrap();
        // Nothing frees: refused once the wait is over.
        let busy = rt.block_on(b.reserve(need, None));
        assert!(matches!(busy, Err(Refusal::Busy { .. })));
        // Freed while waiting: granted.
        let b2 = b.clone();
        let got = rt.block_on(async move {
            let waiter = b2.reserve(need, None);
            let freer = async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                drop(held);
            };
            let (got, ()) = tokio::join!(waiter, freer);
            got
        });
        assert_eq!(got.unwrap().bytes(), 326);
        assert_eq!(b.snapshot().reservations, 0);
    }
}
