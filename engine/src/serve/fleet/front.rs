//! The many-model server's front router: the guard, then the routes about every model
//! (`/v1/models`, `/stats`, `/metrics`, `/health`, the chat page); any other request is
//! read (up to `--max-body-bytes`), routed by its JSON `model` field (`Catalog::route`;
//! GET requests and bodies without one go to the default model) and forwarded, unchanged,
//! to that model's own router, which answers it as a single-model server would.
//!
//! An unknown model is OpenAI's 404 (`"code": "model_not_found"`, the names listed; on
//! `/v1/messages` Anthropic's `not_found_error`).
//!
//! `/metrics` is the one registry every model writes to (`serve::metrics`: each series
//! labelled `model`); what the front answers itself is counted under `model=""`.

use std::sync::Arc;

use axum::body::{Body, HttpBody};
use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use futures_util::StreamExt;
use serde_json::{json, Value};
use tower::ServiceExt;

use super::{catalog::Catalog, Fleet, Phase};
use crate::plant::{self, Defect};
use crate::serve::error::{anthropic, ApiError};
use crate::serve::guard::{self, Guard};

struct Front {
    fleet: Arc<Fleet>,
    guard: Guard,
}

/// The front router (see the module doc).
pub fn router(fleet: Arc<Fleet>, guard: Guard) -> Router {
    Router::new()
        .fallback(front)
        .with_state(Arc::new(Front { fleet, guard }))
}

/// A refusal in the shape the route's clients read.
fn refuse(path: &str, e: ApiError) -> Response {
    let busy = e.status == StatusCode::SERVICE_UNAVAILABLE;
    let mut response = match anthropic::owns(path) {
        true => anthropic::response(&e),
        false => e.into_response(),
    };
    // A load waiting on busy models (slots or the memory budget): they free room.
    if busy {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("5"));
    }
    response
}

async fn front(State(f): State<Arc<Front>>, request: Request) -> Response {
    let method = request.method().as_str().to_owned();
    let (route, response) = answer(&f, request).await;
    // What the front answered itself; a model's router counts its own answers.
    if let Some(route) = route {
        let code = response.status().as_u16();
        f.fleet.metrics.count_front(&method, route, code);
    }
    response
}

/// The routes the front answers itself (GET).
const OWN: [&str; 6] = [
    "/v1/models",
    "/stats",
    "/metrics",
    "/health",
    "/",
    "/index.html",
];

/// The answer, and the route it is counted under when the front gave it (`unrouted`: a
/// refusal before any model's router ran).
async fn answer(f: &Front, request: Request) -> (Option<&'static str>, Response) {
    let path = request.uri().path().to_owned();
    let own = OWN.into_iter().find(|r| *r == path);
    if let Some(refused) = guard::refusal(&f.guard, &request) {
        f.fleet.entries[0].counters.refused_at_the_door();
        let route = Some(own.unwrap_or("unrouted"));
        if anthropic::owns(&path) {
            return (route, anthropic::reshape(refused).await);
        }
        return (route, refused);
    }
    if let (Some(route), &Method::GET) = (own, request.method()) {
        let response = match route {
            "/v1/models" => models(&f.fleet),
            "/stats" => stats(&f.fleet),
            "/metrics" => f.fleet.metrics.response(),
            "/health" => Json(json!({"status": "ok"})).into_response(),
            _ => crate::serve::routes::chat_page().await.into_response(),
        };
        return (Some(route), response);
    }
    match forward(&f.fleet, request).await {
        Ok(response) => (None, response),
        Err(e) => (Some("unrouted"), refuse(&path, e)),
    }
}

/// A request body's `model` (other fields are skipped unread).
#[derive(serde::Deserialize)]
struct Probe {
    model: Option<Value>,
}

/// The model a body names: None when it names none (or is not a JSON object: the model's
/// router refuses that, as it does today).
fn requested(body: &[u8]) -> Result<Option<String>, ApiError> {
    let Ok(probe) = serde_json::from_slice::<Probe>(body) else {
        return Ok(None);
    };
    match probe.model {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(ApiError::field(
            "model",
            "model must be a string naming a model (GET /v1/models lists them)",
        )),
    }
}

/// OpenAI's 404 for a name that is no model's; a long name is cut in the message.
fn not_found(name: &str, catalog: &Catalog) -> ApiError {
    let shown: String = name.chars().take(80).collect();
    let cut = if shown.len() < name.len() { "…" } else { "" };
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!(
            "The model `{shown}{cut}` does not exist on this server; its models are {} \
             (GET /v1/models lists them)",
            catalog.names().join(", ")
        ),
        param: None,
        kind: "invalid_request_error",
        code: Some("model_not_found"),
    }
}

