//! `--memory-budget`: a bound on the memory a server's MLX work holds, never exceeded by
//! design (mlx-lm's server has none; a flood of long prompts grows its KV caches and prompt
//! cache until Metal aborts). The ledger, per server (one `Arc<Budget>`, shared by every
//! model a server loads):
//!
//! ```text
//! budget ≥ weights + mlx_cache + Σ reservations + Σ prompt caches (every model's)
//! reservation(request) = kv(T) + act(P, T),  P = prompt, T = prompt + max_tokens
//! reservation(embeddings) = kv(n) + act₁(n), n = the longest input (one forward each)
//! kv(T)     = kv_fixed + kv_per_token × (T + 256)
//! act(P, T) = act_chunk + act_per_token × max(0, P − prefill_step)
//!             + ⌈act_per_token / prefill_step⌉ × T
//! act₁(n)   = act_chunk, or past a chunk ⌈n / chunk⌉ × (act_chunk + act_per_token × (n − chunk))
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
//! - Many models (`fleet`): one ledger for all of them. Weights and the measured bounds
//!   are per model (keyed by the model's name, `key`); a request's need is its model's
//!   bounds; the buffer cache limit is process-wide, so it is the largest model's
//!   `act_chunk` (never lowered while the process lives: lowering it is an MLX call).
//!
//! Admission (`admit`, on the HTTP side, before a request is queued): a request whose need
//! cannot fit even alone is refused (400, naming the numbers and the fix); otherwise it
//! waits for its reservation (up to `--budget-wait` or its request timeout), then gets 429
//! with Retry-After. The reservation travels with the job and is released when the request
//! ends, however it ends. The model thread trims the RAM prompt cache to
//! `budget − weights − mlx_cache − reserved − other models' caches − other models' waiting
//! needs` before each prompt lookup and after keeping an entry (`Budget::prompt_cache_room`)
//! and writes what it keeps into the ledger; other models' caches are pressed to give way
//! to a waiting request (`caches`).

mod caches;
mod http;
mod probe;
mod size;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub(crate) use caches::Share;
pub(crate) use http::{admit, admit_need, memory, stats, Gauges};
pub(crate) use probe::{active, charge, Loaded};
pub use probe::{check_alone, probe, Probe};
pub use size::{from_flag, parse, peak_rss, physical_memory, Spec, SpecError, AUTO_PERCENT};

use crate::plant::{self, Defect};

/// K/V buffers grow by this many tokens (mlx-lm's `KVCache.step`).
pub const KV_STEP: u64 = 256;

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

    /// Activation bytes of one forward of `n` tokens at once (not in chunks: an
    /// embeddings input). Up to a chunk it is within the chunk's bound; past it, a forward
    /// holds what ⌈n / chunk⌉ chunks attending to n tokens each hold (the per-token
    /// intermediates and the attention scores grow linearly with the tokens run at once).
    pub fn one_forward(&self, n: u64) -> u64 {
        let chunk = self.chunk.max(1);
        if n <= chunk {
            return self.at_chunk;
        }
        n.div_ceil(chunk).saturating_mul(
            self.at_chunk
                .saturating_add(self.per_token.saturating_mul(n - chunk)),
        )
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
    /// The prompt's tokens; an embeddings request's longest input.
    pub prompt_tokens: usize,
    pub max_tokens: usize,
    pub kv: u64,
    pub activations: u64,
    /// An embeddings request's (`embed_need`): its refusal names inputs, not max_tokens.
    pub embedding: bool,
}

impl Need {
    pub fn bytes(&self) -> u64 {
        self.kv + self.activations
    }
}

/// Why a request got no reservation.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Refusal {
    #[error("{}", too_big(need, *budget, *weights, *mlx_cache))]
    TooBig {
        need: Need,
        budget: u64,
        weights: u64,
        mlx_cache: u64,
    },
    #[error(
        "the server's memory budget is taken by running requests and prompt caches ({need} \
         bytes needed, {free} free of {budget}); retry later"
    )]
    Busy { need: u64, free: u64, budget: u64 },
}

