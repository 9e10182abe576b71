//! `GET /metrics`: the server's numbers in the Prometheus text exposition format, version
//! 0.0.4 (what a Prometheus server scrapes; written by the Prometheus org's
//! `prometheus-client` crate, never by hand).
//!
//! Three sources: a middleware (`count`) counts every response by route, method and status
//! code, so routes added later are counted too; a wrapper around each generation's event
//! stream (`observe`, applied in `routes::submit`) times the first token and the tokens
//! after it; and a collector reads, at each scrape, what `/stats` reads (`Counters`, the
//! prompt cache's and the SSD tier's numbers), so the two never disagree.
//!
//! Like every API route, `/metrics` needs `--api-key` when one is set (a scrape config
//! sends it as `authorization: {credentials: KEY}`; docs/serve.md).

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use futures_util::Stream;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::emit::Event;
use super::error::ApiError;
use super::{AppState, Counters};
use crate::cache::prompt::PromptCacheStats;
use crate::cache::ssd::SsdStats;

/// Seconds to the first token: from a request's arrival (queueing and prefill included).
const TTFT_BUCKETS: [f64; 14] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
];
/// Seconds per output token after the first (a request's mean).
const TPOT_BUCKETS: [f64; 13] = [
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5,
];
/// Seconds from arrival to the last event.
const E2E_BUCKETS: [f64; 12] = [
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// A response's labels in `engine_http_requests_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct RouteLabels {
    method: String,
    /// The route's pattern (`/v1/chat/completions`); `unmatched` for paths no route has,
    /// so a scan of random paths cannot grow the label set.
    route: String,
    code: String,
}

/// The server's metrics: those it observes itself; the rest are read at scrape time.
pub struct Metrics {
    registry: Registry,
    requests: Family<RouteLabels, Counter>,
    ttft: Histogram,
    tpot: Histogram,
    e2e: Histogram,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Metrics {
    /// The registry, with the collector reading the shared numbers.
    pub fn new(
        counters: Arc<Counters>,
        prompt_cache: Arc<Mutex<PromptCacheStats>>,
        ssd_cache: Arc<Mutex<Option<SsdStats>>>,
    ) -> Self {
        let mut registry = Registry::with_prefix("engine");
        let requests = Family::<RouteLabels, Counter>::default();
        registry.register(
            "http_requests",
            "HTTP responses by method, route and status code",
            requests.clone(),
        );
        let ttft = Histogram::new(TTFT_BUCKETS);
        registry.register(
            "time_to_first_token_seconds",
            "Seconds from a generation request's arrival to its first output",
            ttft.clone(),
        );
        let tpot = Histogram::new(TPOT_BUCKETS);
        registry.register(
            "time_per_output_token_seconds",
            "A request's mean seconds per output token after the first (inter-token latency)",
            tpot.clone(),
        );
        let e2e = Histogram::new(E2E_BUCKETS);
        registry.register(
            "request_duration_seconds",
            "Seconds from a generation request's arrival to its last event",
            e2e.clone(),
        );
        registry.register_collector(Box::new(Shared {
            counters,
            prompt_cache,
            ssd_cache,
        }));
        Metrics {
            registry,
            requests,
            ttft,
            tpot,
            e2e,
        }
    }

    /// Adds a collector read at each scrape (another module's numbers).
    pub fn add_collector(&mut self, collector: Box<dyn Collector>) {
        self.registry.register_collector(collector);
    }

    /// The exposition text.
    pub fn render(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &self.registry)?;
        // Planted: a sample line loses its value (caught by both exposition parsers:
        // engine/tests/it/serve_metrics.rs and oracles/prometheus_check.py).
        if crate::plant::is(crate::plant::Defect::MetricsMalformedLine) {
            text = text.replacen("engine_queue_depth 0", "engine_queue_depth", 1);
        }
        Ok(text)
    }

    /// Wraps a generation's events (after `Started`): its first output and its end are
    /// timed from `arrival`.
    pub fn observe<S>(self: &Arc<Self>, events: S, arrival: Instant) -> Observed<S> {
        Observed {
            inner: events,
            metrics: self.clone(),
            arrival,
            first: None,
            ended: false,
        }
    }
}

