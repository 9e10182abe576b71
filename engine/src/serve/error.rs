//! OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx
//! (Anthropic's shape for the Messages API: `anthropic`).

pub mod anthropic;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
    pub kind: &'static str,
    /// OpenAI's `code` (`model_not_found`, …); null when None.
    pub code: Option<&'static str>,
}

/// An MLX failure (or the grammar engine's: `ApiError::generation`) while a request was
/// being generated.
impl From<mlx_rs::error::Exception> for ApiError {
    fn from(e: mlx_rs::error::Exception) -> Self {
        match grammar_fault(e.what()) {
            Some(why) => ApiError::grammar(why),
            None => ApiError::server(format!("generation failed: {e}")),
        }
    }
}

/// `constrain::grammar_fault`, unless planted away: every grammar fault then taken for the
/// server's (caught by engine/tests/it/constrained_fuzz.rs: a 500).
fn grammar_fault(message: &str) -> Option<&str> {
    if crate::plant::is(crate::plant::Defect::GrammarFaultIsTheServers) {
        return None;
    }
    crate::constrain::grammar_fault(message)
}

impl ApiError {
    /// A bad value in one field of the request. The text may quote an MLX error (a
    /// mounted adapter's tensors, a grammar): its source locations are removed.
    pub fn field(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: scrub_locations(&message.into()),
            param: Some(param.to_owned()),
            kind: "invalid_request_error",
            code: None,
        }
    }

    /// A bad request as a whole (not JSON, not an object, …); source locations removed, as
    /// in `field`.
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: scrub_locations(&message.into()),
            param: None,
            kind: "invalid_request_error",
            code: None,
        }
    }

    /// A failure while a request was being generated: the grammar engine's (its grammar
    /// over this model's tokenizer refused, or a step over the grammar limits:
    /// `constrain::grammar_fault`) is the request's, a 400 (`grammar`); any other is the
    /// server's, a 500.
    pub fn generation(e: impl std::fmt::Display) -> Self {
        let text = e.to_string();
        match grammar_fault(&text) {
            Some(why) => ApiError::grammar(why),
            None => ApiError::server(format!("generation failed: {text}")),
        }
    }

    /// The request's grammar cannot be followed (`why`): a 400 `grammar_error` saying what
    /// to change.
    pub fn grammar(why: &str) -> Self {
        ApiError::invalid(format!(
            "the answer cannot follow the request's grammar (response_format, a strict tool, \
             regex or grammar): {why}; simplify it (fewer nested or recursive parts, no \
             required self-reference) or drop it"
        ))
        .with_code("grammar_error")
    }

    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The model failed on this request (the server stays up). The full message goes to
    /// the server's log; the client's copy has source locations removed (they say where
    /// our code or MLX's was built, nothing a client can act on).
    pub fn server(message: impl Into<String>) -> Self {
        let message = message.into();
        eprintln!("engine serve: request failed: {message}");
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: scrub_locations(&message),
            param: None,
            kind: "server_error",
            code: None,
        }
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

/// `message` without source locations: MLX errors read `"what" at src/file.rs:12:5` (and
/// C++ ones may name `/path/file.cpp:34`); each word that is a path with a line number is
/// dropped, with the `at` before it.
pub fn scrub_locations(message: &str) -> String {
    let is_location = |w: &str| {
        let w = w.trim_matches(|c: char| "()[],;'\"".contains(c));
        let path = w.split(':').next().unwrap_or("");
        let has_line = w
            .split(':')
            .nth(1)
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        (path.contains('/') || path.contains('\\'))
            && (has_line
                || [".rs", ".cpp", ".cc", ".h", ".hpp", ".c"]
                    .iter()
                    .any(|ext| path.ends_with(ext)))
    };
    let words: Vec<&str> = message.split(' ').collect();
    let mut out: Vec<&str> = Vec::with_capacity(words.len());
    for w in words {
        if is_location(w) {
            if out.last() == Some(&"at") {
                out.pop();
            }
            continue;
        }
        out.push(w);
    }
    out.join(" ")
}

#[cfg(test)]
mod tests {
    use super::scrub_locations;

    #[test]
    fn source_locations_are_removed() {
        assert_eq!(
            scrub_locations(
                "\"top_k has to be in (0, 1024)\" at engine/src/generate/sampler.rs:291:16"
            ),
            "\"top_k has to be in (0, 1024)\""
        );
        assert_eq!(
            scrub_locations("[take] bad index at /root/mlx/mlx/ops.cpp:123 (here)"),
            "[take] bad index (here)"
        );
        // Ordinary text with a slash or a colon stays.
        assert_eq!(
            scrub_locations("tokens/s: 12 at 3:4"),
            "tokens/s: 12 at 3:4"
        );
    }
}
