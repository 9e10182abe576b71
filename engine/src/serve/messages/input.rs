//! A `/v1/messages` body (`body::Body`, typed) turned into the `GenRequest` a chat
//! completion gets: `system` and the messages become the template's chat messages
//! (`request::Chat`), Anthropic's tools the chat API's function tools, `thinking` the
//! template's `enable_thinking` and a thinking budget, and the generation fields the chat
//! API's `Knobs`. Errors name the Messages field.
//!
//! Blocks, as the template reads them:
//! - user `text` blocks are joined into the message's text; each `tool_result` block is a
//!   `tool` message (`tool_call_id` = its `tool_use_id`, its text as content; with
//!   `is_error: true` the text is prefixed `ERROR: `, so the model sees the failure);
//! - assistant `text` is the content, `thinking` the message's `reasoning_content` (what
//!   Qwen3-style templates read), `redacted_thinking` is dropped, `tool_use` a tool call
//!   whose arguments are the input object;
//! - `image` and `document` blocks are refused (this server reads text).
//!
//! Server tools (a `type` other than "custom") are left out: this server runs none.
//!
//! A last assistant message is a prefill: the answer continues it.

use serde_json::{json, Map, Value};

use super::super::api::chat::template_kwargs;
use super::super::api::knobs::{Knobs, Stop};
use super::super::api::{read, read_at, Obj, TextOr};
use super::super::error::ApiError;
use super::super::images;
use super::super::request::{Chat, Defaults, GenRequest, Prompt};
use super::super::tools::{Family, Markers};
use super::body::{Block, Body, Content, MessageParam, OutputConfig, Thinking, Tool, ToolChoice};
use crate::plant::{self, Defect};

/// What a Messages request becomes.
pub struct Translated {
    pub request: GenRequest,
    /// The model name the answer echoes (the request's, else the server's).
    pub model: Option<String>,
}

/// Whether the body is a generation (`max_tokens` required) or a count_tokens request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    Create,
    Count,
}

fn bad(field: &str, message: impl Into<String>) -> ApiError {
    ApiError::field(field, message)
}

/// Translates a Messages body; `d` the server's defaults, `markers` the model's.
pub fn translate(
    body: &Value,
    d: &Defaults,
    markers: &Markers,
    purpose: Purpose,
) -> Result<Translated, ApiError> {
    let b: Body = read(body)?;
    let max_tokens = match (b.max_tokens, purpose) {
        (Some(n), _) => Some(n),
        (None, Purpose::Count) => None,
        (None, Purpose::Create) => {
            return Err(bad(
                "max_tokens",
                "max_tokens: Field required (the most tokens the answer may have, e.g. 1024)",
            ))
        }
    };
    let mut messages = Vec::new();
    if let Some(system) = b.system {
        let text = system_text(system)?;
        messages.push(json!({"role": "system", "content": text}));
    }
    let list = b
        .messages
        .ok_or_else(|| bad("messages", "messages: Field required"))?;
    if list.is_empty() {
        return Err(bad(
            "messages",
            "messages: at least one message is required",
        ));
    }
    let last_assistant = list.last().is_some_and(|m| m.0.role == "assistant");
    for (i, Obj(m)) in list.into_iter().enumerate() {
        message(m, &format!("messages[{i}]"), &mut messages)?;
    }
    let choice = b.tool_choice.map(|c| c.0);
    let none = choice.as_ref().is_some_and(|c| c.kind == "none");
    let tools = tools(b.tools.unwrap_or_default(), choice.as_ref(), markers)?;
    let tool_choice = choice.map(|c| tool_choice(c, &tools)).transpose()?;
    let mut chat = Chat {
        messages,
        // tool_choice "none": the tools are left out of the prompt, so the model is not
        // offered them.
        tools: (!tools.is_empty() && !none).then_some(Value::Array(tools)),
        tool_choice,
        ..Chat::default()
    };
    template_kwargs(&mut chat, b.chat_template_kwargs, &d.template_kwargs)?;
    chat.continue_final_message |= last_assistant;
    let think_budget = match b.thinking {
        None => None,
        Some(Obj(t)) => thinking(t, max_tokens, &mut chat.kwargs)?,
    };
    // A max_tokens past the model's context is taken as the context (Claude Code asks for
    // 32000 whatever the model): the answer stops at the context's end.
    let context = d.context as i64;
    let knobs = Knobs {
        max_tokens: max_tokens.map(|n| n.min(context)).or(Some(1)),
        temperature: b.temperature,
        top_p: b.top_p,
        top_k: b.top_k,
        min_p: b.min_p,
        seed: b.seed,
        logit_bias: b.logit_bias,
        repetition_penalty: b.repetition_penalty,
        presence_penalty: b.presence_penalty,
        frequency_penalty: b.frequency_penalty,
        stream: b.stream,
        stop: b.stop_sequences.map(Stop),
        response_format: output_format(b.output_config)?,
        model: b.model.clone(),
        ..Knobs::default()
    };
    let mut request = knobs
        .into_request(Prompt::Chat(Box::new(chat)), None, d)
        .map_err(renamed)?;
    request.think_budget = think_budget;
    request.images = images::read(images::in_messages(body)?, &d.images)?;
    // mlx_vlm.server strips its answers (`serve::emit`, `Strip`).
    request.strip = !request.images.is_empty() && !request.stream;
    Ok(Translated {
        request,
        model: b.model,
    })
}

