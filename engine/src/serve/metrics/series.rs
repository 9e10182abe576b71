//! The series read at each scrape (what `/stats` reads), one family per metric with one
//! sample per model (`model="NAME"`), from a table (`SERIES`): a name, its help, whether it
//! counts or gauges, an optional second label, and how it reads one model's numbers.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use crate::cache::prompt::PromptCacheStats;
use crate::cache::ssd::SsdStats;
use crate::serve::store::StatsMirror;
use crate::serve::Counters;

/// One model's numbers: its counters (kept across its loads) and, while it is loaded, its
/// prompt cache's and SSD tier's.
pub(super) struct Source {
    pub name: String,
    pub counters: Arc<Counters>,
    pub caches: Option<StatsMirror>,
}

/// What a series reads, taken once per model per scrape.
struct Reading<'a> {
    c: &'a Counters,
    ram: Option<PromptCacheStats>,
    ssd: Option<SsdStats>,
}

impl Reading<'_> {
    fn n(a: &std::sync::atomic::AtomicU64) -> Option<u64> {
        Some(a.load(Ordering::Relaxed))
    }

    /// Requests running on `lane` ("batch" when `--batch N` took, else "serial").
    fn running(&self, batch: bool) -> Option<u64> {
        let on_batch = self.c.batch_slots.load(Ordering::Relaxed) > 0;
        let running = self.c.running.load(Ordering::Relaxed) as u64;
        Some(if on_batch == batch { running } else { 0 })
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Counter,
    Gauge,
}

struct Series {
    name: &'static str,
    help: &'static str,
    kind: Kind,
    /// A second label (key, value), beside `model`.
    label: Option<(&'static str, &'static str)>,
    /// None: the model has no such number now (an unloaded model's caches, the SSD tier off).
    read: fn(&Reading) -> Option<u64>,
}

const fn series(
    name: &'static str,
    help: &'static str,
    kind: Kind,
    read: fn(&Reading) -> Option<u64>,
) -> Series {
    Series {
        name,
        help,
        kind,
        label: None,
        read,
    }
}

const OUTCOME: &str = "Generation requests by how they ended (as /stats counts them; stalled \
                       ones are also cancelled)";
const RUNNING: &str = "Requests running on the model thread, by lane";

const fn outcome(value: &'static str, read: fn(&Reading) -> Option<u64>) -> Series {
    Series {
        name: "requests_outcome",
        help: OUTCOME,
        kind: Kind::Counter,
        label: Some(("outcome", value)),
        read,
    }
}

const fn lane(value: &'static str, read: fn(&Reading) -> Option<u64>) -> Series {
    Series {
        name: "running_requests",
        help: RUNNING,
        kind: Kind::Gauge,
        label: Some(("lane", value)),
        read,
    }
}

use Kind::{Counter, Gauge};

