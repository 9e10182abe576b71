//! `POST /v1/adapters {"name", "path"}` mounts an adapter, `DELETE /v1/adapters/NAME`
//! unmounts one; both run on the model thread between two steps (`lane::Op`), so the
//! server serves throughout. The `/v1/models` entries of the adapters are `model_entries`.

use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::oneshot;

use crate::serve::adapters::{check_name, Entry};
use crate::serve::error::ApiError;
use crate::serve::worker::adapters::Op;
use crate::serve::worker::Work;
use crate::serve::AppState;

pub fn routes() -> axum::Router<Arc<AppState>> {
    axum::Router::new()
        .route("/v1/adapters", axum::routing::post(mount))
        .route("/v1/adapters/{name}", axum::routing::delete(unmount))
}

#[derive(Deserialize)]
struct MountBody {
    name: String,
    path: String,
}

/// Sends `op` to the model thread and waits for its answer.
async fn ask<T>(
    s: &AppState,
    op: Op,
    answer: oneshot::Receiver<Result<T, ApiError>>,
) -> Result<T, ApiError> {
    let sent = s
        .jobs
        .lock()
        .map_err(|_| ApiError::server("the request queue is poisoned"))?
        .as_ref()
        .map(|jobs| jobs.send(Work::Adapter(op)).is_ok());
    if sent != Some(true) {
        return Err(ApiError::server("the model thread has stopped")
            .with_status(StatusCode::SERVICE_UNAVAILABLE));
    }
    answer
        .await
        .map_err(|_| ApiError::server("the model thread dropped the request"))?
}

async fn mount(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    mounted(&s, body)
        .await
        .unwrap_or_else(|e| e.into_response())
}

async fn mounted(s: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let body: MountBody = crate::serve::api::read(&crate::serve::routes::body_json(body)?)?;
    check_name(&body.name).map_err(|e| ApiError::field("name", e))?;
    let _one = s.adapters.admin.lock().await;
    if s.adapters.lock().contains_key(&body.name) {
        return Err(ApiError::field(
            "name",
            format!(
                "an adapter named `{}` is mounted already: unmount it first or pick another name",
                body.name
            ),
        )
        .with_status(StatusCode::CONFLICT));
    }
    let dir: PathBuf = crate::load::hub::resolve_model(&body.path)
        .map_err(|e| ApiError::field("path", e.to_string()))?;
    let (reply, answer) = oneshot::channel();
    let op = Op::Mount {
        name: body.name.clone(),
        dir: dir.clone(),
        reply,
    };
    let fingerprint = ask(s, op, answer).await?;
    let entry = Entry {
        dir: dir.clone(),
        uses: Default::default(),
        closing: false,
    };
    s.adapters.lock().insert(body.name.clone(), entry);
    let id = format!("{}:{}", s.adapters.base(), body.name);
    Ok(Json(json!({
        "id": id, "object": "adapter", "name": body.name, "path": dir,
        "fingerprint": fingerprint, "mounted": true,
    }))
    .into_response())
}

async fn unmount(State(s): State<Arc<AppState>>, Path(name): Path<String>) -> Response {
    unmounted(&s, name)
        .await
        .unwrap_or_else(|e| e.into_response())
}

async fn unmounted(s: &AppState, name: String) -> Result<Response, ApiError> {
    let _one = s.adapters.admin.lock().await;
    let uses = {
        let mut mounted = s.adapters.lock();
        let Some(entry) = mounted.get_mut(&name) else {
            let names: Vec<String> = mounted.keys().cloned().collect();
            return Err(ApiError::invalid(format!(
                "no adapter named `{name}` is mounted (mounted: {})",
                if names.is_empty() {
                    "none".to_owned()
                } else {
                    names.join(", ")
                }
            ))
            .with_status(StatusCode::NOT_FOUND));
        };
        // New requests no longer find it while the model thread decides.
        entry.closing = true;
        entry.uses.clone()
    };
    let (reply, answer) = oneshot::channel();
    let op = Op::Unmount {
        name: name.clone(),
        uses,
        reply,
    };
    let result = ask(s, op, answer).await;
    let mut mounted = s.adapters.lock();
    match result {
        Ok(()) => {
            mounted.remove(&name);
            Ok(Json(json!({"id": name, "object": "adapter", "deleted": true})).into_response())
        }
        Err(e) => {
            if let Some(entry) = mounted.get_mut(&name) {
                entry.closing = false;
            }
            Err(e)
        }
    }
}