/// `system`: a string, or text blocks joined with a blank line between them.
fn system_text(c: Content) -> Result<String, ApiError> {
    match c {
        TextOr::Text(s) => Ok(s),
        TextOr::List(blocks) => {
            let mut parts = Vec::new();
            for (j, Obj(b)) in blocks.into_iter().enumerate() {
                parts.push(text_block(b, &format!("system[{j}]"))?);
            }
            Ok(parts.join("\n\n"))
        }
    }
}

/// A block that must be `text`: its text.
fn text_block(b: Block, at: &str) -> Result<String, ApiError> {
    match b.kind.as_str() {
        "text" => b
            .text
            .ok_or_else(|| bad(&format!("{at}.text"), format!("{at}.text: Field required"))),
        other => Err(unsupported(other, at)),
    }
}

/// The refusal of a block kind this server does not read at `at`.
fn unsupported(kind: &str, at: &str) -> ApiError {
    let field = format!("{at}.type");
    match kind {
        "image" | "document" | "search_result" | "container_upload" => bad(
            &field,
            format!(
                "{kind} blocks are not supported: this server runs a text-only model; send \
                 the content as text blocks (extract the text of a document, describe an \
                 image) or use a server with a vision model"
            ),
        ),
        _ => bad(
            &field,
            format!(
                "unsupported content block type `{kind}` here (this server reads text, \
                 tool_use, tool_result, thinking and redacted_thinking blocks)"
            ),
        ),
    }
}

/// One message, appended as the template's chat messages.
fn message(m: MessageParam, at: &str, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let blocks = match m.content {
        TextOr::Text(s) => {
            match m.role.as_str() {
                "user" | "assistant" => out.push(json!({"role": m.role, "content": s})),
                _ => return Err(bad_role(&m.role, at)),
            }
            return Ok(());
        }
        TextOr::List(b) => b,
    };
    match m.role.as_str() {
        "user" => user(blocks, at, out),
        "assistant" => assistant(blocks, at, out),
        _ => Err(bad_role(&m.role, at)),
    }
}

fn bad_role(role: &str, at: &str) -> ApiError {
    bad(
        &format!("{at}.role"),
        format!(
            "{at}.role: unexpected role `{role}`; roles are \"user\" and \"assistant\" (a \
             system prompt goes in the top-level `system` field)"
        ),
    )
}

