//! `POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API on
//! the chat route's machinery (the `anthropic` Python client's types are the reference).
//! A request is read as its typed body (`body`), turned into the same `GenRequest` a chat
//! completion gets (`input`), run on the model thread as any chat completion, on either
//! lane, and its deltas become content blocks and stream events (`events`). Errors, the
//! guard's included, are Anthropic's `{"type": "error", "error": {"type", "message"}}`
//! with its statuses (`error::anthropic`).

mod body;
mod events;
mod input;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::json;

use super::emit::Event;
use super::error::anthropic::{kind, reshape, response as anthropic};
use super::error::ApiError;
use super::responses::sse;
use super::{routes, AppState};
use events::{Head, Machine};
use input::Purpose;

/// `/v1/messages` and `/v1/messages/count_tokens`, for `routes::router`.
pub fn routes() -> axum::Router<Arc<AppState>> {
    axum::Router::new()
        .route("/v1/messages", axum::routing::post(create))
        .route(
            "/v1/messages/count_tokens",
            axum::routing::post(count_tokens),
        )
        .route("/v1/messages/{*rest}", axum::routing::any(not_found))
}

/// Any other path under /v1/messages (the batches API, …): Anthropic's not_found_error.
async fn not_found() -> Response {
    let e = ApiError::invalid(
        "no such route: this server's Messages API has /v1/messages and \
         /v1/messages/count_tokens",
    )
    .with_status(StatusCode::NOT_FOUND);
    anthropic(&e)
}

async fn count_tokens(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    count(&s, body).await.unwrap_or_else(|e| anthropic(&e))
}

/// `{"input_tokens": N}`: the rendered prompt's length, as a generation's usage counts it.
async fn count(
    s: &Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let v = routes::body_json(body)?;
    let t = input::translate(&v, &s.defaults, &s.encoder.markers, Purpose::Count)?;
    let encoder = s.encoder.clone();
    let prompt = t.request.prompt;
    let ids = tokio::task::spawn_blocking(move || encoder.encode(&prompt))
        .await
        .map_err(|_| ApiError::server("encoding the prompt failed"))??;
    Ok(Json(json!({"input_tokens": ids.len()})).into_response())
}

/// The create route's handler.
async fn create(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    match run(&s, body).await {
        Ok(r) => r,
        Err(Refusal::Api(e)) => anthropic(&e),
        Err(Refusal::Shaped(r)) => reshape(r).await,
    }
}

enum Refusal {
    Api(ApiError),
    /// A refusal made by the shared machinery, in OpenAI's shape.
    Shaped(Response),
}

async fn run(s: &Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, Refusal> {
    s.counters.requests.fetch_add(1, Relaxed);
    let reject = |e: ApiError| {
        s.counters
            .rejected
            .fetch_add(1, std::sync::atomic::Ordering::Release);
        Refusal::Api(e)
    };
    let v = routes::body_json(body).map_err(reject)?;
    let t =
        input::translate(&v, &s.defaults, &s.encoder.markers, Purpose::Create).map_err(reject)?;
    let stream = t.request.stream;
    let images = !t.request.images.is_empty();
    let (prompt_tokens, events) = routes::submit_started(s, t.request)
        .await
        .map_err(Refusal::Shaped)?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let n = s.next_id.fetch_add(1, Relaxed);
    let machine = Machine::new(Head {
        id: format!("msg_{:012x}{n:08x}", now.as_micros() & 0xffff_ffff_ffff),
        model: t.model.unwrap_or_else(|| s.model_id.clone()),
        input_tokens: prompt_tokens,
    });
    // An answer about images is sent as mlx_vlm.server sends it: leading whitespace too.
    let machine = match images {
        true => machine.sending_space(),
        false => machine,
    };
    if stream {
        Ok(streamed(events, machine, s.sse_keep_alive))
    } else {
        whole(events, machine).await
    }
}

/// The whole message, once the answer is done.
async fn whole(
    mut events: impl Stream<Item = Event> + Unpin,
    mut m: Machine,
) -> Result<Response, Refusal> {
    while let Some(ev) = events.next().await {
        match ev {
            Event::Text { delta, .. } => {
                m.delta(&delta);
            }
            Event::Done {
                finish_reason,
                usage,
                last,
                stop_sequence,
            } => {
                m.delta(&last);
                let (_, message) = m.finish(finish_reason, stop_sequence.as_deref(), &usage);
                return Ok(Json(message).into_response());
            }
            Event::Failed(e) => return Err(Refusal::Api(e)),
            Event::Started { .. } | Event::Progress(_) | Event::Batch(_) => {}
        }
    }
    Err(Refusal::Api(ApiError::server(
        "the model thread dropped the request",
    )))
}

/// The answer as Anthropic's stream events (`event: <type>` and `data: <json>`), from
/// message_start to message_stop (or an `error` event); `ping`s keep an idle stream alive.
fn streamed(
    events: impl Stream<Item = Event> + Send + 'static,
    mut m: Machine,
    keep_alive: Option<std::time::Duration>,
) -> Response {
    let start: Vec<_> = m.start().into_iter().map(sse).collect();
    let mut ended = false;
    let body = events.flat_map(move |ev| {
        let out = match ev {
            _ if ended => Vec::new(),
            Event::Text { delta, .. } => m.delta(&delta),
            Event::Done {
                finish_reason,
                usage,
                last,
                stop_sequence,
            } => {
                let mut out = m.delta(&last);
                out.extend(m.finish(finish_reason, stop_sequence.as_deref(), &usage).0);
                ended = true;
                out
            }
            Event::Failed(e) => {
                ended = true;
                let (k, _) = kind(e.status);
                vec![super::error::anthropic::body(k, &e.message)]
            }
            Event::Started { .. } | Event::Progress(_) | Event::Batch(_) => Vec::new(),
        };
        stream::iter(out.into_iter().map(sse).collect::<Vec<_>>())
    });
    let ping = SseEvent::default()
        .event("ping")
        .data("{\"type\": \"ping\"}");
    super::progress::sse_pinging(keep_alive, stream::iter(start).chain(body), ping)
}
