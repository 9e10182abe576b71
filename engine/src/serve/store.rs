//! The prompt store: where finished conversations' KV caches wait for the next request
//! that starts the same way. Two tiers — RAM (`PromptCache`) and, with `--ssd-cache`, SSD
//! (`SsdStore`) — behind one `take` / `keep`:
//!
//! - `take` hands over the longest usable cached prefix of a prompt: from RAM, or from the
//!   SSD tier when it holds a strictly longer one (restored and trimmed to the match).
//! - `keep` puts finished caches in RAM; what RAM evicts is written to the SSD tier at
//!   once, and the new entry becomes a write-behind snapshot, written once the lane has been
//!   idle for the debounce time (`recv`), or at `flush` (shutdown). A pending snapshot of
//!   an earlier prefix of the same conversation is superseded (coalesced).
//! - The tiers' numbers are mirrored into shared cells (`StatsMirror`) for `/stats`, since
//!   the store itself holds MLX arrays and stays on the model thread.
//!
//! It knows nothing of requests or HTTP: keys are (namespace, tokens), values caches.

use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use crate::cache::prompt::{Hit, PromptCache, PromptCacheStats};
use crate::cache::ssd::{SsdStats, SsdStore};
use crate::cache::{Cache, QuantSdpa};

/// Where a `PromptStore` mirrors its tiers' numbers, readable from any thread.
#[derive(Clone, Default)]
pub struct StatsMirror {
    pub ram: Arc<Mutex<PromptCacheStats>>,
    /// None while the SSD tier is off.
    pub ssd: Arc<Mutex<Option<SsdStats>>>,
}

pub struct PromptStore {
    ram: PromptCache,
    ssd: Option<SsdStore>,
    /// Write-behind: RAM entries (namespace, tokens) not yet on the SSD tier.
    pending: Vec<(String, Vec<u32>)>,
    debounce: Duration,
    /// How restored quantized caches attend (the session's KV plan).
    sdpa: QuantSdpa,
    mirror: StatsMirror,
}

impl PromptStore {
    /// A store over `ram` and, if on, `ssd`; its numbers are mirrored into `mirror` from
    /// now on. Write-behind snapshots wait for `debounce` of idleness.
    pub fn new(
        ram: PromptCache,
        ssd: Option<SsdStore>,
        sdpa: QuantSdpa,
        debounce: Duration,
        mirror: StatsMirror,
    ) -> Self {
        let store = PromptStore {
            ram,
            ssd,
            pending: Vec::new(),
            debounce,
            sdpa,
            mirror,
        };
        store.sync_stats();
        store
    }

    /// The RAM tier.
    pub fn ram(&self) -> &PromptCache {
        &self.ram
    }

    /// The SSD tier, if on.
    pub fn ssd(&self) -> Option<&SsdStore> {
        self.ssd.as_ref()
    }

    /// Write-behind snapshots not yet written: (namespace, tokens), oldest first.
    pub fn pending(&self) -> &[(String, Vec<u32>)] {
        &self.pending
    }

    /// Takes the longest usable cached prefix of `prompt`: from RAM, or from the SSD tier
    /// when it holds a strictly longer one (restored and trimmed to the match).
    pub fn take(&mut self, ns: &str, prompt: &[u32]) -> Option<Hit> {
        let hit = self.ram.take(ns, prompt);
        let ram = hit.as_ref().map_or(0, |h| h.reused);
        let sdpa = self.sdpa;
        let from_disk = self.ssd.as_mut().and_then(|store| {
            let (index, usable) = store.find(ns, prompt).filter(|&(_, n)| n > ram)?;
            let caches = store.restore(index, usable, sdpa)?;
            Some(Hit {
                caches,
                reused: usable,
            })
        });
        self.sync_stats();
        from_disk.or(hit)
    }

