//! Errors in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}` with the
//! statuses its API uses: what the Messages API answers, and what the guard answers on its
//! routes (`owns`), so that every refusal an Anthropic client sees is one it can read.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::ApiError;

/// The error body: `kind` is Anthropic's error type (`invalid_request_error`, …).
pub fn body(kind: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

/// Whether `path` is one of this API's (its refusals take Anthropic's shape).
pub fn owns(path: &str) -> bool {
    path == "/v1/messages" || path.starts_with("/v1/messages/")
}

/// Anthropic's error `type` and status for a refusal of `status`.
pub fn kind(status: StatusCode) -> (&'static str, StatusCode) {
    match status.as_u16() {
        400 | 415 | 422 => ("invalid_request_error", status),
        401 => ("authentication_error", status),
        403 => ("permission_error", status),
        404 => ("not_found_error", status),
        413 => ("request_too_large", status),
        429 => ("rate_limit_error", status),
        408 | 504 => ("timeout_error", status),
        // Draining or a stopped model thread: Anthropic's "overloaded" (clients retry it).
        503 | 529 => (
            "overloaded_error",
            StatusCode::from_u16(529).unwrap_or(status),
        ),
        _ => ("api_error", status),
    }
}

/// An ApiError in Anthropic's shape.
pub fn response(e: &ApiError) -> Response {
    let (k, status) = kind(e.status);
    let message = match &e.param {
        Some(p) if !e.message.contains(p.as_str()) => format!("{p}: {}", e.message),
        _ => e.message.clone(),
    };
    (status, Json(body(k, &message))).into_response()
}

/// A refusal made in OpenAI's shape (the guard's, the queue's) in Anthropic's; its
/// headers (Retry-After, WWW-Authenticate) kept.
pub async fn reshape(r: Response) -> Response {
    let (parts, sent) = r.into_parts();
    let bytes = axum::body::to_bytes(sent, 1 << 20)
        .await
        .unwrap_or_default();
    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let message = v["error"]["message"]
        .as_str()
        .unwrap_or("the request was refused")
        .to_owned();
    let (k, status) = kind(parts.status);
    let mut out = (status, Json(body(k, &message))).into_response();
    for (name, value) in parts.headers.iter() {
        if name != axum::http::header::CONTENT_TYPE && name != axum::http::header::CONTENT_LENGTH {
            out.headers_mut().insert(name.clone(), value.clone());
        }
    }
    out
}
