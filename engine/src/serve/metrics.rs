//! `GET /metrics`: the server's numbers in the Prometheus text exposition format, version
//! 0.0.4 (what a Prometheus server scrapes; written by the Prometheus org's
//! `prometheus-client` crate, never by hand).
//!
//! One registry per server; every per-model series carries `model="NAME"` (the name
//! `/v1/models` lists), so a many-model server (`fleet`) exposes each family once with a
//! sample per model, and a single-model server is the case of one model. Sources: a
//! middleware (`count`) counts every response by model, route, method and status code, so
//! routes added later are counted too; a wrapper around each generation's event stream
//! (`ModelMetrics::observe`, applied in `routes::submit`) times the first token and the
//! tokens after it; a collector (`series`) reads, at each scrape, what `/stats` reads
//! (`Counters`, kept across a model's loads, and the prompt cache's and the SSD tier's
//! numbers while it is loaded), so the two never disagree; the load series (`loaded`,
//! `unloaded`); and, with `--memory-budget`, the budget's gauges (server-wide, unlabelled).
//!
//! Like every API route, `/metrics` needs `--api-key` when one is set (a scrape config
//! sends it as `authorization: {credentials: KEY}`; docs/serve.md).

mod series;

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use futures_util::Stream;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::emit::Event;
use super::error::ApiError;
use super::store::StatsMirror;
use super::{AppState, Counters};

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
/// Seconds a model's load took.
const LOAD_BUCKETS: [f64; 12] = [
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
];

fn ttft() -> Histogram {
    Histogram::new(TTFT_BUCKETS)
}
fn tpot() -> Histogram {
    Histogram::new(TPOT_BUCKETS)
}
fn e2e() -> Histogram {
    Histogram::new(E2E_BUCKETS)
}
fn load() -> Histogram {
    Histogram::new(LOAD_BUCKETS)
}

/// A series' model: its name as `/v1/models` lists it.
#[derive(Debug, Clone, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct ModelLabel {
    model: String,
}

/// A response's labels in `engine_http_requests_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct RouteLabels {
    /// Empty for what a many-model server's front answers itself (no model's router ran).
    model: String,
    method: String,
    /// The route's pattern (`/v1/chat/completions`); `unmatched` for paths no route has,
    /// so a scan of random paths cannot grow the label set.
    route: String,
    code: String,
}

type Histograms = Family<ModelLabel, Histogram, fn() -> Histogram>;

/// A server's metrics: those it observes itself; the rest are read at scrape time.
pub struct Metrics {
    registry: Registry,
    names: Vec<ModelLabel>,
    requests: Family<RouteLabels, Counter>,
    ttft: Histograms,
    tpot: Histograms,
    e2e: Histograms,
    loaded: Family<ModelLabel, Gauge>,
    loads: Family<ModelLabel, Counter>,
    unloads: Family<ModelLabel, Counter>,
    load_seconds: Histograms,
    sources: Arc<Mutex<Vec<series::Source>>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Metrics {
    /// The registry of a server of `models` (name, counters), each not loaded yet; with
    /// `budget`, its gauges too.
    pub fn new(
        models: Vec<(String, Arc<Counters>)>,
        budget: Option<Arc<super::budget::Budget>>,
    ) -> Arc<Self> {
        let mut r = Registry::with_prefix("engine");
        let requests = Family::<RouteLabels, Counter>::default();
        r.register(
            "http_requests",
            "HTTP responses by model, method, route and status code",
            requests.clone(),
        );
        let histograms = |r: &mut Registry, name: &str, help: &str, make: fn() -> Histogram| {
            let family = Histograms::new_with_constructor(make);
            r.register(name, help, family.clone());
            family
        };
        let ttft = histograms(
            &mut r,
            "time_to_first_token_seconds",
            "Seconds from a generation request's arrival to its first output",
            ttft,
        );
        let tpot = histograms(
            &mut r,
            "time_per_output_token_seconds",
            "A request's mean seconds per output token after the first (inter-token latency)",
            tpot,
        );
        let e2e = histograms(
            &mut r,
            "request_duration_seconds",
            "Seconds from a generation request's arrival to its last event",
            e2e,
        );
        let loaded = Family::<ModelLabel, Gauge>::default();
        r.register(
            "model_loaded",
            "Whether the model is loaded (1) or not (0)",
            loaded.clone(),
        );
        let loads = Family::<ModelLabel, Counter>::default();
        r.register("model_loads", "Loads of the model", loads.clone());
        let unloads = Family::<ModelLabel, Counter>::default();
        r.register("model_unloads", "Unloads of the model", unloads.clone());
        let load_seconds = histograms(
            &mut r,
            "model_load_seconds",
            "Seconds a load of the model took",
            load,
        );
        let names: Vec<ModelLabel> = models
            .iter()
            .map(|(name, _)| ModelLabel {
                model: name.clone(),
            })
            .collect();
        // Every model has its series from the start (0 until it loads).
        for name in &names {
            loaded.get_or_create(name).set(0);
            let _ = loads.get_or_create(name);
            let _ = unloads.get_or_create(name);
            let _ = load_seconds.get_or_create(name);
        }
        let sources = models
            .into_iter()
            .map(|(name, counters)| series::Source {
                name,
                counters,
                caches: None,
            })
            .collect();
        let sources = Arc::new(Mutex::new(sources));
        r.register_collector(Box::new(series::Shared(sources.clone())));
        if let Some(b) = budget {
            r.register_collector(Box::new(super::budget::Gauges(b)));
        }
        Arc::new(Metrics {
            registry: r,
            names,
            requests,
            ttft,
            tpot,
            e2e,
            loaded,
            loads,
            unloads,
            load_seconds,
            sources,
        })
    }

    fn sources(&self) -> std::sync::MutexGuard<'_, Vec<series::Source>> {
        self.sources.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Model `i` loaded in `took`, its caches' numbers in `caches`: its handle.
    pub fn loaded(self: &Arc<Self>, i: usize, caches: StatsMirror, took: Duration) -> ModelMetrics {
        let name = &self.names[i];
        self.loaded.get_or_create(name).set(1);
        self.loads.get_or_create(name).inc();
        self.load_seconds
            .get_or_create(name)
            .observe(took.as_secs_f64());
        self.sources()[i].caches = Some(caches);
        ModelMetrics {
            all: self.clone(),
            label: name.clone(),
        }
    }

    /// Model `i` unloaded: its caches' series go (its counters stay).
    pub fn unloaded(&self, i: usize) {
        let name = &self.names[i];
        self.loaded.get_or_create(name).set(0);
        self.unloads.get_or_create(name).inc();
        self.sources()[i].caches = None;
    }

    /// Counts a response a many-model server's front answered itself (`model=""`).
    pub fn count_front(&self, method: &str, route: &str, code: u16) {
        let labels = RouteLabels {
            model: String::new(),
            method: method.to_owned(),
            route: route.to_owned(),
            code: code.to_string(),
        };
        self.requests.get_or_create(&labels).inc();
    }

    /// The exposition text.
    pub fn render(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &self.registry)?;
        // Planted: a sample line loses its value (caught by both exposition parsers:
        // engine/tests/it/serve_metrics.rs and oracles/prometheus_check.py).
        if crate::plant::is(crate::plant::Defect::MetricsMalformedLine) {
            if let Some(at) = text.find("\nengine_queue_depth{") {
                let end = text[at + 1..].find('\n').map_or(text.len(), |n| at + 1 + n);
                if let Some(space) = text[at..end].rfind(' ') {
                    text.replace_range(at + space..end, "");
                }
            }
        }
        Ok(text)
    }

