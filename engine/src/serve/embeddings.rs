//! `POST /v1/embeddings` (and `/embeddings`), OpenAI's embeddings API computed by the loaded
//! model (`crate::embed`: final hidden states → pooling → L2 normalization).
//!
//! Body (OpenAI's shape): `input` a string, a list of strings, a list of token ids, or a list
//! of lists of token ids; `model` (echoed; the server's model when absent);
//! `encoding_format` "float" (default) or "base64" (the little-endian f32 bytes, as OpenAI
//! sends them); `dimensions` (Matryoshka: the first d values, normalized again; 1 ≤ d ≤ the
//! hidden size); `user` (accepted, unused). Answer: `{"object": "list", "data": [{"object":
//! "embedding", "index", "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}`.
//!
//! Texts are tokenized on the HTTP side with the tokenizer's special tokens, as
//! sentence-transformers feeds the model (Qwen3-Embedding's post-processor appends its
//! end-of-text token); token ids are taken as given, each checked against the vocabulary.
//! The inputs then go to the model thread as one job (`worker::embed`), which embeds one input per
//! turn between generation steps, so embeddings never hold a running generation up for long.
//! Under `--memory-budget` the job is reserved before it is queued, by its longest input's
//! forward (`budget::Budget::embed_need`; refused as a generation is: 400 or 429).
//! Every malformed body is a 400 naming the field; nothing a client sends reaches MLX
//! unchecked.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::worker::{EmbedJob, QueueSlot, Work};
use super::AppState;
use crate::plant::{self, Defect};

/// At most this many inputs in one request (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;
/// At most this many tokens in one input (OpenAI's limit; also never past the context).
pub const MAX_INPUT_TOKENS: usize = 8192;
/// At most this many tokens over all inputs of one request (OpenAI's limit).
pub const MAX_TOTAL_TOKENS: usize = 300_000;

pub fn routes() -> axum::Router<Arc<AppState>> {
    axum::Router::new()
        .route("/v1/embeddings", axum::routing::post(create))
        .route("/embeddings", axum::routing::post(create))
}

#[derive(Deserialize)]
#[serde(rename_all = "lowercase")]
enum Format {
    Float,
    Base64,
}

#[derive(Deserialize)]
struct Body {
    input: Option<Value>,
    model: Option<String>,
    encoding_format: Option<Format>,
    dimensions: Option<u64>,
    #[allow(dead_code)]
    user: Option<String>,
}

/// One input before tokenization.
enum Input {
    Text(String),
    Ids(Vec<u32>),
}

/// An input and its path in the body (`input`, `input[3]`), which its refusals name.
type At = (String, Input);