/// `Refusal::TooBig`'s words: the need, what the budget holds, the fix.
fn too_big(need: &Need, budget: u64, weights: u64, mlx_cache: u64) -> String {
    let (what, fix) = match need.embedding {
        true => (
            format!(
                "its longest input, {} tokens, needs {} bytes (KV cache {} + activations {} \
                 of one forward)",
                need.prompt_tokens,
                need.bytes(),
                need.kv,
                need.activations
            ),
            "send shorter inputs",
        ),
        false => (
            format!(
                "{} prompt tokens + max_tokens {} need {} bytes (KV cache {} + activations {})",
                need.prompt_tokens,
                need.max_tokens,
                need.bytes(),
                need.kv,
                need.activations
            ),
            "send a smaller max_tokens or a shorter prompt",
        ),
    };
    format!(
        "this request cannot fit in the server's memory budget: {what}, and the budget of \
         {budget} bytes holds {weights} bytes of model weights and {mlx_cache} of MLX buffer \
         cache, leaving {} bytes; {fix}, or start the server with a bigger --memory-budget",
        budget.saturating_sub(weights + mlx_cache)
    )
}

#[derive(Debug, Default)]
struct Ledger {
    weights: BTreeMap<String, u64>,
    reserved: u64,
    reservations: usize,
    peak_reserved: u64,
    /// Each loaded model's measured bounds, by name (as `weights`).
    bounds: BTreeMap<String, (KvBound, ActBound)>,
    mlx_cache: u64,
    /// Each model's RAM prompt cache, as its thread last trimmed it (`caches`).
    caches: BTreeMap<String, u64>,
    /// Bytes that requests waiting for room need, by model: other models' prompt caches
    /// give them way (`caches`).
    waiting: BTreeMap<String, u64>,
    /// Per model: asks its thread to trim its prompt cache to its room (`caches`).
    pressure: BTreeMap<String, caches::Hook>,
    /// The most that weights, MLX's buffer cache, reservations and prompt caches held at
    /// once, as the ledger counts them.
    peak_held: u64,
}

/// A model's name in the ledger: its canonical path (the server's `model_id`).
pub fn key(path: &std::path::Path) -> String {
    path.canonicalize()
        .unwrap_or_else(|_| path.to_path_buf())
        .display()
        .to_string()
}

impl Ledger {
    fn fixed(&self) -> u64 {
        self.weights.values().sum::<u64>() + self.mlx_cache
    }

    /// Everything the ledger counts as held now.
    fn held(&self) -> u64 {
        self.fixed() + self.reserved + self.caches.values().sum::<u64>()
    }

    fn note_peak(&mut self) {
        self.peak_held = self.peak_held.max(self.held());
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
    /// The models' RAM prompt caches, summed (each model's in `models`).
    pub prompt_caches: u64,
    /// The most that weights + MLX's buffer cache + reservations + prompt caches held at
    /// once (never more than `budget`: the ledger's invariant).
    pub peak_held: u64,
    /// What the requests waiting for room need, summed.
    pub waiting: u64,
    /// Per model (the fields above are the largest over them).
    pub models: BTreeMap<String, ModelSnapshot>,
}

/// `/stats` `memory.budget.models`' entry.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ModelSnapshot {
    pub weights: Option<u64>,
    /// Its RAM prompt cache's bytes (each entry with its buffers' unfilled tail).
    pub prompt_cache: u64,
    pub kv_fixed: u64,
    pub kv_per_token: u64,
    pub act_chunk: u64,
    pub act_per_token: u64,
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
    /// The other models' prompt caches are asked to give it way (`press`).
    pub fn reserve_weights(&self, name: &str, bytes: u64) {
        {
            let mut l = self.ledger();
            l.weights.insert(name.to_owned(), bytes);
            l.note_peak();
        }
        self.press(name);
    }

