//! The `/v1/messages` body as typed structs, Anthropic's field names (the `anthropic`
//! client's `MessageCreateParams`). Unknown top-level fields are refused, as Anthropic
//! refuses extra inputs; the engine's own sampling knobs (seed … chat_template_kwargs) are
//! taken as the Responses body takes them. Null reads as absent. Content blocks are read
//! loosely here (every block kind's fields in one struct) and checked by kind in `input`.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::super::api::{Obj, TextOr};

/// A Messages body. `max_tokens` is required for a generation, not for count_tokens
/// (checked in `input`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Body {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub messages: Option<Vec<Obj<MessageParam>>>,
    pub system: Option<Content>,
    pub tools: Option<Vec<Obj<Tool>>>,
    pub tool_choice: Option<Obj<ToolChoice>>,
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    #[allow(dead_code)] // read for its type
    metadata: Option<Obj<Metadata>>,
    pub stream: Option<bool>,
    pub thinking: Option<Obj<Thinking>>,
    // The engine's own knobs, as the chat route takes them.
    pub seed: Option<i64>,
    pub min_p: Option<f64>,
    pub logit_bias: Option<Map<String, Value>>,
    pub repetition_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    // Read for their type only: nothing in this server acts on them.
    #[allow(dead_code)]
    service_tier: Option<String>,
    #[allow(dead_code)]
    cache_control: Option<Map<String, Value>>,
    #[allow(dead_code)]
    container: Option<Value>,
    #[allow(dead_code)]
    diagnostics: Option<Map<String, Value>>,
    #[allow(dead_code)]
    inference_geo: Option<String>,
    /// `format` read (structured outputs); the rest for its type.
    pub output_config: Option<Obj<OutputConfig>>,
    #[allow(dead_code)]
    speed: Option<String>,
    #[allow(dead_code)]
    user_profile_id: Option<String>,
    #[allow(dead_code)]
    workspace_id: Option<String>,
    // The beta API's fields (what `client.beta.messages` and Claude Code send), read for
    // their type only.
    #[allow(dead_code)]
    billing_policy: Option<Value>,
    #[allow(dead_code)]
    compaction: Option<Value>,
    #[allow(dead_code)]
    context_management: Option<Value>,
    #[allow(dead_code)]
    fallback_credit_token: Option<Value>,
    #[allow(dead_code)]
    fallbacks: Option<Value>,
    #[allow(dead_code)]
    mcp_servers: Option<Vec<Value>>,
    #[allow(dead_code)]
    thread: Option<Value>,
    #[allow(dead_code)]
    betas: Option<Vec<String>>,
}

/// `output_config`: `format` is Anthropic's structured outputs; `effort` is read for its
/// type (later fields pass, as the client may add them).
#[derive(Debug, Deserialize)]
pub struct OutputConfig {
    #[allow(dead_code)]
    effort: Option<String>,
    pub format: Option<Obj<OutputFormat>>,
}

/// `output_config.format`: `{"type": "json_schema", "schema": {…}}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputFormat {
    #[serde(rename = "type")]
    pub kind: String,
    pub schema: Map<String, Value>,
}

/// `metadata`: `{user_id}`, read for its type.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Metadata {
    #[allow(dead_code)]
    user_id: Option<String>,
}

/// One message of the conversation.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MessageParam {
    pub role: String,
    pub content: Content,
}

/// A content: a string, or a list of content blocks.
pub type Content = TextOr<Obj<Block>>;

/// A content block of any kind: `type` says which of the fields it reads.
#[derive(Debug, Deserialize)]
pub struct Block {
    #[serde(rename = "type")]
    pub kind: String,
    /// `text`.
    pub text: Option<String>,
    /// `tool_use`.
    pub id: Option<String>,
    pub name: Option<String>,
    pub input: Option<Value>,
    /// `tool_result`: its content is a string or text blocks (`Content`, read by kind).
    pub tool_use_id: Option<String>,
    pub content: Option<Value>,
    pub is_error: Option<bool>,
    /// `thinking` (the signature is read for its type: there is none to check).
    pub thinking: Option<String>,
    #[allow(dead_code)]
    signature: Option<String>,
    /// `redacted_thinking`.
    #[allow(dead_code)]
    data: Option<String>,
}

/// A client tool: `{name, description, input_schema, strict}` (`type` "custom" or absent).
#[derive(Debug, Deserialize)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub name: Option<String>,
    pub description: Option<String>,
    pub input_schema: Option<Value>,
    pub strict: Option<bool>,
}

/// `tool_choice`: `{type: auto | any | tool | none, name, disable_parallel_tool_use}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolChoice {
    #[serde(rename = "type")]
    pub kind: String,
    pub name: Option<String>,
    /// Read for its type: the answer's calls are not limited to one.
    #[allow(dead_code)]
    disable_parallel_tool_use: Option<bool>,
}

/// `thinking`: `{type: enabled, budget_tokens}`, `{type: disabled}`, `{type: adaptive}`
/// (or `between_tools`), each with an optional `display`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Thinking {
    #[serde(rename = "type")]
    pub kind: String,
    pub budget_tokens: Option<i64>,
    #[allow(dead_code)]
    display: Option<String>,
}
