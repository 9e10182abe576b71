//! `POST /v1/responses` (and `/responses`): OpenAI's Responses API on the chat route's
//! machinery. A request is read as its typed body and turned into the same `GenRequest`
//! a chat completion gets (`input`), run on the model thread as any chat completion, and
//! its deltas become output items and stream events (`events`). Each response's
//! conversation is kept (`store`) for `previous_response_id`; its rendered
//! prompt extends the previous turn's, so the prompt cache reuses it.

mod body;
mod events;
mod input;
pub mod store;

use std::convert::Infallible;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};

use super::emit::{Event, Usage};
use super::error::ApiError;
use super::{routes, AppState};
use events::{Head, Machine};
use input::Refused;

/// `/v1/responses` and `/responses`, for `routes::router`.
pub fn routes() -> axum::Router<Arc<AppState>> {
    axum::Router::new()
        .route("/v1/responses", axum::routing::post(create))
        .route("/responses", axum::routing::post(create))
}

/// The route's handler.
pub async fn create(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    run(&s, body).await.unwrap_or_else(|r| r)
}

fn refused(r: Refused) -> Response {
    let mut body = r.error.body();
    body["error"]["code"] = json!(r.code);
    (r.error.status, Json(body)).into_response()
}

async fn run(s: &Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, Response> {
    s.counters.requests.fetch_add(1, Relaxed);
    let reject = |r: Refused| {
        s.counters
            .rejected
            .fetch_add(1, std::sync::atomic::Ordering::Release);
        refused(r)
    };
    let v = routes::body_json(body).map_err(|e| reject(e.into()))?;
    let t = input::translate(&v, &s.responses, &s.defaults).map_err(reject)?;
    let req = t.request;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let n = s.next_id.fetch_add(1, Relaxed);
    let head = Head {
        id: format!("resp_{:012x}{n:08x}", now.as_micros() & 0xffff_ffff_ffff),
        created_at: now.as_secs(),
        model: s.model_id.clone(),
        echo: t.echo,
        temperature: req.sampling.temp,
        top_p: req.sampling.top_p,
    };
    let stream = req.stream;
    let events = routes::submit(s, req).await?;
    let keep = Keep {
        state: s.clone(),
        conversation: t.conversation,
    };
    let machine = Machine::new(head);
    if stream {
        Ok(streamed(events, machine, keep))
    } else {
        whole(events, machine, keep).await
    }
}

/// What a finished response leaves: its usage, and its conversation kept for the next
/// turn (unless `store: false`).
struct Keep {
    state: Arc<AppState>,
    conversation: Vec<Value>,
}

impl Keep {
    /// `usage`, with the reasoning text's tokens (re-encoded) as reasoning_tokens.
    fn usage(&self, u: &Usage, m: &Machine) -> Value {
        let reasoning = if m.reasoning.is_empty() {
            0
        } else {
            self.state
                .encoder
                .tokenizer
                .encode(&m.reasoning, false)
                .map_or(0, |ids| ids.len())
        };
        events::usage(u, reasoning.min(u.completion_tokens))
    }

    fn save(&mut self, m: &Machine) {
        if !m.head().echo.store {
            return;
        }
        let mut conversation = std::mem::take(&mut self.conversation);
        conversation.push(m.assistant_message());
        self.state.responses.put(m.id().to_owned(), conversation);
    }
}

/// The whole response object, once the answer is done.
async fn whole(
    mut events: impl Stream<Item = Event> + Unpin,
    mut m: Machine,
    mut keep: Keep,
) -> Result<Response, Response> {
    while let Some(ev) = events.next().await {
        match ev {
            Event::Text { delta, .. } => {
                m.delta(&delta);
            }
            Event::Done {
                finish_reason,
                usage,
                last,
                ..
            } => {
                m.delta(&last);
                let usage = keep.usage(&usage, &m);
                let (_, response) = m.finish(finish_reason, usage);
                keep.save(&m);
                return Ok(Json(response).into_response());
            }
            Event::Failed(e) => return Err(e.into_response()),
            Event::Started { .. } | Event::Progress(_) | Event::Batch(_) => {}
        }
    }
    Err(ApiError::server("the model thread dropped the request").into_response())
}

/// A stream event as its SSE frame (`event: <type>`, `data: <json>`); the Messages API
/// frames its events alike.
pub(super) fn sse(v: Value) -> Result<SseEvent, Infallible> {
    let kind = v["type"].as_str().unwrap_or("message").to_owned();
    Ok(SseEvent::default().event(kind).data(v.to_string()))
}

/// The answer as Responses stream events (`event: <type>` and `data: <json>`), ending
/// with response.completed (or response.incomplete, or an `error` event).
fn streamed(
    events: impl Stream<Item = Event> + Send + 'static,
    mut m: Machine,
    mut keep: Keep,
) -> Response {
    let start: Vec<_> = m.start().into_iter().map(sse).collect();
    let keep_alive = keep.state.sse_keep_alive;
    let mut ended = false;
    let body = events.flat_map(move |ev| {
        let out = match ev {
            _ if ended => Vec::new(),
            Event::Text { delta, .. } => m.delta(&delta),
            Event::Done {
                finish_reason,
                usage,
                last,
                ..
            } => {
                let mut out = m.delta(&last);
                let usage = keep.usage(&usage, &m);
                out.extend(m.finish(finish_reason, usage).0);
                keep.save(&m);
                ended = true;
                out
            }
            Event::Failed(e) => {
                ended = true;
                vec![m.error(&e)]
            }
            Event::Started { .. } | Event::Progress(_) | Event::Batch(_) => Vec::new(),
        };
        stream::iter(out.into_iter().map(sse).collect::<Vec<_>>())
    });
    super::progress::sse(keep_alive, stream::iter(start).chain(body))
}
