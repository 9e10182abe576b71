//! `/v1/chat/completions` bodies: the messages, tools, tool_choice and template kwargs
//! (the generation fields are `knobs::Knobs`), typed, and turned into a `request::Chat`.
//! The messages reach the chat template as the client sent them (mlx_lm.server hands the
//! dicts to `apply_chat_template`, unknown keys and key order included): the typed
//! `Message` checks them and gives the two edits made in place, the content as text and
//! JSON-string tool-call arguments parsed.

use serde::de::{self, Deserializer};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::knobs::{Knobs, Logprobs};
use super::parts::{Kinds, Parts};
use super::{read, Obj};
use crate::serve::error::ApiError;
use crate::serve::images;
use crate::serve::request::{Chat, Defaults, GenRequest, Prompt};

/// The chat API's own fields.
#[derive(Debug, Deserialize)]
struct Body {
    messages: Option<Vec<Obj<Message>>>,
    tools: Option<Vec<Obj<Tool>>>,
    tool_choice: Option<ToolChoice>,
    chat_template_kwargs: Option<Map<String, Value>>,
    logprobs: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Role {
    System,
    User,
    Assistant,
    Tool,
    Developer,
}

/// A message; the fields the template reads typed, the rest left in the raw dict.
#[derive(Debug, Deserialize)]
struct Message {
    #[allow(dead_code)] // checked: the template reads it from the raw dict
    role: Role,
    content: Option<Content>,
    #[allow(dead_code)]
    tool_call_id: Option<String>,
    #[allow(dead_code)]
    name: Option<String>,
    #[allow(dead_code)]
    reasoning_content: Option<String>,
    #[allow(dead_code)]
    reasoning: Option<String>,
    tool_calls: Option<Vec<Obj<CallIn>>>,
}

/// `process_message_content`: a string, or a list of `{type: "text", text}` parts joined.
type Content = Parts<ChatParts>;

/// The chat API's parts: `{"type": "text", "text": …}` and `{"type": "image_url", …}`.
#[derive(Debug)]
enum ChatParts {}

impl Kinds for ChatParts {
    const TYPES: &'static [&'static str] = &["text"];
    const IMAGE: &'static str = "image_url";
    const REFUSAL: &'static str = "only {\"type\": \"text\", \"text\": …} and \
         {\"type\": \"image_url\", \"image_url\": {\"url\": …}} content parts are supported";
}

/// An assistant message's tool call; only `function.arguments` is read (the template
/// takes the rest as sent).
#[derive(Debug, Deserialize)]
struct CallIn {
    function: Option<Obj<FunctionIn>>,
}

#[derive(Debug, Deserialize)]
struct FunctionIn {
    arguments: Option<Arguments>,
}

/// Tool-call arguments: a JSON string (as OpenAI clients send them back) parsed for the
/// template; an empty string or any other value kept as it is.
#[derive(Debug)]
struct Arguments(Option<Value>);

impl<'de> Deserialize<'de> for Arguments {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Value::deserialize(d)? {
            Value::String(s) if !s.is_empty() => serde_json::from_str(&s)
                .map(|v| Arguments(Some(v)))
                .map_err(|e| de::Error::custom(format!("arguments is not valid JSON: {e}"))),
            _ => Ok(Arguments(None)),
        }
    }
}

/// `{"type": "function", "function": {"name", "description", "parameters"}}`.
#[derive(Debug, Deserialize)]
struct Tool {
    #[serde(rename = "type")]
    kind: Option<String>,
    function: Option<Obj<Function>>,
}

#[derive(Debug, Deserialize)]
struct Function {
    #[allow(dead_code)] // checked; the template reads the raw tool
    name: String,
    #[allow(dead_code)]
    parameters: Option<Map<String, Value>>,
}

/// `tool_choice`: "auto" | "none" | "required" | an object, kept as sent (mlx_lm.server
/// ignores it; strict tools read it: `tools::strict`).
#[derive(Debug)]
struct ToolChoice(Value);

impl<'de> Deserialize<'de> for ToolChoice {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Value::deserialize(d)? {
            Value::String(s) if ["auto", "none", "required"].contains(&s.as_str()) => {
                Ok(ToolChoice(Value::String(s)))
            }
            v @ Value::Object(_) => Ok(ToolChoice(v)),
            _ => Err(de::Error::custom(
                "tool_choice must be \"auto\", \"none\", \"required\" or an object",
            )),
        }
    }
}

