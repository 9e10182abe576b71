//! The one internal request every API's body becomes (`GenRequest`; the typed bodies and
//! their checks are in `serve::api` and `responses::input`), the server-wide defaults a
//! request may override, and the prompt-ids check made once the prompt is encoded.

use serde_json::{Map, Value};

use super::error::ApiError;
use crate::generate::sampler::SamplingParams;

/// Server-wide defaults a request may override (mlx_lm.server's flags).
#[derive(Debug, Clone)]
pub struct Defaults {
    pub max_tokens: usize,
    pub temp: f64,
    pub top_p: f64,
    pub top_k: i32,
    pub min_p: f64,
    /// The model's context length: prompts and max_tokens beyond it are refused.
    pub context: usize,
    /// The model's vocabulary (logits width): token ids and k's are checked against it.
    pub vocab: usize,
    /// `--chat-template-args`: template kwargs every chat request starts from.
    pub template_kwargs: Map<String, Value>,
    /// What image inputs are read, and whether the model reads any (`serve::images`).
    pub images: super::images::Rules,
}

#[cfg(test)]
impl Defaults {
    /// The defaults the request parsers' unit tests run under: 512 tokens, greedy, a 2048
    /// context and a 1000-token vocabulary.
    pub(crate) fn for_tests() -> Self {
        Defaults {
            max_tokens: 512,
            temp: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            context: 2048,
            vocab: 1000,
            template_kwargs: Map::new(),
            images: Default::default(),
        }
    }
}

/// What the prompt is: chat turns (rendered with the chat template) or raw text.
#[derive(Debug, Clone)]
pub enum Prompt {
    Chat(Box<Chat>),
    Text(String),
}

/// A chat request's conversation as mlx_lm.server hands it to `apply_chat_template`: the
/// messages as the client sent them (content parts joined into text, a missing content
/// made "", tool-call arguments given as JSON strings parsed), the tools, and the template
/// kwargs of the request (`chat_template_kwargs`, over `--chat-template-args`).
#[derive(Debug, Clone, Default)]
pub struct Chat {
    pub messages: Vec<Value>,
    /// None when absent or empty (`body.get("tools") or None`).
    pub tools: Option<Value>,
    /// apply_chat_template's own parameters, when chat_template_kwargs names them.
    pub documents: Option<Value>,
    pub continue_final_message: bool,
    pub kwargs: Map<String, Value>,
    /// `tool_choice` as sent (mlx_lm.server ignores it; strict tools read it:
    /// `tools::strict`).
    pub tool_choice: Option<Value>,
}

/// A validated generation request.
#[derive(Debug, Clone)]
pub struct GenRequest {
    pub prompt: Prompt,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Per-token log-probabilities (`logprobs: true`) and how many alternatives per token.
    pub logprobs: bool,
    pub top_logprobs: usize,
    /// Drafts per verify pass with `--draft-model` (mlx_lm.server's `num_draft_tokens`;
    /// None: the server's; 0: no drafting for this request).
    pub num_draft_tokens: Option<usize>,
    /// Prompt-lookup decoding for this request (`prompt_lookup_num_tokens`, with
    /// `max_matching_ngram_size`, as transformers' generate takes them): drafts copied from
    /// the prompt and the text so far; None: plain decoding (or the server's drafter).
    pub prompt_lookup: Option<crate::generate::lookup::LookupParams>,
    /// The grammar the answer must match (`response_format`; `engine::constrain`).
    pub constraint: Option<crate::constrain::Grammar>,
    /// Stream prompt_progress chunks while the prompt prefills (llama.cpp's
    /// `return_progress`; chat and completions streams).
    pub return_progress: bool,
    /// Tokens a thinking block may hold before the model thread forces its end (the
    /// Messages API's `thinking.budget_tokens`; `generate::budget`).
    pub think_budget: Option<usize>,
    /// The `model` the client named: the base model or an adapter (`adapters::Registry`).
    pub model: Option<String>,
    /// The request's images, checked, in the order they appear (`serve::images`).
    pub images: Vec<super::images::Image>,
    /// With images: the prompt's text as the encoder made it (`Encoder::encode_request`).
    pub image_text: Option<super::images::ImageText>,
    /// The answer's whitespace at both ends is never sent, as mlx_vlm.server strips it:
    /// requests with images, non-streamed on every API and streamed on Responses (each
    /// delta's trailing whitespace held for the next, dropped at the end).
    pub strip: bool,
}

/// Refuses a prompt holding ids the model cannot read (a tokenizer whose added tokens lie
/// past the model's embedding): MLX's gather does not check its indices.
pub fn check_ids(ids: &[u32], vocab: usize, field: &str) -> Result<(), ApiError> {
    match ids.iter().find(|&&id| id as usize >= vocab) {
        None => Ok(()),
        Some(id) => Err(ApiError::field(
            field,
            format!(
                "the prompt encodes to token id {id}, outside this model's vocabulary of \
                 {vocab}: the tokenizer does not match the model"
            ),
        )),
    }
}
