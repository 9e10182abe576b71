//! The HTTP routes: bodies are read as bytes and parsed here, so that every malformed
//! request becomes an OpenAI-style 4xx naming the problem (never a panic, never a hang).

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};
use std::time::Instant;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::emit::{Event, TokenLogprob, EVENT_SLOTS};
use super::error::ApiError;
use super::request::GenRequest;
use super::tools::split::Delta;
use super::worker::{prompt_bytes, Job, QueueSlot, Work};
use super::AppState;

/// The chat page (plain HTML/CSS/JS, embedded in the binary).
const CHAT_PAGE: &str = include_str!("page/chat.html");

pub(super) async fn chat_page() -> axum::response::Html<&'static str> {
    axum::response::Html(CHAT_PAGE)
}

/// The server's routes, with `more` (the Responses API's, which live in `responses`).
pub fn router(state: Arc<AppState>, max_body: usize, more: Router<Arc<AppState>>) -> Router {
    Router::new()
        .route("/", get(chat_page))
        .route("/index.html", get(chat_page))
        .route("/v1/chat/completions", post(chat))
        .route("/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/stats", get(stats))
        .merge(more)
        .fallback(|| async {
            ApiError::invalid("no such route").with_status(StatusCode::NOT_FOUND)
        })
        .layer(DefaultBodyLimit::max(max_body))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            super::guard::check,
        ))
        // Outermost: every response is counted, the guard's refusals included.
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            super::metrics::count,
        ))
        .with_state(state)
}

async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    let mut data = vec![json!({
        "id": s.model_id, "object": "model", "created": s.created, "owned_by": "engine"
    })];
    data.extend(super::adapters::model_entries(&s));
    Json(json!({"object": "list", "data": data}))
}

async fn stats(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(stats_json(&s))
}

/// `/stats`' body for one model (`fleet` shows one per model).
pub(super) fn stats_json(s: &AppState) -> Value {
    let c = &s.counters;
    let n = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let mut v = counted(c);
    let more = json!({
        "model": s.model_id,
        "uptime_s": s.started.elapsed().as_secs_f64(),
        "lanes": {
            "serial": 1,
            "batch_slots": c.batch_slots.load(Ordering::Relaxed),
            "serial_reason": c.serial_reason.get(),
            "batch_peak_rows": c.batch_peak.load(Ordering::Relaxed),
            "batch_parks": n(&c.batch_parks),
            "batch_lone_steps": n(&c.batch_lone_steps),
            "batch_retried_alone": n(&c.batch_retried_alone),
            "batch_prompt_batches": n(&c.batch_prompt_batches),
            // How the batch lane serves rows of different adapters (null: no batch lane).
            "batch_adapters": (c.batch_slots.load(Ordering::Relaxed) > 0).then_some("grouped"),
        },
        "speculative": {
            "drafted": n(&c.spec_drafted),
            "accepted": n(&c.spec_accepted),
            "target_calls": n(&c.spec_target_calls),
            "fallbacks": n(&c.spec_fallbacks),
        },
        // Serial lane: one-token steps its ended requests ran through the compiled graph.
        "decode": { "compiled_steps": n(&c.compiled_steps) },
        "group": crate::dist::group().map(|g| json!({
            "rank": g.rank, "size": g.size, "mode": g.mode.name(),
        })),
        "prompt_cache": *s.prompt_cache.lock().unwrap_or_else(|e| e.into_inner()),
        "ssd_cache": *s.ssd_cache.lock().unwrap_or_else(|e| e.into_inner()),
        "memory": super::budget::stats(s),
    });
    if let (Some(v), Value::Object(more)) = (v.as_object_mut(), more) {
        v.extend(more);
    }
    v
}

/// A model's request counters (`/stats`; the fleet's for a model not loaded now). Every
/// request is counted in `requests` before its end is counted (with Release), and a stalled
/// one as cancelled before stalled: loading the ends first (Acquire, stalled before
/// cancelled) and `requests` last keeps what a reader sees consistent — no more ends than
/// requests, no more stalled than cancelled — while requests come and go.
pub(super) fn counted(c: &super::Counters) -> Value {
    let end = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Acquire);
    // Planted: `requests` read first, as it was.
    let early = crate::plant::is(crate::plant::Defect::StatsRequestsReadFirst)
        .then(|| c.requests.load(Ordering::Acquire));
    let stalled = end(&c.stalled);
    let ends = [
        ("completed", end(&c.completed)),
        ("failed", end(&c.failed)),
        ("rejected", end(&c.rejected)),
        ("cancelled", end(&c.cancelled)),
        ("timed_out", end(&c.timed_out)),
        ("throttled", end(&c.throttled)),
    ];
    let requests = early.unwrap_or_else(|| c.requests.load(Ordering::Acquire));
    let mut v = json!({
        "requests": requests,
        "stalled": stalled,
        "queued": c.queued.load(Ordering::Relaxed),
        "running": c.running.load(Ordering::Relaxed),
        "prompt_tokens": c.prompt_tokens.load(Ordering::Relaxed),
        "completion_tokens": c.completion_tokens.load(Ordering::Relaxed),
    });
    for (name, n) in ends {
        v[name] = json!(n);
    }
    v
}

