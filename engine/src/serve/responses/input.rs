//! A `/v1/responses` body (`body::Body`, typed) turned straight into the `GenRequest` a
//! chat completion gets: the input items become the template's chat messages
//! (`request::Chat`), the flat tools the chat API's, `text.format` the grammar, and the
//! generation fields the chat API's `Knobs`. Errors name the Responses field.

use serde_json::{json, Map, Value};

use super::super::api::chat::template_kwargs;
use super::super::api::knobs::Knobs;
use super::super::api::{read, read_at, Obj, TextOr};
use super::super::error::ApiError;
use super::super::images;
use super::super::request::{Chat, Defaults, GenRequest, Prompt};
use super::body::{Body, Format, Input, Item, Parts, Text, Tool, ToolChoice};
use super::store::Store;
use crate::plant::{self, Defect};

/// What a Responses request becomes.
pub struct Translated {
    /// The request for the model thread.
    pub request: GenRequest,
    /// The conversation without the instructions: the previous response's, then the new
    /// input, as chat messages (what is kept for the next turn, with the answer).
    pub conversation: Vec<Value>,
    pub echo: Echo,
}

/// The request's fields the response object echoes.
#[derive(Debug, Clone)]
pub struct Echo {
    pub instructions: Value,
    pub previous_response_id: Value,
    /// The tools in the Responses shape, as validated.
    pub tools: Vec<Value>,
    pub tool_choice: Value,
    pub text: Value,
    pub max_output_tokens: Value,
    pub metadata: Value,
    pub parallel_tool_calls: bool,
    pub store: bool,
    pub reasoning: Value,
    pub truncation: Value,
    pub user: Value,
}

/// A refusal before the model sees the request: an ApiError, and OpenAI's `code` for it.
pub struct Refused {
    pub error: ApiError,
    pub code: Option<&'static str>,
}

impl From<ApiError> for Refused {
    fn from(error: ApiError) -> Self {
        Refused { error, code: None }
    }
}

fn bad(field: &str, message: impl Into<String>) -> ApiError {
    ApiError::field(field, message)
}

/// Translates a Responses body; `store` holds the conversations `previous_response_id`
/// may name, `d` the server's defaults.
pub fn translate(body: &Value, store: &Store, d: &Defaults) -> Result<Translated, Refused> {
    let b: Body = read(body)?;
    if b.background == Some(true) {
        return Err(bad(
            "background",
            "background responses are not supported by this server: send background: false",
        )
        .into());
    }
    let mut conversation = match &b.previous_response_id {
        None => Vec::new(),
        Some(id) => previous(store, id)?,
    };
    let input = b.input.ok_or_else(|| {
        bad(
            "input",
            "input is required: a string or a list of input items",
        )
    })?;
    items(input, &mut conversation)?;
    let (chat_tools, tools) = tools(b.tools.unwrap_or_default())?;
    let tool_choice = b.tool_choice.map(tool_choice).transpose()?;
    let (response_format, text) = text_format(b.text, body)?;
    let echo = Echo {
        instructions: b.instructions.as_ref().map_or(Value::Null, |s| json!(s)),
        previous_response_id: raw(body, "previous_response_id", Value::Null),
        tools,
        tool_choice: Some(raw(body, "tool_choice", Value::Null))
            .filter(|v| !v.is_null())
            .unwrap_or(json!("auto")),
        text,
        max_output_tokens: raw(body, "max_output_tokens", Value::Null),
        metadata: metadata(b.metadata.as_ref())?,
        parallel_tool_calls: b.parallel_tool_calls.unwrap_or(true),
        store: b.store.unwrap_or(true),
        reasoning: raw(body, "reasoning", Value::Null),
        truncation: raw(body, "truncation", json!("disabled")),
        user: raw(body, "user", Value::Null),
    };
    let mut messages = Vec::with_capacity(conversation.len() + 1);
    if let Some(text) = &b.instructions {
        messages.push(json!({"role": "system", "content": text}));
    }
    for m in &conversation {
        messages.push(for_template(m)?);
    }
    let mut chat = Chat {
        messages,
        tools: (!chat_tools.is_empty()).then_some(Value::Array(chat_tools)),
        tool_choice,
        ..Chat::default()
    };
    template_kwargs(&mut chat, b.chat_template_kwargs, &d.template_kwargs)?;
    let knobs = Knobs {
        max_tokens: b.max_output_tokens,
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
        model: b.model,
        response_format,
        stop: b.stop,
        ..Knobs::default()
    };
    let mut request = knobs
        .into_request(Prompt::Chat(Box::new(chat)), None, d)
        .map_err(renamed)?;
    request.images = images::read(images::in_responses(body)?, &d.images)?;
    // mlx_vlm.server strips its answers (`serve::emit`, `Strip`).
    request.strip = !request.images.is_empty();
    Ok(Translated {
        request,
        conversation,
        echo,
    })
}

