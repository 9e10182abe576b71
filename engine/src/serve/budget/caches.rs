//! The models' RAM prompt caches in the shared ledger (docs/serve.md, "Memory budget"):
//! each model's thread writes what its cache holds after every trim (`Share::trim`), so
//! one model's cache counts against the others' requests and caches:
//!
//! ```text
//! room(model)  = budget − weights − mlx_cache − reserved − Σ other models' caches
//!                − Σ what other models' waiting requests need
//! free(model)  = budget − weights − mlx_cache − reserved − Σ other models' caches
//! ```
//!
//! A request's own model's cache is not in its `free`: that thread trims its cache before
//! the request's prompt lookup (or embedding), as a single-model server always did. When
//! other models' caches stand in a waiting request's way, their threads are asked to trim
//! (`press`: the hook each model registers sends its thread `Work::Trim`; an idle thread
//! is blocked on its jobs channel, and MLX arrays must be dropped on their own thread);
//! the trim lowers their ledger entry and wakes the waiters.

use std::sync::Arc;

use super::{Budget, Ledger};
use crate::plant::{self, Defect};

/// Asks a model's thread to trim its prompt cache to its room.
#[derive(Clone)]
pub(super) struct Hook(Arc<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hook")
    }
}

impl Ledger {
    /// The other models' prompt caches (none, planted: as if uncounted).
    pub(super) fn others(&self, name: &str) -> u64 {
        if plant::is(Defect::BudgetOtherModelsCacheUncounted) {
            return 0;
        }
        self.caches
            .iter()
            .filter(|(k, _)| k.as_str() != name)
            .map(|(_, b)| b)
            .sum()
    }

    /// What the other models' waiting requests need.
    pub(super) fn others_waiting(&self, name: &str) -> u64 {
        if plant::is(Defect::BudgetOtherModelsCacheUncounted) {
            return 0;
        }
        self.waiting
            .iter()
            .filter(|(k, _)| k.as_str() != name)
            .map(|(_, b)| b)
            .sum()
    }
}

impl Budget {
    /// Model `name`'s prompt cache holds `held` bytes before a trim: counted at most at its
    /// room, which it returns (the thread then trims to it and calls `set_prompt_cache`).
    pub fn claim_prompt_cache(&self, name: &str, held: u64) -> u64 {
        let mut l = self.ledger();
        // Under the one lock: no reservation is granted between the room and the claim.
        let room = self.room(&l, name);
        l.caches.insert(name.to_owned(), held.min(room));
        l.note_peak();
        room
    }

    /// What the ledger counts for model `name`'s prompt cache.
    fn prompt_cache_counted(&self, name: &str) -> u64 {
        self.ledger().caches.get(name).copied().unwrap_or(0)
    }

    /// Model `name`'s prompt cache holds `held` bytes after a trim (never more than its
    /// claim); a smaller count wakes the requests waiting for room.
    pub fn set_prompt_cache(&self, name: &str, held: u64) {
        let lower = {
            let mut l = self.ledger();
            let entry = l.caches.entry(name.to_owned()).or_insert(held);
            let lower = held < *entry;
            *entry = (*entry).min(held);
            lower
        };
        if lower {
            self.freed.notify_waiters();
        }
    }

    /// Registers how model `name`'s thread is asked to trim its prompt cache.
    pub fn on_pressure(&self, name: &str, hook: impl Fn() + Send + Sync + 'static) {
        self.ledger()
            .pressure
            .insert(name.to_owned(), Hook(Arc::new(hook)));
    }

    /// Asks every other model whose prompt cache holds bytes to trim it to its room (which
    /// the waiting requests' needs lower).
    pub(super) fn press(&self, name: &str) {
        let hooks: Vec<Hook> = {
            let l = self.ledger();
            l.pressure
                .iter()
                .filter(|(k, _)| {
                    k.as_str() != name && l.caches.get(k.as_str()).is_some_and(|&b| b > 0)
                })
                .map(|(_, h)| h.clone())
                .collect()
        };
        // Outside the lock: a hook sends on a channel.
        for h in hooks {
            (h.0)();
        }
    }
}

/// A request waiting for room: its need counts against the other models' prompt caches
/// until it is reserved or refused.
pub(super) struct Waiting {
    budget: Arc<Budget>,
    name: String,
    bytes: u64,
}

impl Waiting {
    pub(super) fn new(budget: &Arc<Budget>, name: &str, bytes: u64) -> Self {
        *budget.ledger().waiting.entry(name.to_owned()).or_default() += bytes;
        Waiting {
            budget: budget.clone(),
            name: name.to_owned(),
            bytes,
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let mut l = self.budget.ledger();
        if let Some(w) = l.waiting.get_mut(&self.name) {
            *w -= self.bytes;
            if *w == 0 {
                l.waiting.remove(&self.name);
            }
        }
    }
}

/// A model thread's part of the budget: the shared ledger and its model's name in it.
/// Dropped with the thread's worker (after its prompt cache): its cache leaves the ledger.
#[derive(Debug)]
pub struct Share {
    pub budget: Arc<Budget>,
    pub key: String,
}

impl Share {
    /// Trims a prompt cache holding `held(slack)` bytes (each entry counted with `slack`
    /// more) by `trim(room, slack)` to the model's room, the ledger's count an upper bound
    /// throughout.
    pub fn trim(&self, held: impl Fn(u64) -> u64, trim: impl FnOnce(u64, u64)) {
        let slack = self.budget.entry_slack();
        let counted = self.budget.prompt_cache_counted(&self.key);
        let room = self.budget.claim_prompt_cache(&self.key, held(slack));
        trim(room, slack);
        let kept = held(slack);
        self.budget.set_prompt_cache(&self.key, kept);
        // The claim already lowered the count to the room, so a trim down to the room (or
        // to 0 at a room of 0) is no lower than it: the waiters are woken against the
        // count before the claim, or they would wait out `--budget-wait` for nothing.
        if kept < counted {
            self.budget.freed.notify_waiters();
        }
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.budget.ledger().caches.remove(&self.key);
        self.budget.freed.notify_waiters();
    }
}
