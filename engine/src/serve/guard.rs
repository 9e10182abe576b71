//! What every request passes before a route sees it: the posture of a local server that a
//! browser on the same machine can reach.
//!
//! - `--api-key`: `Authorization: Bearer KEY` (what OpenAI clients send) or `x-api-key:
//!   KEY` (what Anthropic clients send), compared in constant time, on every route but the
//!   chat page and `/health`. The Messages API's routes refuse in Anthropic's shape.
//! - Bound to loopback, the `Host` header must name loopback (`localhost`, `127.x.y.z`,
//!   `[::1]`): a page on another site that rebinds its DNS name to 127.0.0.1 reaches the
//!   server under its own name, and is refused.
//! - A POST must say `Content-Type: application/json`: a cross-site form or `text/plain`
//!   POST (a "simple" request, sent by a browser without asking) could otherwise run
//!   generations; a JSON one needs a CORS preflight, which this server never grants.

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

use super::error::ApiError;
use super::AppState;

/// The checks configured at start.
#[derive(Debug, Clone, Default)]
pub struct Guard {
    pub api_key: Option<String>,
    /// The server listens on a loopback address only: Host must name loopback.
    pub loopback_only: bool,
}

impl Guard {
    pub fn new(host: &str, api_key: Option<String>) -> Self {
        Guard {
            api_key: api_key.filter(|k| !k.is_empty()),
            loopback_only: is_loopback_name(host),
        }
    }
}

/// Whether `host` (a name or address, no port) is loopback.
pub fn is_loopback_name(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host.to_ascii_lowercase().ends_with(".localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The name part of a Host header value (`name`, `name:port`, `[v6]:port`).
fn host_name(value: &str) -> &str {
    if let Some(rest) = value.strip_prefix('[') {
        return rest.split(']').next().unwrap_or("");
    }
    value.rsplit_once(':').map_or(value, |(name, port)| {
        if port.bytes().all(|b| b.is_ascii_digit()) {
            name
        } else {
            value
        }
    })
}

/// Routes anyone may load without a key: the chat page asks for the key itself.
fn open_route(path: &str) -> bool {
    matches!(path, "/" | "/index.html" | "/health")
}

pub async fn check(State(s): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    match refusal(&s.guard, &request) {
        None => next.run(request).await,
        Some(e) => {
            s.counters.refused_at_the_door();
            if super::error::anthropic::owns(request.uri().path()) {
                return super::error::anthropic::reshape(e).await;
            }
            e.into_response()
        }
    }
}

/// Why `request` is refused, if it is.
pub(super) fn refusal(guard: &Guard, request: &Request) -> Option<Response> {
    let headers = request.headers();
    if guard.loopback_only {
        let host = headers
            .get(header::HOST)
            .map(|v| v.to_str().unwrap_or("\u{fffd}"));
        if let Some(host) = host.filter(|h| !is_loopback_name(host_name(h))) {
            return Some(
                ApiError::invalid(format!(
                    "Host `{host}` is not a loopback name; this server listens on loopback and \
                     answers only localhost, 127.0.0.1 or [::1] (DNS-rebinding protection). \
                     To serve other names, start it with --host 0.0.0.0 (and --api-key)"
                ))
                .with_status(StatusCode::FORBIDDEN)
                .into_response(),
            );
        }
    }
    if let Some(key) = &guard.api_key {
        if !open_route(request.uri().path()) {
            let bearer = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
            let matches = |given: Option<&str>| {
                given.is_some_and(|g| bool::from(g.as_bytes().ct_eq(key.as_bytes())))
            };
            if !(matches(bearer) || matches(x_api_key)) {
                let mut response = ApiError::invalid(
                    "missing or wrong API key: send `Authorization: Bearer <key>` (or \
                     `x-api-key: <key>`) with the key this server was started with \
                     (--api-key)",
                )
                .with_status(StatusCode::UNAUTHORIZED)
                .into_response();
                response
                    .headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                return Some(response);
            }
        }
    }
    if request.method() == Method::POST {
        let json = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<mime::Mime>().ok())
            .is_some_and(|m| m.essence_str() == "application/json");
        if !json {
            return Some(
                ApiError::invalid(
                    "the request body must be sent as `Content-Type: application/json` \
                     (curl: -H 'Content-Type: application/json')",
                )
                .with_status(StatusCode::UNSUPPORTED_MEDIA_TYPE)
                .into_response(),
            );
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_names() {
        for h in [
            "localhost",
            "LOCALHOST",
            "a.localhost",
            "127.0.0.1",
            "127.9.8.7",
            "::1",
            "[::1]",
        ] {
            assert!(is_loopback_name(h), "{h}");
        }
        for h in [
            "0.0.0.0",
            "192.168.1.2",
            "evil.com",
            "localhost.evil.com",
            "",
            "::",
        ] {
            assert!(!is_loopback_name(h), "{h}");
        }
    }

    #[test]
    fn host_header_names() {
        assert_eq!(host_name("localhost:8080"), "localhost");
        assert_eq!(host_name("[::1]:8080"), "::1");
        assert_eq!(host_name("[::1]"), "::1");
        assert_eq!(host_name("127.0.0.1"), "127.0.0.1");
        assert_eq!(host_name("evil.com:80"), "evil.com");
    }
}