/// A field of the body as sent (null kept), for the response to echo; `absent` if absent.
fn raw(body: &Value, key: &str, absent: Value) -> Value {
    body.get(key).cloned().unwrap_or(absent)
}

/// A kept chat message as the template reads it: tool-call arguments (JSON strings, as
/// OpenAI shapes them) parsed, as the chat route parses a client's.
fn for_template(m: &Value) -> Result<Value, ApiError> {
    let mut m = m.clone();
    let calls = m.get_mut("tool_calls").and_then(Value::as_array_mut);
    for call in calls.into_iter().flatten() {
        if let Some(Value::String(args)) = call.pointer("/function/arguments") {
            if args.is_empty() {
                continue;
            }
            let parsed: Value = serde_json::from_str(args)
                .map_err(|e| bad("input", format!("arguments is not valid JSON: {e}")))?;
            call["function"]["arguments"] = parsed;
        }
    }
    Ok(m)
}

fn previous(store: &Store, id: &str) -> Result<Vec<Value>, Refused> {
    if plant::is(Defect::ResponsesPreviousDropped) {
        return Ok(Vec::new());
    }
    match store.get(id) {
        Some(c) => Ok(c.as_ref().clone()),
        None => Err(Refused {
            error: bad(
                "previous_response_id",
                format!(
                    "Previous response with id '{id}' not found (this server keeps its last \
                     {} responses, in memory, and not those sent with store: false).",
                    super::store::MAX_ENTRIES
                ),
            )
            .with_status(axum::http::StatusCode::NOT_FOUND),
            code: Some("previous_response_not_found"),
        }),
    }
}

/// `input`: a string (one user message) or a list of items, appended as chat messages.
fn items(input: Input, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let list = match input {
        TextOr::Text(s) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(());
        }
        TextOr::List(list) if !list.is_empty() => list,
        TextOr::List(_) => {
            return Err(bad(
                "input",
                "input must be a string or a non-empty list of input items",
            ))
        }
    };
    for (i, Obj(item)) in list.into_iter().enumerate() {
        let at = format!("input[{i}]");
        let kind = match item.kind.as_deref() {
            Some(t) => t,
            None if item.role.is_some() => "message",
            None => {
                return Err(bad(
                    &format!("{at}.type"),
                    "the item needs a `type` (or a `role`)",
                ))
            }
        };
        match kind {
            "message" => out.push(message(&item, &at)?),
            "function_call" => function_call(&item, &at, out)?,
            "function_call_output" if plant::is(Defect::ResponsesToolOutputDropped) => {}
            "function_call_output" => out.push(json!({
                "role": "tool",
                "tool_call_id": required(item.call_id.as_deref(), "call_id", &at)?,
                "content": parts(item.output.as_ref(), &format!("{at}.output"))?,
            })),
            // Past reasoning is not part of the prompt (chat templates drop it too).
            "reasoning" => {}
            other => {
                return Err(bad(
                    &format!("{at}.type"),
                    format!(
                        "unsupported input item type `{other}` (this server reads message, \
                         function_call, function_call_output and reasoning items)"
                    ),
                ))
            }
        }
    }
    Ok(())
}