    /// Forgets an unloaded model's bytes and bounds.
    pub fn release_weights(&self, name: &str) {
        {
            let mut l = self.ledger();
            l.weights.remove(name);
            l.bounds.remove(name);
            l.caches.remove(name);
            l.pressure.remove(name);
        }
        self.freed.notify_waiters();
    }

    /// Sets what model `name`'s startup probe measured; the MLX buffer cache is capped to
    /// the largest activation bound (process-wide).
    pub fn set_measured(&self, name: &str, kv: KvBound, act: ActBound) {
        let mut l = self.ledger();
        l.bounds.insert(name.to_owned(), (kv, act));
        l.mlx_cache = l.mlx_cache.max(act.at_chunk);
    }

    /// Model `name`'s measured least request need (one token) and MLX buffer cache
    /// (`act_chunk`), while it is charged.
    pub fn least(&self, name: &str) -> Option<(u64, u64)> {
        let l = self.ledger();
        let (kv, act) = l.bounds.get(name)?;
        Some((kv.bytes(1) + act.bytes(1, 1), act.at_chunk))
    }

    /// The least any request of any loaded model needs (one token, none generated): what a
    /// model about to load must leave room for, before its own bounds are measured.
    pub fn min_request(&self) -> u64 {
        let l = self.ledger();
        l.bounds
            .values()
            .map(|(kv, act)| kv.bytes(1) + act.bytes(1, 1))
            .max()
            .unwrap_or(0)
    }

    pub fn weights(&self) -> u64 {
        self.ledger().weights.values().sum()
    }

    pub fn mlx_cache_limit(&self) -> u64 {
        self.ledger().mlx_cache
    }

    /// What a request of `prompt_tokens` + `max_tokens` to model `name` needs (by its
    /// measured bounds; zero before they are measured).
    pub fn need(&self, name: &str, prompt_tokens: usize, max_tokens: usize) -> Need {
        let l = self.ledger();
        let (kv, act) = l.bounds.get(name).copied().unwrap_or_default();
        Need {
            prompt_tokens,
            max_tokens,
            kv: kv.bytes((prompt_tokens + max_tokens) as u64),
            activations: act.bytes(prompt_tokens as u64, (prompt_tokens + max_tokens) as u64),
            embedding: false,
        }
    }