async fn forward(fleet: &Arc<Fleet>, request: Request) -> Result<Response, ApiError> {
    let (parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, fleet.args.max_body_bytes)
        .await
        .map_err(|e| {
            // to_bytes' failures: the limit (http-body-util's LengthLimitError, whose text
            // this reads), or a body that broke off.
            let mut too_large = false;
            let mut cause: Option<&dyn std::error::Error> = Some(&e);
            while let Some(c) = cause {
                too_large |= c.to_string().contains("length limit exceeded");
                cause = c.source();
            }
            if too_large {
                ApiError::invalid(
                    "the request body is larger than this server accepts (--max-body-bytes)",
                )
                .with_status(StatusCode::PAYLOAD_TOO_LARGE)
            } else {
                ApiError::invalid(format!("cannot read the request body: {e}"))
            }
        })?;
    let name = requested(&bytes)?;
    let index = match fleet.catalog.route(name.as_deref()) {
        Ok(_) if plant::is(Defect::FleetRoutesToDefault) => 0,
        Ok(i) => i,
        Err(_) => return Err(not_found(name.as_deref().unwrap_or(""), &fleet.catalog)),
    };
    let lease = fleet.acquire(index).await?;
    let request = Request::from_parts(parts, Body::from(bytes));
    let router = lease.loaded.router.clone();
    let response = match router.oneshot(request).await {
        Ok(r) => r,
        Err(never) => match never {},
    };
    // A whole body (a JSON answer) is done with the model; a stream holds it to its end.
    if response.body().size_hint().exact().is_some() {
        return Ok(response);
    }
    let (parts, body) = response.into_parts();
    let held = body.into_data_stream().map(move |chunk| {
        let _ = &lease;
        chunk
    });
    Ok(Response::from_parts(parts, Body::from_stream(held)))
}

/// `/v1/models`: every configured model, loaded or not.
fn models(fleet: &Fleet) -> Response {
    let data: Vec<Value> = fleet
        .entries
        .iter()
        .flat_map(|e| {
            let phase = &e.life().phase;
            let mut listed = vec![json!({
                "id": e.spec.name,
                "object": "model",
                "created": fleet.created,
                "owned_by": "engine",
                "path": e.spec.canonical,
                "loaded": matches!(phase, Phase::Loaded(_)),
            })];
            // A loaded model's adapters, named `MODEL:ADAPTER` (the front routes by MODEL).
            if let Phase::Loaded(l) = phase {
                listed.extend(l.state.adapters.listed().into_iter().map(|(name, _)| {
                    json!({
                        "id": format!("{}:{name}", e.spec.name), "object": "model",
                        "created": fleet.created, "owned_by": "engine",
                        "parent": e.spec.name, "loaded": true,
                    })
                }));
            }
            listed
        })
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// One model's `/stats` numbers: a loaded model's as a single-model server's, with its
/// loads; an unloaded one's counters.
fn model_stats(fleet: &Fleet, i: usize) -> Value {
    let e = &fleet.entries[i];
    let life = e.life();
    let (loaded, mut v) = match &life.phase {
        Phase::Loaded(l) => (true, crate::serve::routes::stats_json(&l.state)),
        _ => {
            let mut v = crate::serve::routes::counted(&e.counters);
            v["model"] = json!(e.spec.canonical);
            (false, v)
        }
    };
    v["name"] = json!(e.spec.name);
    v["loaded"] = json!(loaded);
    v["loading"] = json!(matches!(life.phase, Phase::Loading));
    v["pinned"] = json!(e.pinned);
    v["loads"] = json!(life.loads);
    v["unloads"] = json!(life.unloads);
    v["load_ms"] = json!(life.load_ms);
    v["last_used"] = json!(life.last_used_unix);
    v["leases"] = json!(life.leases);
    v["last_error"] = json!(life.failed.as_ref().map(|(_, why)| why));
    v
}

/// `/stats`: the default model's numbers at the top level (as a single-model server's),
/// and `models`: every model's.
fn stats(fleet: &Fleet) -> Response {
    let mut top = model_stats(fleet, 0);
    let models: serde_json::Map<String, Value> = (0..fleet.entries.len())
        .map(|i| (fleet.entries[i].spec.name.clone(), model_stats(fleet, i)))
        .collect();
    top["uptime_s"] = json!(fleet.started.elapsed().as_secs_f64());
    top["max_models"] = json!(fleet.max_models);
    top["model_ttl_s"] = json!(fleet.ttl.map(|t| t.as_secs_f64()));
    // The one budget every model shares, and every loaded model's prompt cache.
    let prompt_cache: u64 = fleet
        .all_loaded()
        .iter()
        .map(|l| l.state.prompt_cache.lock().map_or(0, |p| p.bytes as u64))
        .sum();
    top["memory"] = crate::serve::budget::memory(fleet.budget.as_deref(), prompt_cache);
    top["models"] = Value::Object(models);
    Json(top).into_response()
}
