//! The `/v1/responses` body as typed structs, OpenAI's field names (unknown fields of the
//! body and of `text` refused, as OpenAI refuses them; null reads as absent). `input`
//! turns a `Body` into the one internal request.

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::super::api::knobs::Stop;
use super::super::api::parts::{self, Kinds};
use super::super::api::{Obj, TextOr};

/// A Responses body. The engine's own sampling knobs (seed … chat_template_kwargs) are
/// taken as the chat route takes them.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Body {
    pub input: Option<Input>,
    pub instructions: Option<String>,
    pub previous_response_id: Option<String>,
    pub tools: Option<Vec<Obj<Tool>>>,
    pub tool_choice: Option<ToolChoice>,
    pub text: Option<Obj<Text>>,
    pub max_output_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub stream: Option<bool>,
    pub metadata: Option<Map<String, Value>>,
    pub model: Option<String>,
    pub store: Option<bool>,
    pub parallel_tool_calls: Option<bool>,
    pub background: Option<bool>,
    pub seed: Option<i64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub stop: Option<Stop>,
    pub logit_bias: Option<Map<String, Value>>,
    pub repetition_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    // Read for their type only (nothing in this server acts on them; the response echoes
    // them as sent).
    #[allow(dead_code)]
    stream_options: Option<Map<String, Value>>,
    #[allow(dead_code)]
    reasoning: Option<Obj<Reasoning>>,
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

/// `input`: a string (one user message) or a list of items.
pub type Input = TextOr<Obj<Item>>;

/// An input item: `message` (`type` may be left out when `role` is there),
/// `function_call`, `function_call_output` or `reasoning`; the fields its kind reads.
#[derive(Debug, Deserialize)]
pub struct Item {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub role: Option<String>,
    /// A message's text (`Parts`), read once the kind is known: a reasoning item's content
    /// is no text parts, and is not read.
    pub content: Option<Value>,
    pub call_id: Option<String>,
    pub name: Option<String>,
    pub arguments: Option<String>,
    /// A function_call_output's text (`Parts`).
    pub output: Option<Value>,
}

/// A content: a string, or a list of `input_text` / `output_text` parts, joined.
pub type Parts = parts::Parts<ResponsesParts>;

/// The Responses API's parts: `input_text` / `output_text`, and `input_image` (no files).
#[derive(Debug)]
pub enum ResponsesParts {}

impl Kinds for ResponsesParts {
    const TYPES: &'static [&'static str] = &["input_text", "output_text"];
    const IMAGE: &'static str = "input_image";
    const REFUSAL: &'static str =
        "only {\"type\": \"input_text\" | \"output_text\", \"text\": …} and \
         {\"type\": \"input_image\", \"image_url\": …} parts are supported (no files)";
}

/// A flat function tool, `{"type": "function", "name", "description", "parameters",
/// "strict"}`.
#[derive(Debug, Deserialize)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// The chat API's nesting: refused, with a hint.
    pub function: Option<Value>,
    pub name: Option<String>,
    pub description: Option<String>,
    pub parameters: Option<Map<String, Value>>,
    pub strict: Option<bool>,
}

/// `tool_choice`: a mode ("auto" | "none" | "required"), or `{"type": "function",
/// "name"}`; checked when the request is made (`input::tool_choice`).
#[derive(Debug, Clone)]
pub enum ToolChoice {
    Mode(String),
    Function(FunctionChoice),
}

#[derive(Debug, Clone, Deserialize)]
pub struct FunctionChoice {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub name: Option<String>,
}

impl<'de> Deserialize<'de> for ToolChoice {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ToolChoice;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(
                    "\"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\": …}",
                )
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<ToolChoice, E> {
                Ok(ToolChoice::Mode(s.to_owned()))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<ToolChoice, A::Error> {
                FunctionChoice::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(ToolChoice::Function)
            }
        }
        d.deserialize_any(V)
    }
}

/// `text`: the answer's format (and a verbosity hint, read for its type).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Text {
    pub format: Option<Obj<Format>>,
    #[allow(dead_code)]
    verbosity: Option<String>,
}

/// `text.format`: `{"type": "text" | "json_object"}` or `{"type": "json_schema", "name",
/// "schema", "description", "strict"}`.
#[derive(Debug, Deserialize)]
pub struct Format {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub name: Option<String>,
    #[allow(dead_code)]
    description: Option<String>,
    pub schema: Option<Map<String, Value>>,
    pub strict: Option<bool>,
}