    /// What an embeddings request to model `name` needs, its longest input `longest`
    /// tokens: the model thread embeds one input at a time (`worker::embed`), each as one
    /// forward of all its tokens through fresh caches that are dropped before the next
    /// input starts, so the need is the longest input's, not the sum over inputs:
    /// `kv(n) + ActBound::one_forward(n)`.
    pub fn embed_need(&self, name: &str, longest: usize) -> Need {
        let l = self.ledger();
        let (kv, act) = l.bounds.get(name).copied().unwrap_or_default();
        Need {
            prompt_tokens: longest,
            max_tokens: 0,
            kv: kv.bytes(longest as u64),
            activations: act.one_forward(longest as u64),
            embedding: true,
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

    /// A reservation of `need` for model `name`, if it fits now beside the other models'
    /// prompt caches. Its own prompt cache gives way: its thread trims it before the
    /// request's prompt lookup (or embedding), so it is counted at what it may keep then.
    pub fn try_reserve(self: &Arc<Self>, name: &str, need: Need) -> Result<Reservation, Refusal> {
        let bytes = need.bytes();
        let mut l = self.ledger();
        let others = l.others(name);
        let free = self.limit.saturating_sub(l.fixed() + l.reserved + others);
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
        let room = self.limit.saturating_sub(l.fixed() + l.reserved + others);
        if let Some(own) = l.caches.get_mut(name) {
            *own = (*own).min(room);
        }
        l.note_peak();
        Ok(Reservation {
            budget: self.clone(),
            bytes,
            counted: true,
        })
    }

    /// A reservation of `need`: at once, or once running requests free enough, waiting
    /// until `wait` or `deadline` passes (then `Refusal::Busy`). A need that can never fit
    /// is refused at once (`check`).
    /// While it waits, other models' prompt caches are asked to give it room
    /// (`caches::Waiting`, `press`).
    pub async fn reserve(
        self: &Arc<Self>,
        name: &str,
        need: Need,
        deadline: Option<Instant>,
    ) -> Result<Reservation, Refusal> {
        self.check(need)?;
        let mut until = Instant::now() + self.wait;
        if let Some(d) = deadline {
            until = until.min(d);
        }
        let mut waiting = None;
        loop {
            let freed = self.freed.notified();
            let mut freed = std::pin::pin!(freed);
            freed.as_mut().enable();
            let refused = match self.try_reserve(name, need) {
                Ok(r) => return Ok(r),
                Err(e) => e,
            };
            if waiting.is_none() {
                waiting = Some(caches::Waiting::new(self, name, need.bytes()));
            }
            self.press(name);
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() || tokio::time::timeout(left, freed).await.is_err() {
                return Err(refused);
            }
        }
    }

    /// What model `name`'s RAM prompt cache may hold now: the budget less weights, MLX's
    /// buffer cache, every reservation, the other models' prompt caches and what requests
    /// to the other models wait for.
    pub fn prompt_cache_room(&self, name: &str) -> u64 {
        self.room(&self.ledger(), name)
    }

    fn room(&self, l: &Ledger, name: &str) -> u64 {
        if plant::is(Defect::BudgetIgnored) {
            return u64::MAX;
        }
        self.limit
            .saturating_sub(l.fixed() + l.reserved + l.others(name) + l.others_waiting(name))
    }

    /// Extra bytes an entry of the prompt cache may hold beyond its tokens' (its buffers'
    /// last partly filled step; the largest model's).
    pub fn entry_slack(&self) -> u64 {
        let l = self.ledger();
        l.bounds
            .values()
            .map(|(kv, _)| kv.per_token)
            .max()
            .unwrap_or(0)
            * KV_STEP
    }

    pub fn snapshot(&self) -> Snapshot {
        let l = self.ledger();
        let models: BTreeMap<String, ModelSnapshot> = l
            .bounds
            .iter()
            .map(|(name, (kv, act))| {
                let m = ModelSnapshot {
                    weights: l.weights.get(name).copied(),
                    prompt_cache: l.caches.get(name).copied().unwrap_or(0),
                    kv_fixed: kv.fixed,
                    kv_per_token: kv.per_token,
                    act_chunk: act.at_chunk,
                    act_per_token: act.per_token,
                };
                (name.clone(), m)
            })
            .collect();
        let most = |f: fn(&ModelSnapshot) -> u64| models.values().map(f).max().unwrap_or(0);
        Snapshot {
            budget: self.limit,
            weights: l.weights.values().sum(),
            reserved: l.reserved,
            reservations: l.reservations,
            peak_reserved: l.peak_reserved,
            kv_fixed: most(|m| m.kv_fixed),
            kv_per_token: most(|m| m.kv_per_token),
            act_chunk: most(|m| m.act_chunk),
            act_per_token: most(|m| m.act_per_token),
            mlx_cache_limit: l.mlx_cache,
            prompt_caches: l.caches.values().sum(),
            peak_held: l.peak_held,
            waiting: l.waiting.values().sum(),
            models,
        }
    }
}

/// Bytes of the budget held for one request's whole life; given back when dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<Budget>,
    bytes: u64,
    /// Still in the ledger's `reserved` (false once it became weights: `into_weights`).
    counted: bool,
}

impl Reservation {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// This reservation's bytes held from now on as model `name`'s weights, in one step
    /// of the ledger (no other request can take them in between).
    pub fn into_weights(mut self, name: &str) {
        let mut l = self.budget.ledger();
        l.reserved -= self.bytes;
        l.reservations -= 1;
        l.weights.insert(name.to_owned(), self.bytes);
        l.note_peak();
        self.counted = false;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.counted {
            let mut l = self.budget.ledger();
            l.reserved -= self.bytes;
            l.reservations -= 1;
        }
        self.budget.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests;
