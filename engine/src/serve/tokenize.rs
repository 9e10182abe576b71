//! `POST /tokenize` and `POST /detokenize`, as llama.cpp's server has them: text (or a
//! chat, rendered as the chat route renders it) into this model's token ids, and ids back
//! into text.
//!
//! - `/tokenize` `{content, add_special (default false), with_pieces (default false)}` →
//!   `{tokens: [id…]}`, or `[{id, piece}…]` with pieces (a piece is the token's text; a
//!   token holding part of a multi-byte character reads as U+FFFD). Instead of `content`, a
//!   chat: `messages` (with `tools`, `chat_template_kwargs`, as `/v1/chat/completions`
//!   takes them) is rendered with the chat template and tokenized exactly as the chat
//!   route does, so its ids are the prompt a chat request runs (`usage.prompt_tokens` of
//!   it).
//! - `/detokenize` `{tokens: [id…], skip_special (default false)}` → `{content}`; special
//!   tokens are kept unless `skip_special` (transformers' `decode` and its
//!   `skip_special_tokens`). An id outside the tokenizer's vocabulary is refused (400
//!   naming `tokens[i]`).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::request::Prompt;
use super::routes::body_json;
use super::AppState;

#[derive(Debug, Deserialize)]
struct TokenizeBody {
    content: Option<String>,
    add_special: Option<bool>,
    with_pieces: Option<bool>,
    /// A chat instead of `content` (read as the chat route reads it).
    messages: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct DetokenizeBody {
    tokens: Option<Vec<u32>>,
    skip_special: Option<bool>,
}

/// `/tokenize` and `/detokenize`.
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
}

async fn tokenize(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let body = match body_json(body) {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    // Templates and tokenizers take time on big inputs: off the async workers.
    let answer = tokio::task::spawn_blocking(move || tokens_of(&s, &body)).await;
    match answer {
        Ok(Ok(v)) => Json(v).into_response(),
        Ok(Err(e)) => e.into_response(),
        Err(_) => ApiError::server("tokenizing failed").into_response(),
    }
}

fn tokens_of(s: &AppState, body: &Value) -> Result<Value, ApiError> {
    let b: TokenizeBody = super::api::read(body)?;
    let tokenizer = &s.encoder.tokenizer;
    let ids = match (&b.content, &b.messages) {
        (Some(_), Some(_)) => {
            return Err(ApiError::field(
                "messages",
                "send either content or messages, not both",
            ))
        }
        (None, None) => {
            return Err(ApiError::field(
                "content",
                "content (text) or messages (a chat) is required",
            ))
        }
        (Some(text), None) => tokenizer
            .encode(text, b.add_special.unwrap_or(false))
            .map_err(|e| ApiError::field("content", e.to_string()))?,
        (None, Some(_)) => {
            if b.add_special.is_some() {
                return Err(ApiError::field(
                    "add_special",
                    "add_special applies to content; a chat's special tokens come from its \
                     template",
                ));
            }
            let request = super::api::chat::parse(body, &s.defaults)?;
            let Prompt::Chat(chat) = &request.prompt else {
                return Err(ApiError::server("a chat request without a chat"));
            };
            let text = s.encoder.render(chat)?;
            // As `Encoder::encode` tokenizes a rendered chat: the template wrote its
            // special tokens.
            let add = crate::plant::is(crate::plant::Defect::TokenizeChatAddsSpecial);
            tokenizer
                .encode(&text, add)
                .map_err(|e| ApiError::field("messages", e.to_string()))?
        }
    };
    let tokens: Vec<Value> = if b.with_pieces.unwrap_or(false) {
        ids.iter()
            .map(|&id| {
                let piece = tokenizer
                    .decode_with_special(&[id])
                    .map_err(|e| ApiError::server(e.to_string()))?;
                Ok(json!({"id": id, "piece": piece}))
            })
            .collect::<Result<_, ApiError>>()?
    } else {
        ids.iter().map(|&id| json!(id)).collect()
    };
    Ok(json!({ "tokens": tokens }))
}

async fn detokenize(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body_json(body) {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    let answer = tokio::task::spawn_blocking(move || text_of(&s, &body)).await;
    match answer {
        Ok(Ok(v)) => Json(v).into_response(),
        Ok(Err(e)) => e.into_response(),
        Err(_) => ApiError::server("detokenizing failed").into_response(),
    }
}

fn text_of(s: &AppState, body: &Value) -> Result<Value, ApiError> {
    let b: DetokenizeBody = super::api::read(body)?;
    let tokens = b
        .tokens
        .ok_or_else(|| ApiError::field("tokens", "tokens (a list of token ids) is required"))?;
    let tokenizer = &s.encoder.tokenizer;
    let vocab = tokenizer.vocab_size();
    if let Some((i, id)) = tokens
        .iter()
        .enumerate()
        .find(|&(_, &id)| id as usize >= vocab)
    {
        return Err(ApiError::field(
            &format!("tokens[{i}]"),
            format!("token id {id} is outside this tokenizer's vocabulary of {vocab}"),
        ));
    }
    let text = if b.skip_special.unwrap_or(false) {
        tokenizer.decode(&tokens)
    } else {
        tokenizer.decode_with_special(&tokens)
    }
    .map_err(|e| ApiError::server(e.to_string()))?;
    Ok(json!({ "content": text }))
}