/// A field an item's kind needs.
fn required<'a>(v: Option<&'a str>, key: &str, at: &str) -> Result<&'a str, ApiError> {
    let field = format!("{at}.{key}");
    v.ok_or_else(|| bad(&field, format!("{field} is required (a string)")))
}

fn message(item: &Item, at: &str) -> Result<Value, ApiError> {
    let role = required(item.role.as_deref(), "role", at)?;
    if !["user", "system", "developer", "assistant"].contains(&role) {
        return Err(bad(
            &format!("{at}.role"),
            format!("unknown role `{role}` (expected user, system, developer or assistant)"),
        ));
    }
    let content = parts(item.content.as_ref(), &format!("{at}.content"))?;
    Ok(json!({"role": role, "content": content}))
}

/// A content (`body::Parts`) at `at`, joined into its text.
fn parts(v: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match v {
        Some(v) => read_at::<Parts>(v, at).map(|p| p.0),
        None => Err(bad(
            at,
            format!("{at} must be a string or a list of text parts"),
        )),
    }
}

/// A `function_call` item: a tool call of the assistant turn before it (a new assistant
/// turn when the last message is not the assistant's).
fn function_call(item: &Item, at: &str, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let call_id = required(item.call_id.as_deref(), "call_id", at)?;
    let name = required(item.name.as_deref(), "name", at)?;
    let arguments = required(item.arguments.as_deref(), "arguments", at)?;
    if let Err(e) = serde_json::from_str::<Value>(arguments) {
        return Err(bad(
            &format!("{at}.arguments"),
            format!("arguments must be a JSON document in a string: {e}"),
        ));
    }
    // Kept in the chat API's shape (arguments a JSON string): the conversation is stored
    // so, and `for_template` parses the arguments for the template.
    let call = json!({"id": call_id, "type": "function",
        "function": {"name": name, "arguments": arguments}});
    match out.last_mut() {
        Some(last) if last["role"] == "assistant" => {
            match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                Some(calls) => calls.push(call),
                None => last["tool_calls"] = json!([call]),
            }
        }
        _ => out.push(json!({"role": "assistant", "content": "", "tool_calls": [call]})),
    }
    Ok(())
}

/// `tools` in the Responses shape (flat function tools): the chat route's tools, and the
/// tools as the response echoes them.
fn tools(list: Vec<Obj<Tool>>) -> Result<(Vec<Value>, Vec<Value>), ApiError> {
    let (mut chat, mut echo) = (Vec::new(), Vec::new());
    for (i, Obj(t)) in list.into_iter().enumerate() {
        let at = format!("tools[{i}]");
        if t.kind.as_deref() != Some("function") {
            return Err(bad(
                &format!("{at}.type"),
                "only {\"type\": \"function\", \"name\": …} tools are supported",
            ));
        }
        if t.function.is_some() {
            return Err(bad(
                &format!("{at}.function"),
                "Responses tools are flat: put name, description and parameters on the tool \
                 itself, not under `function` (that is the chat completions shape)",
            ));
        }
        let name = required(t.name.as_deref(), "name", &at)?;
        if name.is_empty() {
            return Err(bad(
                &format!("{at}.name"),
                "the tool's name must not be empty",
            ));
        }
        let mut function = json!({"name": name});
        if let Some(d) = &t.description {
            function["description"] = json!(d);
        }
        if let Some(p) = &t.parameters {
            function["parameters"] = json!(p);
        }
        if let Some(s) = t.strict {
            function["strict"] = json!(s);
        }
        chat.push(json!({"type": "function", "function": function}));
        echo.push(
            json!({"type": "function", "name": name, "description": t.description,
            "parameters": t.parameters, "strict": t.strict}),
        );
    }
    Ok((chat, echo))
}