/// A generation's event stream, timed (`Metrics::observe`).
pub struct Observed<S> {
    inner: S,
    metrics: Arc<Metrics>,
    arrival: Instant,
    first: Option<Instant>,
    ended: bool,
}

impl<S: Stream<Item = Event> + Unpin> Stream for Observed<S> {
    type Item = Event;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        let polled = Pin::new(&mut self.inner).poll_next(cx);
        if let Poll::Ready(Some(ev)) = &polled {
            let now = Instant::now();
            match ev {
                Event::Text { .. } if self.first.is_none() => {
                    self.first = Some(now);
                    let m = &self.metrics;
                    m.ttft.observe((now - self.arrival).as_secs_f64());
                }
                Event::Done { usage, .. } if !self.ended => {
                    self.ended = true;
                    let first = match self.first {
                        Some(t) => t,
                        // An answer whose one output came with Done (or none at all).
                        None => {
                            self.metrics
                                .ttft
                                .observe((now - self.arrival).as_secs_f64());
                            now
                        }
                    };
                    let n = usage.completion_tokens;
                    if n >= 2 {
                        let per = (now - first).as_secs_f64() / (n - 1) as f64;
                        self.metrics.tpot.observe(per);
                    }
                    self.metrics.e2e.observe((now - self.arrival).as_secs_f64());
                }
                _ => {}
            }
        }
        polled
    }
}

/// What `/stats` reads, read again at each scrape.
struct Shared {
    counters: Arc<Counters>,
    prompt_cache: Arc<Mutex<PromptCacheStats>>,
    ssd_cache: Arc<Mutex<Option<SsdStats>>>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("metrics::Shared")
    }
}

/// One sample of a metric without labels.
fn one(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric: &impl EncodeMetric,
) -> Result<(), std::fmt::Error> {
    let m = encoder.encode_descriptor(name, help, None, metric.metric_type())?;
    metric.encode(m)
}