pub(super) fn body_json(body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    let bytes = body.map_err(|e| {
        let status = e.status();
        let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "the request body is larger than this server accepts (--max-body-bytes)".to_owned()
        } else {
            format!("cannot read the request body: {e}")
        };
        ApiError::invalid(message).with_status(status)
    })?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::invalid(format!("invalid JSON in the request body: {e}")))
}

async fn chat(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    handle(s, body, true)
        .await
        .unwrap_or_else(|e| e.into_response())
}

async fn completions(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(s, body, false)
        .await
        .unwrap_or_else(|e| e.into_response())
}

/// What every response chunk shares.
struct Meta {
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    chat: bool,
}

impl Meta {
    /// One response body or streamed chunk, shaped as mlx_lm.server's generate_response:
    /// `content` (null in a whole answer without text), `reasoning` and `tool_calls` when
    /// there are any (streamed calls keep their `index`).
    fn chunk(
        &self,
        delta: &Delta,
        finish: Option<&str>,
        logprobs: &[TokenLogprob],
        stream: bool,
    ) -> Value {
        let text = delta.text.as_str();
        let mut choice = json!({"index": 0, "finish_reason": finish});
        if self.chat {
            let key = if stream { "delta" } else { "message" };
            let mut msg = json!({"role": "assistant"});
            if !stream || !text.is_empty() {
                msg["content"] = if text.is_empty() && !stream {
                    Value::Null
                } else {
                    json!(text)
                };
            }
            if !delta.reasoning.is_empty() {
                msg["reasoning"] = json!(delta.reasoning);
            }
            if !delta.tool_calls.is_empty() {
                let calls = delta.tool_calls.iter().map(|c| c.chat_json(stream));
                msg["tool_calls"] = Value::Array(calls.collect());
            }
            choice[key] = msg;
        } else {
            choice["text"] = json!(text);
        }
        if !logprobs.is_empty() {
            choice["logprobs"] = json!({"content": logprobs.iter().map(|t| json!({
                "token": t.token, "id": t.id, "logprob": t.logprob,
                "top_logprobs": t.top.iter().map(|(id, tok, lp)| json!({
                    "token": tok, "id": id, "logprob": lp
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>()});
        }
        json!({
            "id": self.id, "object": self.object, "created": self.created,
            "model": self.model, "system_fingerprint": crate::VERSION,
            "choices": [choice],
        })
    }
}

async fn handle(
    s: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    chat: bool,
) -> Result<Response, ApiError> {
    s.counters.requests.fetch_add(1, Ordering::Relaxed);
    let req = body_json(body)
        .and_then(|v| super::api::parse(&v, chat, &s.defaults))
        .inspect_err(|_| {
            s.counters.rejected.fetch_add(1, Ordering::Release);
        })?;
    let meta = s.meta(chat, req.stream);
    let (stream, include_usage) = (req.stream, req.include_usage);
    let events = match submit(&s, req).await {
        Ok(events) => events,
        Err(refused) => return Ok(refused),
    };
    if stream {
        Ok(respond_streamed(
            events,
            meta,
            include_usage,
            s.sse_keep_alive,
        ))
    } else {
        respond_whole(events, meta).await
    }
}

/// Queues a validated request on the model thread: its events after `Started`, or the
/// answer refusing it (draining, queue full, a prompt the model cannot take). Shared by
/// the chat, completions and responses routes.
pub(super) async fn submit(
    s: &Arc<AppState>,
    req: GenRequest,
) -> Result<impl futures_util::Stream<Item = Event> + Send + Unpin + 'static, Response> {
    submit_started(s, req).await.map(|(_, events)| events)
}

/// `submit`, with the prompt's length in tokens (the Messages API's message_start tells it).
pub(super) async fn submit_started(
    s: &Arc<AppState>,
    req: GenRequest,
) -> Result<
    (
        usize,
        impl futures_util::Stream<Item = Event> + Send + Unpin + 'static,
    ),
    Response,
> {
    if s.limits.draining.load(Ordering::Relaxed) {
        return Err(refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is shutting down",
        ));
    }
    let adapter = s.adapters.resolve(req.model.as_deref()).map_err(|e| {
        s.counters.rejected.fetch_add(1, Ordering::Release);
        e.into_response()
    })?;
    // The deadline counts from arrival: time spent queued or encoding is part of it.
    let arrival = Instant::now();
    let deadline = s.limits.request_timeout.map(|d| arrival + d);
    let Some(queued) = QueueSlot::take(&s.counters, s.max_queue) else {
        s.counters.throttled.fetch_add(1, Ordering::Release);
        return Err(refuse(
            StatusCode::TOO_MANY_REQUESTS,
            "the server's queue is full (--max-queue); retry later",
        ));
    };
    let (req, prompt_ids) = encode(s, req).await.map_err(IntoResponse::into_response)?;
    let budget = super::budget::admit(s, prompt_ids.len(), req.max_tokens, deadline).await?;
    let (tx, rx) = mpsc::channel(EVENT_SLOTS);
    super::lost::track(&tx);
    let job = Job {
        request: req,
        prompt_ids,
        events: tx,
        deadline,
        queued,
        adapter,
        budget,
    };
    let sent = s
        .jobs
        .lock()
        .map_err(|_| ApiError::server("the request queue is poisoned").into_response())?
        .as_ref()
        .map(|jobs| jobs.send(Work::Generate(job)).is_ok());
    if sent != Some(true) {
        return Err(ApiError::server("the model thread has stopped")
            .with_status(StatusCode::SERVICE_UNAVAILABLE)
            .into_response());
    }
    let mut events = ReceiverStream::new(rx).flat_map(|ev| stream::iter(flatten(ev)));
    // The first event tells whether the request was accepted (prompt encoded, fits).
    match events.next().await {
        Some(Event::Started { prompt_tokens }) => {
            Ok((prompt_tokens, s.metrics.observe(events, arrival)))
        }
        Some(Event::Failed(e)) => Err(e.into_response()),
        _ => Err(ApiError::server("the model thread dropped the request").into_response()),
    }
}

impl AppState {
    /// The fields every response chunk of the next request carries.
    fn meta(&self, chat: bool, stream: bool) -> Meta {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        Meta {
            id: format!("{}-{n}", if chat { "chatcmpl" } else { "cmpl" }),
            object: match (chat, stream) {
                (true, true) => "chat.completion.chunk",
                (true, false) => "chat.completion",
                (false, _) => "text_completion",
            },
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: self.model_id.clone(),
            chat,
        }
    }
}

/// Encodes the prompt (template + tokenizer) on the blocking pool, never on the model
/// thread; big prompts take turns, so a flood of them leaves a core to the model.
async fn encode(s: &AppState, req: GenRequest) -> Result<(GenRequest, Vec<u32>), ApiError> {
    let _turn = if prompt_bytes(&req.prompt) > BIG_PROMPT_BYTES {
        Some(
            s.big_prompts
                .acquire()
                .await
                .map_err(|_| ApiError::server("the encoder has stopped"))?,
        )
    } else {
        None
    };
    let encoder = s.encoder.clone();
    let (req, encoded) = tokio::task::spawn_blocking(move || {
        let mut req = req;
        let ids = encoder.encode_request(&mut req);
        (req, ids)
    })
    .await
    .map_err(|_| ApiError::server("encoding the prompt failed"))?;
    let req = encoded
        .and_then(|ids| {
            Ok((
                super::tools::strict::apply(req, &ids, &s.encoder.markers)?,
                ids,
            ))
        })
        .inspect_err(|_| {
            s.counters.rejected.fetch_add(1, Ordering::Release);
        })?;
    Ok(req)
}

/// The whole answer as one JSON body, once it is done.
async fn respond_whole(
    mut events: impl futures_util::Stream<Item = Event> + Unpin,
    meta: Meta,
) -> Result<Response, ApiError> {
    let mut whole = Delta::default();
    let mut logprobs = Vec::new();
    let mut add = |d: Delta| {
        whole.text.push_str(&d.text);
        whole.reasoning.push_str(&d.reasoning);
        whole.tool_calls.extend(d.tool_calls);
    };
    while let Some(ev) = events.next().await {
        match ev {
            Event::Text { delta, logprobs: l } => {
                add(delta);
                logprobs.extend(l);
            }
            Event::Done {
                finish_reason,
                usage,
                last,
                ..
            } => {
                add(last);
                let mut body = meta.chunk(&whole, Some(finish_reason), &logprobs, false);
                body["usage"] = usage.json();
                return Ok(Json(body).into_response());
            }
            Event::Failed(e) => return Err(e),
            Event::Started { .. } | Event::Progress(_) | Event::Batch(_) => {}
        }
    }
    Err(ApiError::server("the model thread dropped the request"))
}

/// The answer as server-sent events: a chunk per text event, the last with the
/// finish_reason, a usage-only chunk when asked (`stream_options.include_usage`), then
/// `[DONE]`. As mlx_lm.server, the finish chunk carries no usage.
fn respond_streamed(
    events: impl futures_util::Stream<Item = Event> + Send + 'static,
    meta: Meta,
    include_usage: bool,
    keep_alive: Option<std::time::Duration>,
) -> Response {
    let events = events.flat_map(move |ev| {
        let data: Vec<Value> = match ev {
            Event::Text { delta, logprobs } => vec![meta.chunk(&delta, None, &logprobs, true)],
            Event::Done {
                finish_reason,
                usage,
                last,
                ..
            } => {
                let mut out = vec![meta.chunk(&last, Some(finish_reason), &[], true)];
                if include_usage {
                    let mut only = meta.chunk(&Delta::default(), None, &[], true);
                    only["choices"] = json!([]);
                    only["usage"] = usage.json();
                    out.push(only);
                }
                out
            }
            Event::Failed(e) => vec![e.body()],
            Event::Progress(p) => {
                let mut chunk = meta.chunk(&Delta::default(), None, &[], true);
                chunk["choices"] = json!([]);
                chunk["prompt_progress"] = p.json();
                vec![chunk]
            }
            Event::Started { .. } | Event::Batch(_) => vec![],
        };
        stream::iter(
            data.into_iter()
                .map(|v| Ok::<_, Infallible>(SseEvent::default().data(v.to_string())))
                .collect::<Vec<_>>(),
        )
    });
    let done = stream::iter([Ok::<_, Infallible>(SseEvent::default().data("[DONE]"))]);
    super::progress::sse(keep_alive, events.chain(done))
}

/// Prompts longer than this (bytes of text) are encoded one at a time.
const BIG_PROMPT_BYTES: usize = 64 << 10;

/// A batch of events as the events it holds, in order.
fn flatten(ev: Event) -> Vec<Event> {
    match ev {
        Event::Batch(events) => events.into_iter().flat_map(flatten).collect(),
        other => vec![other],
    }
}

/// A refusal the client may retry (429 queue full, 503 draining), with `Retry-After`.
fn refuse(status: StatusCode, message: &str) -> Response {
    let mut response = ApiError::server(message)
        .with_status(status)
        .into_response();
    response.headers_mut().insert(
        axum::http::header::RETRY_AFTER,
        axum::http::HeaderValue::from_static("1"),
    );
    response
}

#[cfg(test)]
mod counted_tests {
    use std::sync::atomic::Ordering;

    /// A writer counts requests that start and complete as fast as it can while `/stats`
    /// is read 100 000 times: no reading shows more completed than requests. Planted: the
    /// old order, `requests` first → caught: readings go on until one shows it (within 30 s:
    /// on a loaded machine the writer may not run beside the reader for a while, and 100 000
    /// readings were once not enough).
    #[test]
    fn stats_never_show_more_ended_than_started_requests() {
        let worst = |until_caught: Option<std::time::Duration>| {
            let c = std::sync::Arc::new(super::super::Counters::default());
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let writer = {
                let (c, stop) = (c.clone(), stop.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        c.requests.fetch_add(1, Ordering::Relaxed);
                        c.completed.fetch_add(1, Ordering::Release);
                    }
                })
            };
            let mut worst = 0i64;
            let start = std::time::Instant::now();
            for n in 0.. {
                let v = super::counted(&c);
                let ahead = v["completed"].as_i64().unwrap() - v["requests"].as_i64().unwrap();
                worst = worst.max(ahead);
                let more = match until_caught {
                    None => n + 1 < 100_000,
                    Some(limit) => worst == 0 && start.elapsed() < limit,
                };
                if !more {
                    break;
                }
            }
            stop.store(true, Ordering::Relaxed);
            writer.join().unwrap();
            worst
        };
        assert_eq!(
            worst(None),
            0,
            "a reading showed more completed than requests"
        );
        let _on = crate::plant::on(crate::plant::Defect::StatsRequestsReadFirst).unwrap();
        let limit = std::time::Duration::from_secs(30);
        assert!(worst(Some(limit)) > 0, "the planted defect was not caught");
    }
}