/// `tool_choice` in the chat route's shape (which reads it and lets the model decide).
fn tool_choice(c: ToolChoice) -> Result<Value, ApiError> {
    let wrong = || {
        bad(
            "tool_choice",
            "tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \
             \"name\": …}",
        )
    };
    match c {
        ToolChoice::Mode(s) if ["auto", "none", "required"].contains(&s.as_str()) => Ok(json!(s)),
        ToolChoice::Function(f) if f.kind.as_deref() == Some("function") => {
            let name = f
                .name
                .ok_or_else(|| bad("tool_choice.name", "tool_choice.name must be a string"))?;
            Ok(json!({"type": "function", "function": {"name": name}}))
        }
        _ => Err(wrong()),
    }
}

/// `text.format`: the chat route's `response_format`, and `text` as the response echoes it
/// (as sent, its format `{"type": "text"}` when it has none).
fn text_format(text: Option<Obj<Text>>, body: &Value) -> Result<(Option<Value>, Value), ApiError> {
    let Some(Obj(text)) = text else {
        return Ok((None, json!({"format": {"type": "text"}})));
    };
    let mut echo = body["text"].clone();
    let Some(Obj(format)) = text.format else {
        echo["format"] = json!({"type": "text"});
        return Ok((None, echo));
    };
    let chat = match format.kind.as_deref() {
        Some("text") => None,
        Some(_) if plant::is(Defect::ResponsesFormatIgnored) => None,
        Some("json_object") => Some(json!({"type": "json_object"})),
        Some("json_schema") => Some(json_schema(format)?),
        _ => {
            return Err(bad(
                "text.format.type",
                "text.format.type must be \"text\", \"json_object\" or \"json_schema\"",
            ))
        }
    };
    Ok((chat, echo))
}

/// A `json_schema` format as the chat route's `response_format`.
fn json_schema(format: Format) -> Result<Value, ApiError> {
    let name = required(format.name.as_deref(), "name", "text.format")?;
    let schema = format.schema.as_ref().ok_or_else(|| {
        bad(
            "text.format.schema",
            "text.format.schema must be a JSON Schema object",
        )
    })?;
    Ok(json!({"type": "json_schema",
        "json_schema": {"name": name, "schema": schema, "strict": format.strict}}))
}

/// `metadata`: up to 16 string values under keys of at most 64 characters (values at most
/// 512), as OpenAI bounds it; echoed as sent.
fn metadata(v: Option<&Map<String, Value>>) -> Result<Value, ApiError> {
    let Some(m) = v else {
        return Ok(json!({}));
    };
    if plant::is(Defect::ResponsesMetadataUnchecked) {
        return Ok(Value::Object(m.clone()));
    }
    if m.len() > 16 {
        return Err(bad("metadata", "metadata holds at most 16 keys"));
    }
    for (k, v) in m {
        if k.chars().count() > 64 {
            return Err(bad(
                "metadata",
                format!("metadata key `{k}` is longer than 64 characters"),
            ));
        }
        match v.as_str() {
            Some(s) if s.chars().count() <= 512 => {}
            Some(_) => {
                return Err(bad(
                    "metadata",
                    format!("metadata[{k}] is longer than 512 characters"),
                ))
            }
            None => return Err(bad("metadata", format!("metadata[{k}] must be a string"))),
        }
    }
    Ok(Value::Object(m.clone()))
}

/// An error of the generation fields' checks (`Knobs`), named by the Responses field.
fn renamed(mut e: ApiError) -> ApiError {
    let Some(param) = e.param.take() else {
        return e;
    };
    let (name, message) = match param.as_str() {
        "max_tokens" => (
            "max_output_tokens".to_owned(),
            e.message.replace("max_tokens", "max_output_tokens"),
        ),
        "response_format" => ("text.format".to_owned(), e.message.clone()),
        _ => (param.clone(), e.message.clone()),
    };
    e.param = Some(name);
    e.message = message;
    e
}

#[cfg(test)]
mod tests;
