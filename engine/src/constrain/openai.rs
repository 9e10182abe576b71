//! The request fields that ask for a constrained answer, as OpenAI's API spells them
//! (`response_format`), plus this engine's extensions for a regex or a Lark grammar:
//!
//! - `{"type": "text"}`: no constraint (OpenAI's default);
//! - `{"type": "json_object"}`: any JSON object;
//! - `{"type": "json_schema", "json_schema": {"name": …, "schema": {…}, "strict": true}}`;
//! - `{"type": "regex", "regex": "…"}` and `{"type": "grammar", "grammar": "…"}` (Lark,
//!   llguidance's dialect): extensions.
//!
//! Every grammar is compiled here (over single bytes) so that an invalid one is refused with
//! the grammar engine's reason before the request is queued.

use serde_json::Value;

use super::Grammar;

/// A refusal: the field and why.
pub type Refusal = (&'static str, String);

fn text<'v>(o: &'v serde_json::Map<String, Value>, key: &str) -> Result<&'v str, Refusal> {
    o.get(key).and_then(Value::as_str).ok_or_else(|| {
        (
            "response_format",
            format!("response_format of this type needs a string '{key}'"),
        )
    })
}

/// The grammar `response_format` asks for (None: absent or `text`).
pub fn response_format(v: Option<&Value>) -> Result<Option<Grammar>, Refusal> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let bad = |m: &str| ("response_format", m.to_owned());
    let o = v
        .as_object()
        .ok_or_else(|| bad("response_format must be an object"))?;
    let grammar = match o.get("type").and_then(Value::as_str) {
        Some("text") => return Ok(None),
        Some("json_object") => Grammar::JsonObject,
        Some("json_schema") => {
            let js = o
                .get("json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| bad("response_format json_schema needs a 'json_schema' object"))?;
            match js.get("schema") {
                Some(s @ (Value::Object(_) | Value::Bool(_))) => Grammar::JsonSchema(s.clone()),
                None => Grammar::JsonObject,
                Some(_) => return Err(bad("json_schema.schema must be a JSON Schema object")),
            }
        }
        Some("regex") => Grammar::Regex(text(o, "regex")?.to_owned()),
        Some("grammar") => Grammar::Lark(text(o, "grammar")?.to_owned()),
        _ => {
            return Err(bad(
                "response_format type must be one of text, json_object, json_schema, \
                 regex, grammar",
            ))
        }
    };
    grammar
        .check()
        .map_err(|e| ("response_format", format!("invalid grammar: {e}")))?;
    Ok(Some(grammar))
}