async fn create(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    s.counters.requests.fetch_add(1, Ordering::Relaxed);
    match run(&s, body).await {
        Ok(r) => r,
        Err(e) => {
            let counter = match e.status.is_client_error() {
                true => &s.counters.rejected,
                false => &s.counters.failed,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            e.into_response()
        }
    }
}

async fn run(s: &Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let body: Body = super::api::read(&super::routes::body_json(body)?)?;
    let adapter = s.adapters.resolve(body.model.as_deref())?;
    let inputs = inputs(body.input.as_ref(), s.defaults.vocab)?;
    let dimensions = match body.dimensions {
        Some(0) => {
            return Err(ApiError::field(
                "dimensions",
                "`dimensions` must be at least 1",
            ))
        }
        Some(d) => Some(usize::try_from(d).unwrap_or(usize::MAX)),
        None => None,
    };
    if s.limits.draining.load(Ordering::Relaxed) {
        return Err(ApiError::invalid("the server is shutting down")
            .with_status(StatusCode::SERVICE_UNAVAILABLE));
    }
    let deadline = s.limits.request_timeout.map(|d| Instant::now() + d);
    let Some(queued) = QueueSlot::take(&s.counters, s.max_queue) else {
        s.counters.throttled.fetch_add(1, Ordering::Release);
        return Err(
            ApiError::invalid("the server's queue is full (--max-queue); retry later")
                .with_status(StatusCode::TOO_MANY_REQUESTS),
        );
    };
    let limit = MAX_INPUT_TOKENS.min(s.defaults.context);
    let encoder = s.encoder.clone();
    let ids = tokio::task::spawn_blocking(move || tokenize(&encoder.tokenizer, inputs, limit))
        .await
        .map_err(|_| ApiError::server("the tokenizer failed"))??;
    let prompt_tokens: usize = ids.iter().map(Vec::len).sum();
    if prompt_tokens > MAX_TOTAL_TOKENS {
        return Err(ApiError::field(
            "input",
            format!(
                "the inputs hold {prompt_tokens} tokens; at most {MAX_TOTAL_TOKENS} are \
                 accepted in one request: send them in several"
            ),
        ));
    }
    // `--memory-budget`: reserved before queueing, as a generation is (400 when it can
    // never fit, 429 after --budget-wait); the longest input's forward is the need.
    let budget = match &s.budget {
        Some(b) if !plant::is(Defect::BudgetEmbeddingsUnreserved) => {
            let longest = ids.iter().map(Vec::len).max().unwrap_or(0);
            let need = b.embed_need(&s.model_id, longest);
            match super::budget::admit_need(s, need, deadline).await {
                Ok(r) => r,
                // Counted (rejected, throttled) by `admit_need`.
                Err(refused) => return Ok(refused),
            }
        }
        _ => None,
    };
    let (reply, answer) = tokio::sync::oneshot::channel();
    let mut job = EmbedJob::new(
        ids,
        s.embedding_pooling,
        dimensions,
        reply,
        deadline,
        queued,
    );
    job.adapter = adapter;
    job.budget = budget;
    let sent = s
        .jobs
        .lock()
        .map_err(|_| ApiError::server("the request queue is poisoned"))?
        .as_ref()
        .map(|jobs| jobs.send(Work::Embed(job)).is_ok());
    if sent != Some(true) {
        return Err(ApiError::server("the model thread has stopped")
            .with_status(StatusCode::SERVICE_UNAVAILABLE));
    }
    let vectors = answer
        .await
        .map_err(|_| ApiError::server("the model thread dropped the request"))??;
    let base64 = matches!(body.encoding_format, Some(Format::Base64));
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let embedding = match base64 {
                true => json!(encode_base64(v)),
                false => json!(v),
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    let model = body.model.unwrap_or_else(|| s.model_id.clone());
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }))
    .into_response())
}

/// `input` read as OpenAI's four shapes; ids checked against the vocabulary, nothing empty.
fn inputs(input: Option<&Value>, vocab: usize) -> Result<Vec<At>, ApiError> {
    let shapes = "a string, a list of strings, a list of token ids or a list of lists of \
                  token ids";
    let input = match input {
        None | Some(Value::Null) => {
            return Err(ApiError::field("input", "`input` is required"));
        }
        Some(v) => v,
    };
    let items = match input {
        Value::String(s) => return Ok(vec![("input".into(), text(s, "input")?)]),
        Value::Array(items) => items,
        _ => {
            return Err(ApiError::field(
                "input",
                format!("`input` must be {shapes}"),
            ))
        }
    };
    if items.is_empty() {
        return Err(ApiError::field(
            "input",
            "`input` must not be an empty list",
        ));
    }
    if items.len() > MAX_INPUTS {
        return Err(ApiError::field(
            "input",
            format!(
                "`input` holds {} items; at most {MAX_INPUTS} are accepted in one request",
                items.len()
            ),
        ));
    }
    // A list that starts with a number is one input of token ids.
    if items[0].is_number() {
        return Ok(vec![(
            "input".into(),
            Input::Ids(ids(items, vocab, "input")?),
        )]);
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let at = format!("input[{i}]");
            let input = match item {
                Value::String(s) => text(s, &at)?,
                Value::Array(ids_at) => Input::Ids(ids(ids_at, vocab, &at)?),
                _ => return Err(ApiError::field(&at, format!("`input` must be {shapes}"))),
            };
            Ok((at, input))
        })
        .collect()
}

fn text(s: &str, at: &str) -> Result<Input, ApiError> {
    match s.is_empty() {
        true => Err(ApiError::field(at, format!("`{at}` is an empty string"))),
        false => Ok(Input::Text(s.to_owned())),
    }
}