    /// Keeps finished caches holding `tokens` for later requests: in the RAM tier, with the
    /// SSD tier (if on) getting what RAM evicts now and a write-behind snapshot later.
    pub fn keep(&mut self, ns: &str, tokens: Vec<u32>, caches: Vec<Box<dyn Cache>>) {
        if self.ssd.is_some() {
            // Coalesced: an earlier pending prefix of the same conversation is superseded.
            self.pending
                .retain(|(n, t)| !(n == ns && tokens.starts_with(t)));
            self.pending.push((ns.to_owned(), tokens.clone()));
        }
        let evicted = self.ram.put(ns, tokens, caches);
        self.spill(evicted);
        self.sync_stats();
    }

    /// RAM evictions go to the SSD tier (if on), no longer pending there.
    fn spill(&mut self, evicted: Vec<crate::cache::prompt::Evicted>) {
        if let Some(store) = self.ssd.as_mut() {
            for e in evicted {
                write_ssd(store, &e.ns, &e.tokens, &e.caches);
                self.pending
                    .retain(|(n, t)| !(*n == e.ns && *t == e.tokens));
            }
        }
    }

    /// The RAM tier's bytes, each entry counted with `slack` more (as `trim_ram` counts).
    pub fn ram_held(&self, slack: u64) -> u64 {
        let stats = self.ram.stats();
        stats.bytes as u64 + slack * stats.entries as u64
    }

    /// Trims the RAM tier to `max` bytes (each entry counted with `slack` more: a memory
    /// budget's room); what it evicts goes to the SSD tier as any RAM eviction does.
    pub fn trim_ram(&mut self, max: u64, slack: u64) {
        let evicted = self.ram.evict_to(max, slack);
        if evicted.is_empty() {
            return;
        }
        self.spill(evicted);
        self.sync_stats();
    }

    /// Keeps `caches` under the first tokens of `tokens` that every cache holds: caches
    /// holding more (an EOS fed, drafts past the last verify) are trimmed to that count;
    /// if one cannot be, nothing is kept.
    pub fn keep_fed(&mut self, ns: &str, mut caches: Vec<Box<dyn Cache>>, mut tokens: Vec<u32>) {
        let fed = crate::cache::common_len(&caches, tokens.len());
        for c in caches.iter_mut() {
            let extra = c.offset() - fed as i32;
            if extra > 0 && c.trim(extra) != extra {
                return;
            }
        }
        tokens.truncate(fed);
        self.keep(ns, tokens, caches);
    }

    /// Writes the pending write-behind snapshots still in RAM (an entry a later request took
    /// is gone from RAM: that request keeps a longer one).
    pub fn flush(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        let Some(store) = self.ssd.as_mut() else {
            return;
        };
        for (ns, tokens) in pending {
            if let Some(caches) = self.ram.peek(&ns, &tokens) {
                write_ssd(store, &ns, &tokens, caches);
            }
        }
        self.sync_stats();
    }

    /// Waits for the next item of `rx`. Pending write-behind snapshots are written once
    /// nothing has arrived for the debounce time, and before returning None (every sender
    /// gone).
    pub fn recv<T>(&mut self, rx: &mpsc::Receiver<T>) -> Option<T> {
        if !self.pending.is_empty() {
            match super::turn::outside(|| rx.recv_timeout(self.debounce)) {
                Ok(item) => return Some(item),
                Err(mpsc::RecvTimeoutError::Timeout) => self.flush(),
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    self.flush();
                    return None;
                }
            }
        }
        let item = super::turn::outside(|| rx.recv().ok());
        if item.is_none() {
            self.flush();
        }
        item
    }

    /// Mirrors the tiers' numbers for /stats.
    fn sync_stats(&self) {
        if let Ok(mut stats) = self.mirror.ram.lock() {
            *stats = self.ram.stats();
        }
        if let Ok(mut stats) = self.mirror.ssd.lock() {
            *stats = self.ssd.as_ref().map(SsdStore::stats);
        }
    }
}

/// Writes an entry to the SSD tier unless it already holds these tokens (or all but the
/// last: a prompt's last token is always fed again, so that entry serves as well).
fn write_ssd(store: &mut SsdStore, ns: &str, tokens: &[u32], caches: &[Box<dyn Cache>]) {
    let covered = store
        .find(ns, tokens)
        .is_some_and(|(_, n)| n + 1 >= tokens.len());
    if !covered {
        store.store(ns, tokens, caches, &crate::clock::now_utc());
    }
}