/// Samples of one metric, one per value of label `key`.
fn labelled(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    key: &'static str,
    samples: &[(&'static str, &dyn EncodeMetric)],
) -> Result<(), std::fmt::Error> {
    let Some((_, first)) = samples.first() else {
        return Ok(());
    };
    let mut m = encoder.encode_descriptor(name, help, None, first.metric_type())?;
    for (value, metric) in samples {
        let labels = [(key, *value)];
        metric.encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for Shared {
    fn encode(&self, mut e: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let c = &self.counters;
        let n = |a: &std::sync::atomic::AtomicU64| ConstCounter::new(a.load(Ordering::Relaxed));
        let out = if crate::plant::is(crate::plant::Defect::MetricsTokensOutUncounted) {
            // Planted: generated tokens are never counted (caught by the exposition gates).
            ConstCounter::new(0)
        } else {
            n(&c.completion_tokens)
        };
        one(
            &mut e,
            "prompt_tokens",
            "Prompt tokens of finished requests (as their usage counts them)",
            &n(&c.prompt_tokens),
        )?;
        one(
            &mut e,
            "generation_tokens",
            "Generated tokens of finished requests (as their usage counts them)",
            &out,
        )?;
        let outcomes = [
            ("completed", n(&c.completed)),
            ("failed", n(&c.failed)),
            ("cancelled", n(&c.cancelled)),
            ("rejected", n(&c.rejected)),
            ("throttled", n(&c.throttled)),
            ("stalled", n(&c.stalled)),
            ("timed_out", n(&c.timed_out)),
        ];
        let samples: Vec<(&'static str, &dyn EncodeMetric)> = outcomes
            .iter()
            .map(|(k, v)| (*k, v as &dyn EncodeMetric))
            .collect();
        labelled(
            &mut e,
            "requests_outcome",
            "Generation requests by how they ended (as /stats counts them; stalled ones \
             are also cancelled)",
            "outcome",
            &samples,
        )?;
        let gauge = |v: usize| ConstGauge::new(v as i64);
        one(
            &mut e,
            "queue_depth",
            "Requests waiting for the model (arrived, not yet running)",
            &gauge(c.queued.load(Ordering::Relaxed)),
        )?;
        // One lane serves at a time: the batch lane when `--batch N` took, else the serial.
        let slots = c.batch_slots.load(Ordering::Relaxed);
        let running = c.running.load(Ordering::Relaxed);
        let (serial, batch) = if slots > 0 {
            (gauge(0), gauge(running))
        } else {
            (gauge(running), gauge(0))
        };
        labelled(
            &mut e,
            "running_requests",
            "Requests running on the model thread, by lane",
            "lane",
            &[("serial", &serial), ("batch", &batch)],
        )?;
        one(
            &mut e,
            "batch_slots",
            "Rows of the batch lane (0: serial lane only)",
            &gauge(slots),
        )?;
        one(
            &mut e,
            "batch_peak_rows",
            "The most rows the batch lane decoded together",
            &gauge(c.batch_peak.load(Ordering::Relaxed)),
        )?;
        let ram = {
            let stats = self.prompt_cache.lock().unwrap_or_else(|p| p.into_inner());
            (
                stats.hits,
                stats.misses,
                stats.reused_tokens,
                stats.entries,
                stats.bytes,
            )
        };
        let (hits, misses, reused_tokens, entries, bytes) = ram;
        one(
            &mut e,
            "prompt_cache_hits",
            "Requests whose prompt continued a prompt-cache entry",
            &ConstCounter::new(hits),
        )?;
        one(
            &mut e,
            "prompt_cache_misses",
            "Requests the prompt cache had nothing for",
            &ConstCounter::new(misses),
        )?;
        one(
            &mut e,
            "prompt_cache_reused_tokens",
            "Prompt tokens served from the prompt cache instead of prefilled",
            &ConstCounter::new(reused_tokens),
        )?;
        one(
            &mut e,
            "prompt_cache_entries",
            "Conversations' KV caches held in RAM by the prompt cache",
            &gauge(entries),
        )?;
        one(
            &mut e,
            "kv_cache_bytes",
            "Bytes of KV cache the prompt cache holds in RAM (the caches of running \
             requests are not counted)",
            &gauge(bytes),
        )?;
        let ssd = self
            .ssd_cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|s| (s.restores, s.spills, s.removed_corrupt, s.entries, s.bytes));
        if let Some((restores, spills, removed_corrupt, entries, bytes)) = ssd {
            one(
                &mut e,
                "ssd_cache_restores",
                "Prefixes restored from the SSD tier (its hits)",
                &ConstCounter::new(restores),
            )?;
            one(
                &mut e,
                "ssd_cache_spills",
                "Entries written to the SSD tier",
                &ConstCounter::new(spills),
            )?;
            one(
                &mut e,
                "ssd_cache_removed_corrupt",
                "SSD-tier entries removed as corrupt or inconsistent",
                &ConstCounter::new(removed_corrupt),
            )?;
            one(
                &mut e,
                "ssd_cache_entries",
                "Entries in the SSD tier",
                &gauge(entries),
            )?;
            one(
                &mut e,
                "ssd_cache_bytes",
                "Bytes the SSD tier's files hold",
                &ConstGauge::new(bytes as i64),
            )?;
        }
        Ok(())
    }
}

/// Counts every response under its route's pattern, method and status code.
pub async fn count(State(s): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", MatchedPath::as_str)
        .to_owned();
    let method = request.method().as_str().to_owned();
    let response = next.run(request).await;
    let labels = RouteLabels {
        method,
        route,
        code: response.status().as_u16().to_string(),
    };
    s.metrics.requests.get_or_create(&labels).inc();
    response
}

async fn scrape(State(s): State<Arc<AppState>>) -> Response {
    match s.metrics.render() {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            )],
            text,
        )
            .into_response(),
        Err(_) => ApiError::server("the metrics could not be written").into_response(),
    }
}

/// `/metrics`.
pub fn routes() -> Router<Arc<AppState>> {
    Router::new().route("/metrics", get(scrape))
}
