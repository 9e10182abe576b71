//! A `/v1/responses` body as a typed struct (`Body`; unknown fields refused, as OpenAI
//! does) turned straight into the `GenRequest` a chat completion gets: the input items
//! become the template's chat messages (`request::Chat`), `text.format` the grammar, and
//! the generation fields the chat API's `Knobs`. Errors name the Responses field.

use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::super::api::chat::template_kwargs;
use super::super::api::knobs::{Knobs, Stop};
use super::super::api::{read, Obj};
use super::super::error::ApiError;
use super::super::request::{Chat, Defaults, GenRequest, Prompt};
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

/// A Responses body. The engine's own sampling knobs (seed … chat_template_kwargs) are
/// taken as the chat route takes them.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    input: Option<Value>,
    instructions: Option<String>,
    previous_response_id: Option<String>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    text: Option<Value>,
    max_output_tokens: Option<i64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    stream: Option<bool>,
    // Read for their type only: nothing in this server acts on them.
    #[allow(dead_code)]
    stream_options: Option<Map<String, Value>>,
    metadata: Option<Map<String, Value>>,
    model: Option<String>,
    #[allow(dead_code)]
    reasoning: Option<Obj<Reasoning>>,
    store: Option<bool>,
    parallel_tool_calls: Option<bool>,
    #[allow(dead_code)]
    include: Option<Vec<String>>,
    #[allow(dead_code)]
    truncation: Option<Truncation>,
    #[allow(dead_code)]
    user: Option<String>,
    #[allow(dead_code)]
    service_tier: Option<String>,
    #[allow(dead_code)]
    prompt_cache_key: Option<String>,
    #[allow(dead_code)]
    safety_identifier: Option<String>,
    background: Option<bool>,
    seed: Option<i64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    stop: Option<Stop>,
    logit_bias: Option<Map<String, Value>>,
    repetition_penalty: Option<f64>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    chat_template_kwargs: Option<Map<String, Value>>,
}

#[derive(Debug, Deserialize)]
#[allow(dead_code)] // read for their type only
struct Reasoning {
    effort: Option<String>,
    summary: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Truncation {
    Auto,
    Disabled,
}

fn bad(field: &str, message: impl Into<String>) -> ApiError {
    ApiError::field(field, message)
}

/// A string field (absent or null: None).
fn string<'a>(o: &'a Map<String, Value>, key: &str, at: &str) -> Result<Option<&'a str>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.as_str())),
        Some(_) => Err(bad(at, format!("{at} must be a string"))),
    }
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
    let input = b.input.as_ref().ok_or_else(|| {
        bad(
            "input",
            "input is required: a string or a list of input items",
        )
    })?;
    items(input, &mut conversation)?;
    let (chat_tools, tools) = tools(b.tools.as_ref())?;
    let tool_choice = tool_choice(b.tool_choice.as_ref())?;
    let (response_format, text) = text_format(b.text.as_ref())?;
    let echo = Echo {
        instructions: b.instructions.as_ref().map_or(Value::Null, |s| json!(s)),
        previous_response_id: raw(body, "previous_response_id", Value::Null),
        tools,
        tool_choice: b.tool_choice.clone().unwrap_or(json!("auto")),
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
    let request = knobs
        .into_request(Prompt::Chat(Box::new(chat)), None, d)
        .map_err(renamed)?;
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
fn items(input: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let list = match input {
        Value::String(s) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(());
        }
        Value::Array(list) if !list.is_empty() => list,
        _ => {
            return Err(bad(
                "input",
                "input must be a string or a non-empty list of input items",
            ))
        }
    };
    for (i, item) in list.iter().enumerate() {
        let at = format!("input[{i}]");
        let o = item
            .as_object()
            .ok_or_else(|| bad(&at, "an input item must be an object"))?;
        let kind = match string(o, "type", &format!("{at}.type"))? {
            Some(t) => t,
            None if o.contains_key("role") => "message",
            None => {
                return Err(bad(
                    &format!("{at}.type"),
                    "the item needs a `type` (or a `role`)",
                ))
            }
        };
        match kind {
            "message" => out.push(message(o, &at)?),
            "function_call" => function_call(o, &at, out)?,
            "function_call_output" if plant::is(Defect::ResponsesToolOutputDropped) => {}
            "function_call_output" => out.push(json!({
                "role": "tool",
                "tool_call_id": required(o, "call_id", &at)?,
                "content": parts(o.get("output"), &format!("{at}.output"))?,
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

fn required<'a>(o: &'a Map<String, Value>, key: &str, at: &str) -> Result<&'a str, ApiError> {
    let field = format!("{at}.{key}");
    string(o, key, &field)?.ok_or_else(|| bad(&field, format!("{field} is required (a string)")))
}

fn message(o: &Map<String, Value>, at: &str) -> Result<Value, ApiError> {
    let role = required(o, "role", at)?;
    if !["user", "system", "developer", "assistant"].contains(&role) {
        return Err(bad(
            &format!("{at}.role"),
            format!("unknown role `{role}` (expected user, system, developer or assistant)"),
        ));
    }
    let content = parts(o.get("content"), &format!("{at}.content"))?;
    Ok(json!({"role": role, "content": content}))
}

/// A content: a string, or a list of `input_text` / `output_text` parts, joined.
fn parts(v: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match v {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(list)) => {
            let mut text = String::new();
            for (j, part) in list.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text")) {
                    (Some("input_text" | "output_text"), Some(Value::String(t))) => {
                        text.push_str(t)
                    }
                    _ => {
                        return Err(bad(
                            &format!("{at}[{j}]"),
                            "only {\"type\": \"input_text\" | \"output_text\", \"text\": …} \
                             parts are supported (no images or files)",
                        ))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(bad(
            at,
            format!("{at} must be a string or a list of text parts"),
        )),
    }
}

/// A `function_call` item: a tool call of the assistant turn before it (a new assistant
/// turn when the last message is not the assistant's).
fn function_call(o: &Map<String, Value>, at: &str, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let call_id = required(o, "call_id", at)?;
    let name = required(o, "name", at)?;
    let arguments = required(o, "arguments", at)?;
    if let Err(e) = serde_json::from_str::<Value>(arguments) {
        return Err(bad(
            &format!("{at}.arguments"),
            format!("arguments must be a JSON document in a string: {e}"),
        ));
    }
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
fn tools(v: Option<&Value>) -> Result<(Vec<Value>, Vec<Value>), ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok((Vec::new(), Vec::new())),
        Some(Value::Array(l)) => l,
        Some(_) => return Err(bad("tools", "tools must be a list of function tools")),
    };
    let (mut chat, mut echo) = (Vec::new(), Vec::new());
    for (i, tool) in list.iter().enumerate() {
        let at = format!("tools[{i}]");
        let t = tool
            .as_object()
            .ok_or_else(|| bad(&at, "a tool must be an object"))?;
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(
                &format!("{at}.type"),
                "only {\"type\": \"function\", \"name\": …} tools are supported",
            ));
        }
        if t.contains_key("function") {
            return Err(bad(
                &format!("{at}.function"),
                "Responses tools are flat: put name, description and parameters on the tool \
                 itself, not under `function` (that is the chat completions shape)",
            ));
        }
        let name = required(t, "name", &at)?;
        if name.is_empty() {
            return Err(bad(
                &format!("{at}.name"),
                "the tool's name must not be empty",
            ));
        }
        let description = string(t, "description", &format!("{at}.description"))?;
        let parameters = t.get("parameters").filter(|p| !p.is_null());
        if parameters.is_some_and(|p| !p.is_object()) {
            return Err(bad(
                &format!("{at}.parameters"),
                "parameters must be a JSON Schema object",
            ));
        }
        let strict = match t.get("strict") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(_) => return Err(bad(&format!("{at}.strict"), "strict must be a boolean")),
        };
        let mut function = json!({"name": name});
        if let Some(d) = description {
            function["description"] = json!(d);
        }
        if let Some(p) = parameters {
            function["parameters"] = p.clone();
        }
        if let Some(s) = strict {
            function["strict"] = json!(s);
        }
        chat.push(json!({"type": "function", "function": function}));
        echo.push(
            json!({"type": "function", "name": name, "description": description,
            "parameters": parameters, "strict": strict}),
        );
    }
    Ok((chat, echo))
}

/// `tool_choice`: "auto" | "none" | "required" | `{"type": "function", "name"}`, as the
/// chat route's (which reads it and lets the model decide).
fn tool_choice(v: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let wrong = || {
        bad(
            "tool_choice",
            "tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \
             \"name\": …}",
        )
    };
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if ["auto", "none", "required"].contains(&s.as_str()) => {
            Ok(Some(json!(s)))
        }
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("tool_choice.name", "tool_choice.name must be a string"))?;
            Ok(Some(
                json!({"type": "function", "function": {"name": name}}),
            ))
        }
        Some(_) => Err(wrong()),
    }
}