/// Token ids, each an integer below the model's vocabulary.
fn ids(items: &[Value], vocab: usize, at: &str) -> Result<Vec<u32>, ApiError> {
    if items.is_empty() {
        return Err(ApiError::field(
            at,
            format!("`{at}` is an empty list of token ids"),
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(j, v)| match v.as_u64() {
            Some(id) if (id as u128) < vocab as u128 => Ok(id as u32),
            _ => Err(ApiError::field(
                &format!("{at}[{j}]"),
                format!(
                    "`{at}[{j}]` must be a token id, an integer from 0 to {} (the model's \
                     vocabulary), not {v}",
                    vocab.saturating_sub(1)
                ),
            )),
        })
        .collect()
}

/// Texts tokenized with the tokenizer's special tokens (its post-processor); every input
/// at most `limit` tokens.
fn tokenize(
    tokenizer: &crate::load::tokenizer::Tokenizer,
    inputs: Vec<At>,
    limit: usize,
) -> Result<Vec<Vec<u32>>, ApiError> {
    inputs
        .into_iter()
        .map(|(at, input)| {
            let ids = match input {
                Input::Ids(ids) => ids,
                Input::Text(t) => tokenizer
                    .encode(&t, true)
                    .map_err(|e| ApiError::field(&at, format!("cannot tokenize `{at}`: {e}")))?,
            };
            if ids.is_empty() {
                return Err(ApiError::field(
                    &at,
                    format!("`{at}` tokenizes to no tokens"),
                ));
            }
            if ids.len() > limit {
                return Err(ApiError::field(
                    &at,
                    format!(
                        "`{at}` is {} tokens long; at most {limit} are accepted per input \
                         (the model's context, and {MAX_INPUT_TOKENS} at most): shorten it",
                        ids.len()
                    ),
                ));
            }
            Ok(ids)
        })
        .collect()
}

/// The f32 values' little-endian bytes in base64, as OpenAI's `encoding_format: "base64"`.
fn encode_base64(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(v: Value) -> ApiError {
        match inputs(Some(&v), 1024) {
            Ok(_) => panic!("{v} was accepted"),
            Err(e) => e,
        }
    }

    /// The four shapes read; hostile ones are 400s naming the field.
    #[test]
    fn input_shapes_are_read_and_bad_ones_are_refused_naming_the_field() {
        assert_eq!(inputs(Some(&json!("a")), 1024).unwrap().len(), 1);
        assert_eq!(inputs(Some(&json!(["a", "b"])), 1024).unwrap().len(), 2);
        assert_eq!(inputs(Some(&json!([1, 2, 3])), 1024).unwrap().len(), 1);
        assert_eq!(inputs(Some(&json!([[1], [2, 3]])), 1024).unwrap().len(), 2);
        let param = |v| refused(v).param.unwrap();
        assert_eq!(param(json!([])), "input");
        assert_eq!(param(json!("")), "input");
        assert_eq!(param(json!(["a", ""])), "input[1]");
        assert_eq!(param(json!([[1], []])), "input[1]");
        assert_eq!(param(json!([1, 1024])), "input[1]");
        assert_eq!(param(json!([1, -1])), "input[1]");
        assert_eq!(param(json!([1.5])), "input[0]");
        assert_eq!(param(json!([[1, 2.0]])), "input[0][1]");
        assert_eq!(param(json!([[1e300]])), "input[0][0]");
        assert_eq!(param(json!([[[1]]])), "input[0][0]");
        assert_eq!(param(json!(["a", 3])), "input[1]");
        assert_eq!(param(json!([3, "a"])), "input[1]");
        assert_eq!(param(json!({"a": 1})), "input");
        assert_eq!(param(json!(true)), "input");
        assert_eq!(refused(Value::Array(vec![json!("a"); 2049])).status, 400);
        assert!(inputs(None, 1024).is_err());
    }

    #[test]
    fn base64_is_the_little_endian_f32_bytes() {
        assert_eq!(encode_base64(&[1.0, -2.5]), "AACAPwAAIMA=");
    }
}