/// A user message's blocks: text joined, each tool_result a `tool` message (in order).
fn user(blocks: Vec<Obj<Block>>, at: &str, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let mut text = String::new();
    let mut any_text = false;
    for (j, Obj(b)) in blocks.into_iter().enumerate() {
        let bat = format!("{at}.content[{j}]");
        match b.kind.as_str() {
            "tool_result" => {
                if any_text {
                    out.push(json!({"role": "user", "content": std::mem::take(&mut text)}));
                    any_text = false;
                }
                let id = b.tool_use_id.ok_or_else(|| {
                    bad(
                        &format!("{bat}.tool_use_id"),
                        format!("{bat}.tool_use_id: Field required"),
                    )
                })?;
                let mut content = match &b.content {
                    None => String::new(),
                    Some(v) => match read_at::<Content>(v, &format!("{bat}.content"))? {
                        TextOr::Text(s) => s,
                        TextOr::List(inner) => {
                            let mut parts = Vec::new();
                            for (k, Obj(ib)) in inner.into_iter().enumerate() {
                                parts.push(text_block(ib, &format!("{bat}.content[{k}]"))?);
                            }
                            parts.join("\n\n")
                        }
                    },
                };
                if b.is_error == Some(true) {
                    content = format!("ERROR: {content}");
                }
                out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            "text" => {
                text.push_str(&text_block(b, &bat)?);
                any_text = true;
            }
            // Read from the body by `serve::images`; its place is marked (`vision::served`)
            // and the message stays (an image alone is a user turn).
            "image" => {
                text.push_str(crate::vision::served::IMAGE_MARK);
                any_text = true;
            }
            other => return Err(unsupported(other, &bat)),
        }
    }
    if any_text {
        out.push(json!({"role": "user", "content": text}));
    }
    Ok(())
}

/// An assistant message's blocks: one message with its text, reasoning and tool calls.
fn assistant(blocks: Vec<Obj<Block>>, at: &str, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let (mut text, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
    for (j, Obj(b)) in blocks.into_iter().enumerate() {
        let bat = format!("{at}.content[{j}]");
        let need = |v: Option<String>, key: &str| {
            v.ok_or_else(|| {
                bad(
                    &format!("{bat}.{key}"),
                    format!("{bat}.{key}: Field required"),
                )
            })
        };
        match b.kind.as_str() {
            "text" => text.push_str(&text_block(b, &bat)?),
            "thinking" => reasoning.push_str(&need(b.thinking, "thinking")?),
            "redacted_thinking" => {}
            "tool_use" => {
                let id = need(b.id, "id")?;
                let name = need(b.name, "name")?;
                let input = match b.input {
                    Some(v @ Value::Object(_)) => v,
                    _ => {
                        return Err(bad(
                            &format!("{bat}.input"),
                            format!("{bat}.input must be an object (the tool's arguments)"),
                        ))
                    }
                };
                calls.push(json!({"id": id, "type": "function",
                    "function": {"name": name, "arguments": input}}));
            }
            other => return Err(unsupported(other, &bat)),
        }
    }
    let mut m = json!({"role": "assistant", "content": text});
    if !reasoning.is_empty() {
        m["reasoning_content"] = json!(reasoning);
    }
    if !calls.is_empty() {
        m["tool_calls"] = Value::Array(calls);
    }
    out.push(m);
    Ok(())
}

/// `tools`: the chat route's function tools. With `tool_choice` any or tool on a model
/// whose calls can be constrained (the json_tools format), every tool is made strict, so
/// the grammar makes the answer start with a call, as Anthropic's forced tool use does.
fn tools(
    list: Vec<Obj<Tool>>,
    choice: Option<&ToolChoice>,
    markers: &Markers,
) -> Result<Vec<Value>, ApiError> {
    let forced = choice.is_some_and(|c| c.kind == "any" || c.kind == "tool")
        && markers.tools == Some(Family::JsonTools);
    let mut out = Vec::new();
    for (i, Obj(t)) in list.into_iter().enumerate() {
        let at = format!("tools[{i}]");
        // Server tools (web search, code execution, …: a versioned `type`) run on
        // Anthropic's side; this server has none, so they are left out of the prompt and
        // the model is offered the client tools only (as Claude Code sends both).
        if t.kind.as_deref().is_some_and(|k| k != "custom") {
            continue;
        }
        let name = t
            .name
            .filter(|n| !n.is_empty())
            .ok_or_else(|| bad(&format!("{at}.name"), format!("{at}.name: Field required")))?;
        let schema = match t.input_schema {
            Some(v @ Value::Object(_)) => v,
            _ => {
                return Err(bad(
                    &format!("{at}.input_schema"),
                    format!("{at}.input_schema must be a JSON Schema object"),
                ))
            }
        };
        // In the chat API's order (a template may render the tools' JSON as it is).
        let mut function = json!({"name": name});
        if let Some(d) = t.description {
            function["description"] = json!(d);
        }
        function["parameters"] = schema;
        if forced || t.strict == Some(true) {
            function["strict"] = json!(true);
        }
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(out)
}

/// `tool_choice` in the chat route's shape: auto, any (= required), tool (= that
/// function, which must be among the tools), none.
fn tool_choice(c: ToolChoice, tools: &[Value]) -> Result<Value, ApiError> {
    match c.kind.as_str() {
        "auto" | "none" => Ok(json!(c.kind)),
        "any" | "tool" if tools.is_empty() => Err(bad(
            "tool_choice",
            format!("tool_choice `{}` needs tools: send `tools`", c.kind),
        )),
        "any" => Ok(json!("required")),
        "tool" => {
            let name = c.name.ok_or_else(|| {
                bad(
                    "tool_choice.name",
                    "tool_choice.name: Field required for type \"tool\"",
                )
            })?;
            if !tools.iter().any(|t| t["function"]["name"] == name.as_str()) {
                return Err(bad(
                    "tool_choice.name",
                    format!("tool_choice names the tool `{name}`, which is not among the tools"),
                ));
            }
            Ok(json!({"type": "function", "function": {"name": name}}))
        }
        other => Err(bad(
            "tool_choice.type",
            format!(
                "tool_choice.type `{other}` is not one of \"auto\", \"any\", \"tool\", \"none\""
            ),
        )),
    }
}

/// `thinking`: the template's `enable_thinking`, and the budget (enabled only). Anthropic
/// asks budget_tokens >= 1024; this server takes any budget from 1 (tiny models think in
/// few tokens), still below max_tokens.
fn thinking(
    t: Thinking,
    max_tokens: Option<i64>,
    kwargs: &mut Map<String, Value>,
) -> Result<Option<usize>, ApiError> {
    let (on, budget) = match t.kind.as_str() {
        "enabled" => {
            let n = t.budget_tokens.ok_or_else(|| {
                bad(
                    "thinking.budget_tokens",
                    "thinking.budget_tokens: Field required for type \"enabled\"",
                )
            })?;
            if n < 1 {
                return Err(bad(
                    "thinking.budget_tokens",
                    "thinking.budget_tokens must be at least 1",
                ));
            }
            if let Some(max) = max_tokens.filter(|&m| n >= m) {
                return Err(bad(
                    "thinking.budget_tokens",
                    format!("thinking.budget_tokens ({n}) must be less than max_tokens ({max})"),
                ));
            }
            (true, Some(n as usize))
        }
        "disabled" => {
            if t.budget_tokens.is_some() {
                return Err(bad(
                    "thinking.budget_tokens",
                    "thinking.budget_tokens is only for type \"enabled\"",
                ));
            }
            (false, None)
        }
        "adaptive" | "between_tools" => (true, None),
        other => {
            return Err(bad(
                "thinking.type",
                format!(
                    "thinking.type `{other}` is not one of \"enabled\", \"disabled\", \
                     \"adaptive\""
                ),
            ))
        }
    };
    kwargs.insert("enable_thinking".into(), json!(on));
    Ok(budget)
}

/// An error of the generation fields' checks (`Knobs`), named by the Messages field.
fn renamed(mut e: ApiError) -> ApiError {
    match e.param.as_deref() {
        Some("stop") => e.param = Some("stop_sequences".into()),
        Some("response_format") => e.param = Some("output_config.format".into()),
        _ => {}
    }
    e
}

/// `output_config.format` (Anthropic's structured outputs) as the chat route's
/// `response_format`: the answer's text is constrained to the schema (`engine::constrain`).
fn output_format(config: Option<Obj<OutputConfig>>) -> Result<Option<Value>, ApiError> {
    let Some(Obj(format)) = config.and_then(|Obj(c)| c.format) else {
        return Ok(None);
    };
    if format.kind != "json_schema" {
        return Err(ApiError::field(
            "output_config.format.type",
            format!(
                "output_config.format.type must be \"json_schema\", not \"{}\"",
                format.kind
            ),
        ));
    }
    if plant::is(Defect::MessagesOutputFormatIgnored) {
        return Ok(None);
    }
    Ok(Some(json!({"type": "json_schema",
        "json_schema": {"name": "output", "schema": format.schema, "strict": true}})))
}

#[cfg(test)]
mod tests;