/// `text.format`: the chat route's `response_format`, and `text` as the response echoes it.
fn text_format(v: Option<&Value>) -> Result<(Option<Value>, Value), ApiError> {
    let plain = json!({"format": {"type": "text"}});
    let text = match v {
        None | Some(Value::Null) => return Ok((None, plain)),
        Some(Value::Object(t)) => t,
        Some(_) => return Err(bad("text", "text must be an object: {\"format\": {…}}")),
    };
    if let Some(k) = text.keys().find(|k| *k != "format" && *k != "verbosity") {
        return Err(bad(
            &format!("text.{k}"),
            format!("unknown parameter `text.{k}`"),
        ));
    }
    string(text, "verbosity", "text.verbosity")?;
    let mut echo = Value::Object(text.clone());
    let format = match text.get("format") {
        None | Some(Value::Null) => {
            echo["format"] = json!({"type": "text"});
            return Ok((None, echo));
        }
        Some(Value::Object(f)) => f,
        Some(_) => return Err(bad("text.format", "text.format must be an object")),
    };
    let chat = match string(format, "type", "text.format.type")? {
        Some("text") => None,
        Some(_) if plant::is(Defect::ResponsesFormatIgnored) => None,
        Some("json_object") => Some(json!({"type": "json_object"})),
        Some("json_schema") => {
            let name = required(format, "name", "text.format")?;
            string(format, "description", "text.format.description")?;
            let schema = match format.get("schema") {
                Some(s @ Value::Object(_)) => s.clone(),
                _ => {
                    return Err(bad(
                        "text.format.schema",
                        "text.format.schema must be a JSON Schema object",
                    ))
                }
            };
            let strict = match format.get("strict") {
                None | Some(Value::Null) => Value::Null,
                Some(b @ Value::Bool(_)) => b.clone(),
                Some(_) => return Err(bad("text.format.strict", "strict must be a boolean")),
            };
            Some(json!({"type": "json_schema",
                "json_schema": {"name": name, "schema": schema, "strict": strict}}))
        }
        _ => {
            return Err(bad(
                "text.format.type",
                "text.format.type must be \"text\", \"json_object\" or \"json_schema\"",
            ))
        }
    };
    Ok((chat, echo))
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