    /// The `/metrics` answer.
    pub fn response(&self) -> Response {
        match self.render() {
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
}

/// One model's hold on its server's metrics (`AppState::metrics`).
#[derive(Debug, Clone)]
pub struct ModelMetrics {
    all: Arc<Metrics>,
    label: ModelLabel,
}

impl ModelMetrics {
    /// A single-model server's metrics: `name` loaded in `took`.
    pub fn single(
        name: &str,
        counters: Arc<Counters>,
        caches: StatsMirror,
        budget: Option<Arc<super::budget::Budget>>,
        took: Duration,
    ) -> Self {
        Metrics::new(vec![(name.to_owned(), counters)], budget).loaded(0, caches, took)
    }

    /// The whole server's metrics.
    pub fn server(&self) -> &Metrics {
        &self.all
    }

    /// Wraps a generation's events (after `Started`): its first output and its end are
    /// timed from `arrival`.
    pub fn observe<S>(&self, events: S, arrival: Instant) -> Observed<S> {
        Observed {
            inner: events,
            metrics: self.clone(),
            arrival,
            first: None,
            ended: false,
        }
    }

    fn time(&self, family: &Histograms, since: Instant, now: Instant) {
        family
            .get_or_create(&self.label)
            .observe((now - since).as_secs_f64());
    }
}

/// A generation's event stream, timed (`ModelMetrics::observe`).
pub struct Observed<S> {
    inner: S,
    metrics: ModelMetrics,
    arrival: Instant,
    first: Option<Instant>,
    ended: bool,
}

impl<S: Stream<Item = Event> + Unpin> Stream for Observed<S> {
    type Item = Event;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_next(cx);
        if let Poll::Ready(Some(ev)) = &polled {
            let now = Instant::now();
            let (m, all, arrival) = (&this.metrics, &this.metrics.all, this.arrival);
            match ev {
                Event::Text { .. } if this.first.is_none() => {
                    m.time(&all.ttft, arrival, now);
                    this.first = Some(now);
                }
                Event::Done { usage, .. } if !this.ended => {
                    // An answer whose one output came with Done (or none at all).
                    let first = this.first.unwrap_or_else(|| {
                        m.time(&all.ttft, arrival, now);
                        now
                    });
                    let n = usage.completion_tokens;
                    if n >= 2 {
                        let per = (now - first).as_secs_f64() / (n - 1) as f64;
                        all.tpot.get_or_create(&m.label).observe(per);
                    }
                    m.time(&all.e2e, arrival, now);
                    this.ended = true;
                }
                _ => {}
            }
        }
        polled
    }
}

/// Counts every response under its model, its route's pattern, method and status code.
pub async fn count(State(s): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", MatchedPath::as_str)
        .to_owned();
    let method = request.method().as_str().to_owned();
    let response = next.run(request).await;
    let labels = RouteLabels {
        model: s.metrics.label.model.clone(),
        method,
        route,
        code: response.status().as_u16().to_string(),
    };
    s.metrics.all.requests.get_or_create(&labels).inc();
    response
}

async fn scrape(State(s): State<Arc<AppState>>) -> Response {
    s.metrics.all.response()
}

/// `/metrics`.
pub fn routes() -> Router<Arc<AppState>> {
    Router::new().route("/metrics", get(scrape))
}