/// Parses and validates a chat completions body.
pub fn parse(body: &Value, d: &Defaults) -> Result<GenRequest, ApiError> {
    let b: Body = read(body)?;
    let knobs: Knobs = read(body)?;
    let messages = messages(b.messages, &body["messages"])?;
    let tools = tools(b.tools, &body["tools"])?;
    let mut chat = Chat {
        messages,
        tools,
        tool_choice: b.tool_choice.map(|c| c.0),
        ..Chat::default()
    };
    template_kwargs(&mut chat, b.chat_template_kwargs, &d.template_kwargs)?;
    let logprobs = b.logprobs.map(Logprobs::Flag);
    let mut request = knobs.into_request(Prompt::Chat(Box::new(chat)), logprobs, d)?;
    request.images = images::read(images::in_chat(body)?, &d.images)?;
    // mlx_vlm.server strips its answers (`serve::emit`, `Strip`).
    request.strip = !request.images.is_empty() && !request.stream;
    Ok(request)
}

/// The messages for the template: each raw dict with its content made text and its
/// tool-call arguments parsed, in place.
fn messages(typed: Option<Vec<Obj<Message>>>, raw: &Value) -> Result<Vec<Value>, ApiError> {
    let typed = typed
        .filter(|m| !m.is_empty())
        .ok_or_else(|| ApiError::field("messages", "messages must be a non-empty list"))?;
    let raw = raw.as_array().map(Vec::as_slice).unwrap_or_default();
    Ok(typed
        .into_iter()
        .zip(raw)
        .map(|(Obj(m), raw)| {
            let mut dict = raw.as_object().cloned().unwrap_or_default();
            dict.insert(
                "content".into(),
                Value::String(m.content.unwrap_or_default().0),
            );
            let calls = dict.get_mut("tool_calls").and_then(Value::as_array_mut);
            for (call, Obj(typed)) in calls
                .into_iter()
                .flatten()
                .zip(m.tool_calls.into_iter().flatten())
            {
                let parsed = typed.function.and_then(|f| f.0.arguments).and_then(|a| a.0);
                if let Some(args) = parsed {
                    call["function"]["arguments"] = args;
                }
            }
            Value::Object(dict)
        })
        .collect())
}

/// `tools` as sent (the template reads them); None when absent or empty, as mlx_lm.server
/// reads it (`body.get("tools") or None`).
fn tools(typed: Option<Vec<Obj<Tool>>>, raw: &Value) -> Result<Option<Value>, ApiError> {
    let Some(typed) = typed else {
        return Ok(None);
    };
    for (i, Obj(tool)) in typed.iter().enumerate() {
        if tool.kind.as_deref().is_some_and(|k| k != "function") {
            return Err(ApiError::field(
                &format!("tools[{i}].type"),
                "only tools of type \"function\" are supported",
            ));
        }
        if tool.function.is_none() {
            return Err(ApiError::field(
                &format!("tools[{i}].function"),
                "function must be an object",
            ));
        }
    }
    Ok((!typed.is_empty()).then(|| raw.clone()))
}

/// The template kwargs: `--chat-template-args`, then the request's `chat_template_kwargs`
/// over them; apply_chat_template's own `documents` and `continue_final_message` are taken
/// out, and the names it passes itself are refused. Shared with the Responses API.
pub fn template_kwargs(
    chat: &mut Chat,
    request: Option<Map<String, Value>>,
    defaults: &Map<String, Value>,
) -> Result<(), ApiError> {
    let field = "chat_template_kwargs";
    let mut kwargs = defaults.clone();
    kwargs.extend(request.unwrap_or_default());
    for reserved in [
        "messages",
        "conversation",
        "tools",
        "add_generation_prompt",
        "tokenize",
        "chat_template",
    ] {
        if kwargs.contains_key(reserved) {
            return Err(ApiError::field(
                field,
                format!("chat_template_kwargs may not set `{reserved}` (the server passes it)"),
            ));
        }
    }
    chat.documents = kwargs.remove("documents").filter(|d| !d.is_null());
    chat.continue_final_message = match kwargs.remove("continue_final_message") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => b,
        Some(_) => {
            return Err(ApiError::field(
                field,
                "continue_final_message must be a boolean",
            ))
        }
    };
    chat.kwargs = kwargs;
    Ok(())
}