/// Every series, in exposition order; rows of one family are adjacent.
const SERIES: &[Series] = &[
    series(
        "prompt_tokens",
        "Prompt tokens of finished requests (as their usage counts them)",
        Counter,
        |r| Reading::n(&r.c.prompt_tokens),
    ),
    series(
        "generation_tokens",
        "Generated tokens of finished requests (as their usage counts them)",
        Counter,
        |r| match crate::plant::is(crate::plant::Defect::MetricsTokensOutUncounted) {
            // Planted: generated tokens are never counted (caught by the exposition gates).
            true => Some(0),
            false => Reading::n(&r.c.completion_tokens),
        },
    ),
    outcome("completed", |r| Reading::n(&r.c.completed)),
    outcome("failed", |r| Reading::n(&r.c.failed)),
    outcome("cancelled", |r| Reading::n(&r.c.cancelled)),
    outcome("rejected", |r| Reading::n(&r.c.rejected)),
    outcome("throttled", |r| Reading::n(&r.c.throttled)),
    outcome("stalled", |r| Reading::n(&r.c.stalled)),
    outcome("timed_out", |r| Reading::n(&r.c.timed_out)),
    series(
        "queue_depth",
        "Requests waiting for the model (arrived, not yet running)",
        Gauge,
        |r| Some(r.c.queued.load(Ordering::Relaxed) as u64),
    ),
    lane("serial", |r| r.running(false)),
    lane("batch", |r| r.running(true)),
    series(
        "batch_slots",
        "Rows of the batch lane (0: serial lane only)",
        Gauge,
        |r| Some(r.c.batch_slots.load(Ordering::Relaxed) as u64),
    ),
    series(
        "batch_peak_rows",
        "The most rows the batch lane decoded together",
        Gauge,
        |r| Some(r.c.batch_peak.load(Ordering::Relaxed) as u64),
    ),
    series(
        "prompt_cache_hits",
        "Requests whose prompt continued a prompt-cache entry",
        Counter,
        |r| r.ram.as_ref().map(|s| s.hits),
    ),
    series(
        "prompt_cache_misses",
        "Requests the prompt cache had nothing for",
        Counter,
        |r| r.ram.as_ref().map(|s| s.misses),
    ),
    series(
        "prompt_cache_reused_tokens",
        "Prompt tokens served from the prompt cache instead of prefilled",
        Counter,
        |r| r.ram.as_ref().map(|s| s.reused_tokens),
    ),
    series(
        "prompt_cache_entries",
        "Conversations' KV caches held in RAM by the prompt cache",
        Gauge,
        |r| r.ram.as_ref().map(|s| s.entries as u64),
    ),
    series(
        "kv_cache_bytes",
        "Bytes of KV cache the prompt cache holds in RAM (the caches of running requests \
         are not counted)",
        Gauge,
        |r| r.ram.as_ref().map(|s| s.bytes as u64),
    ),
    series(
        "ssd_cache_restores",
        "Prefixes restored from the SSD tier (its hits)",
        Counter,
        |r| r.ssd.as_ref().map(|s| s.restores),
    ),
    series(
        "ssd_cache_spills",
        "Entries written to the SSD tier",
        Counter,
        |r| r.ssd.as_ref().map(|s| s.spills),
    ),
    series(
        "ssd_cache_removed_corrupt",
        "SSD-tier entries removed as corrupt or inconsistent",
        Counter,
        |r| r.ssd.as_ref().map(|s| s.removed_corrupt),
    ),
    series("ssd_cache_entries", "Entries in the SSD tier", Gauge, |r| {
        r.ssd.as_ref().map(|s| s.entries as u64)
    }),
    series(
        "ssd_cache_bytes",
        "Bytes the SSD tier's files hold",
        Gauge,
        |r| r.ssd.as_ref().map(|s| s.bytes),
    ),
];

/// The collector of `SERIES` over every model's `Source`.
pub(super) struct Shared(pub Arc<Mutex<Vec<Source>>>);

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("metrics::Shared")
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Collector for Shared {
    fn encode(&self, mut e: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let sources = lock(&self.0);
        let mut shown: Vec<&Source> = sources.iter().collect();
        // Planted: only the first (default) model's series are exported (caught by
        // engine/tests/it/serve_fleet.rs).
        if crate::plant::is(crate::plant::Defect::MetricsDefaultModelOnly) {
            shown.truncate(1);
        }
        let readings: Vec<(&str, Reading)> = shown
            .iter()
            .map(|s| {
                let reading = Reading {
                    c: &s.counters,
                    ram: s.caches.as_ref().map(|m| lock(&m.ram).clone()),
                    ssd: s.caches.as_ref().and_then(|m| lock(&m.ssd).clone()),
                };
                (s.name.as_str(), reading)
            })
            .collect();
        for family in SERIES.chunk_by(|a, b| a.name == b.name) {
            let samples: Vec<(Vec<(&str, &str)>, u64)> = readings
                .iter()
                .flat_map(|(model, r)| {
                    family.iter().filter_map(move |s| {
                        let mut labels = vec![("model", *model)];
                        labels.extend(s.label);
                        (s.read)(r).map(|v| (labels, v))
                    })
                })
                .collect();
            if samples.is_empty() {
                continue;
            }
            let (name, help, kind) = (family[0].name, family[0].help, family[0].kind);
            let metric_type = match kind {
                Counter => MetricType::Counter,
                Gauge => MetricType::Gauge,
            };
            let mut m = e.encode_descriptor(name, help, None, metric_type)?;
            for (labels, v) in samples {
                let sample = m.encode_family(&labels)?;
                match kind {
                    Counter => ConstCounter::new(v).encode(sample)?,
                    Gauge => ConstGauge::new(v as i64).encode(sample)?,
                }
            }
        }
        Ok(())
    }
}
