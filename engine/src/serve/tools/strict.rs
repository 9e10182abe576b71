//! Strict tools (`{"type": "function", "function": {"name", "parameters", "strict": true}}`):
//! the model's tool calls are constrained to the tools' JSON schemas by one Lark grammar
//! (llguidance's dialect) that travels in the request's `constraint`, the field
//! `response_format` uses, so both server lanes mask the same way.
//!
//! The mask is lazy: free text (reasoning included) is any text, and the grammar's text
//! lexeme is a lazy one that ends at the first tool-call opener, so the moment the model
//! writes `<tool_call>` the call is constrained to `{"name": <a tool's name>, "arguments":
//! <that tool's schema>}` (whitespace around it, `, ` or `,` and `: ` or `:` between
//! items) up to the closer; after it the text is free again (more calls, or the end).
//! With `tool_choice` "required" or a named function the answer starts with a call (after
//! the reasoning block where the model reasons). A non-strict tool next to strict ones keeps
//! its name and any JSON object for arguments. Only the `json_tools` format (Qwen-style
//! JSON in `<tool_call>`) has a grammar; strict tools on other formats are refused.

use serde_json::{json, Map, Value};

use super::machine::State;
use super::{Family, Markers};
use crate::constrain::Grammar;
use crate::plant::{self, Defect};
use crate::serve::error::ApiError;

/// What `tool_choice` asks for once a tool is strict.
#[derive(Debug, Clone, PartialEq)]
enum Choice {
    /// "auto" (or absent): text or calls, the model decides.
    Auto,
    /// "required" (None) or one named function: the answer starts with a call.
    Required(Option<String>),
}

/// One tool: its name, and the schema its arguments must match (None: not strict).
struct Tool {
    name: String,
    schema: Option<Value>,
}

/// The grammar a chat request's strict tools ask for (None: no tool is strict, or
/// `tool_choice` is "none"), checked to compile; refusals name the field.
pub fn grammar(
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
    markers: &Markers,
    prompt: &[u32],
) -> Result<Option<Grammar>, ApiError> {
    let Some(list) = tools.and_then(Value::as_array) else {
        return Ok(None);
    };
    let tools = read_tools(list)?;
    if tools.iter().all(|t| t.schema.is_none()) {
        return Ok(None);
    }
    let Some(choice) = read_choice(tool_choice, &tools)? else {
        return Ok(None);
    };
    match markers.tools {
        Some(Family::JsonTools) => {}
        Some(f) => {
            return Err(ApiError::field(
                "tools",
                format!(
                    "strict tools are constrained only in the json_tools tool-call format; \
                     this model's format is {}: drop `strict` or send the tools without it",
                    f.name()
                ),
            ))
        }
        None => {
            return Err(ApiError::field(
                "tools",
                "strict tools need a tool-call format, and this model's chat template has \
                 none this engine knows",
            ))
        }
    }
    if plant::is(Defect::StrictToolsUnconstrained) {
        return Ok(None);
    }
    let opened = markers.initial_state(prompt) == State::Reasoning;
    let text = lark(&tools, &choice, markers, opened);
    let grammar = Grammar::Lark(text);
    grammar.check().map_err(|e| {
        // Named by the first strict tool whose schema alone is refused, where one is.
        let alone = tools.iter().enumerate().find_map(|(i, t)| {
            let schema = t.schema.as_ref()?;
            let why = Grammar::JsonSchema(schema.clone()).check().err()?;
            Some((format!("tools[{i}].function.parameters"), why))
        });
        let (param, why) = alone.unwrap_or_else(|| ("tools".to_owned(), e));
        ApiError::field(&param, format!("a strict tool's schema: {why}"))
    })?;
    Ok(Some(grammar))
}

/// `req` with its strict tools' grammar as its constraint (`prompt`: its ids, which tell
/// whether the template opened a reasoning block). Strict tools and `response_format`
/// cannot both constrain one answer: refused.
pub fn apply(
    mut req: crate::serve::request::GenRequest,
    prompt: &[u32],
    markers: &Markers,
) -> Result<crate::serve::request::GenRequest, ApiError> {
    let crate::serve::request::Prompt::Chat(chat) = &req.prompt else {
        return Ok(req);
    };
    let Some(g) = grammar(
        chat.tools.as_ref(),
        chat.tool_choice.as_ref(),
        markers,
        prompt,
    )?
    else {
        return Ok(req);
    };
    if req.constraint.is_some() {
        return Err(ApiError::field(
            "response_format",
            "response_format and strict tools both constrain the answer: send one of them",
        ));
    }
    req.constraint = Some(g);
    Ok(req)
}

fn read_tools(list: &[Value]) -> Result<Vec<Tool>, ApiError> {
    list.iter()
        .enumerate()
        .map(|(i, tool)| {
            // request::tools checked the shape: an object with a named function.
            let f = tool.get("function").and_then(Value::as_object);
            let name = f
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            let strict = match f.and_then(|f| f.get("strict")) {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(ApiError::field(
                        &format!("tools[{i}].function.strict"),
                        "strict must be a boolean",
                    ))
                }
            };
            let schema = strict.then(|| match f.and_then(|f| f.get("parameters")) {
                Some(p @ Value::Object(_)) => p.clone(),
                _ => json!({"type": "object", "properties": {}, "additionalProperties": false}),
            });
            Ok(Tool { name, schema })
        })
        .collect()
}

/// `tool_choice` with strict tools (None: "none", no constraint).
fn read_choice(v: Option<&Value>, tools: &[Tool]) -> Result<Option<Choice>, ApiError> {
    let bad = |m: String| ApiError::field("tool_choice", m);
    let name = match v {
        None | Some(Value::Null) => return Ok(Some(Choice::Auto)),
        Some(Value::String(s)) => {
            return match s.as_str() {
                "auto" => Ok(Some(Choice::Auto)),
                "none" => Ok(None),
                "required" => Ok(Some(Choice::Required(None))),
                _ => Err(bad(
                    "tool_choice must be \"auto\", \"none\", \"required\" or an object".into(),
                )),
            };
        }
        Some(Value::Object(o)) => o
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .filter(|_| o.get("type").and_then(Value::as_str) == Some("function")),
        Some(_) => None,
    };
    let name = name.ok_or_else(|| {
        bad(
            "with strict tools, a tool_choice object must be {\"type\": \"function\", \
             \"function\": {\"name\": …}}"
                .into(),
        )
    })?;
    if !tools.iter().any(|t| t.name == name) {
        return Err(bad(format!(
            "tool_choice names the function `{name}`, which is not among the tools"
        )));
    }
    Ok(Some(Choice::Required(Some(name.to_owned()))))
}

/// `s` as a Lark string literal (JSON's escapes are Lark's).
fn literal(s: &str) -> String {
    Value::from(s).to_string()
}

/// `s` matched literally inside a Lark `/regex/`.
fn regex_literal(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if "\\.+*?()|[]{}^$/-".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The schema one call must match: `{"name": NAME, "arguments": SCHEMA}`, in that order,
/// no other keys; the arguments schema's `$defs`/`definitions` lifted to the call's root
/// (where its `#/$defs/…` references point), its other local references rebased.
fn call_schema(tool: &Tool) -> Value {
    let mut args = tool
        .schema
        .clone()
        .unwrap_or_else(|| json!({"type": "object"}));
    let mut root = Map::new();
    if let Some(o) = args.as_object_mut() {
        for key in ["$defs", "definitions"] {
            if let Some(d) = o.remove(key) {
                root.insert(key.into(), d);
            }
        }
        o.remove("x-guidance");
    }
    rebase_refs(&mut args);
    root.insert("type".into(), json!("object"));
    root.insert(
        "properties".into(),
        json!({"name": {"const": tool.name}, "arguments": args}),
    );
    root.insert("required".into(), json!(["name", "arguments"]));
    root.insert("additionalProperties".into(), json!(false));
    root.insert(
        "x-guidance".into(),
        json!({"whitespace_flexible": false, "item_separator": ", ?", "key_separator": ": ?"}),
    );
    Value::Object(root)
}

/// Local `$ref`s other than into `$defs`/`definitions` ("#", "#/properties/…") point into
/// the arguments schema, which now sits at `#/properties/arguments`.
fn rebase_refs(v: &mut Value) {
    match v {
        Value::Object(o) => {
            for (k, x) in o.iter_mut() {
                match x {
                    Value::String(r) if k == "$ref" => {
                        let lifted = r.starts_with("#/$defs") || r.starts_with("#/definitions");
                        if let Some(rest) = r.strip_prefix('#').filter(|_| !lifted) {
                            *r = format!("#/properties/arguments{rest}");
                        }
                    }
                    _ => rebase_refs(x),
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(rebase_refs),
        _ => {}
    }
}

/// The Lark grammar: free text with lazy triggers, calls constrained between the markers.
fn lark(tools: &[Tool], choice: &Choice, markers: &Markers, opened: bool) -> String {
    let (open, close) = Family::JsonTools.markers();
    let allowed: Vec<&Tool> = match choice {
        Choice::Required(Some(name)) => tools.iter().filter(|t| &t.name == name).collect(),
        _ => tools.iter().collect(),
    };
    let mut g = String::new();
    match choice {
        Choice::Auto => g.push_str("start: (head call)* tail?\n"),
        Choice::Required(_) => {
            g.push_str("start: first call (head call)* tail?\n");
            g.push_str(&first_rule(markers, opened, open));
        }
    }
    g.push_str(&format!("head[lazy]: /(.|\\n)*{}/\n", regex_literal(open)));
    g.push_str("tail: /(.|\\n)+/\n");
    let names: Vec<String> = (0..allowed.len()).map(|i| format!("c{i}")).collect();
    g.push_str(&format!(
        "call: WS? ({}) WS? {}\n",
        names.join(" | "),
        literal(close)
    ));
    for (i, t) in allowed.iter().enumerate() {
        g.push_str(&format!("c{i}: %json{}\n", call_schema(t)));
    }
    g.push_str("WS: /[ \\t\\r\\n]+/\n");
    g
}

/// A required call's lead-in: whitespace, or a reasoning block first where the model
/// reasons (already open when the prompt opened it; a call may also come straight out of
/// reasoning, as the text machine allows).
fn first_rule(markers: &Markers, opened: bool, open: &str) -> String {
    let open_lit = literal(open);
    match &markers.thinking {
        Some(t) if opened => format!(
            "first: think WS? {open_lit} | head\nthink[lazy]: /(.|\\n)*{}/\n",
            regex_literal(&t.end)
        ),
        Some(t) => format!(
            "first: WS? {open_lit} | {} think WS? {open_lit}\nthink[lazy]: /(.|\\n)*{}/\n",
            literal(&t.start),
            regex_literal(&t.end)
        ),
        None => format!("first: WS? {open_lit}\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn markers(thinking: bool) -> Markers {
        Markers {
            thinking: thinking.then(|| super::super::Thinking {
                start: "<think>".into(),
                end: "</think>".into(),
                start_ids: vec![1],
                end_ids: vec![2],
            }),
            tools: Some(Family::JsonTools),
            structural: Vec::new(),
        }
    }

    fn tools(strict: bool) -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "strict": strict,
            "parameters": {"type": "object", "properties": {"city": {"$ref": "#/$defs/city"},
            "days": {"type": "integer"}}, "required": ["city", "days"],
            "additionalProperties": false, "$defs": {"city": {"enum": ["Oslo", "Lima"]}}}}},
            {"type": "function", "function": {"name": "other"}}])
    }

    #[test]
    fn non_strict_tools_and_choice_none_ask_for_nothing() {
        let m = markers(true);
        assert_eq!(grammar(Some(&tools(false)), None, &m, &[]).unwrap(), None);
        let none = json!("none");
        assert_eq!(
            grammar(Some(&tools(true)), Some(&none), &m, &[]).unwrap(),
            None
        );
    }

    #[test]
    fn every_choice_and_thinking_state_compiles() {
        for choice in [
            None,
            Some(json!("auto")),
            Some(json!("required")),
            Some(json!({"type": "function", "function": {"name": "other"}})),
        ] {
            for (thinking, prompt) in [(false, vec![]), (true, vec![1]), (true, vec![1, 2])] {
                let g = grammar(
                    Some(&tools(true)),
                    choice.as_ref(),
                    &markers(thinking),
                    &prompt,
                );
                assert!(matches!(g, Ok(Some(Grammar::Lark(_)))), "{choice:?}: {g:?}");
            }
        }
    }

    #[test]
    fn bad_values_and_formats_without_a_grammar_are_refused() {
        let m = markers(false);
        let mut t = tools(true);
        t[0]["function"]["strict"] = json!("yes");
        let e = grammar(Some(&t), None, &m, &[]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].function.strict"));
        let unknown = json!({"type": "function", "function": {"name": "nope"}});
        let e = grammar(Some(&tools(true)), Some(&unknown), &m, &[]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        let mut mistral = m.clone();
        mistral.tools = Some(Family::Mistral);
        let e = grammar(Some(&tools(true)), None, &mistral, &[]).unwrap_err();
        assert!(e.message.contains("mistral"), "{}", e.message);
        let mut bad = tools(true);
        bad[0]["function"]["parameters"] = json!({"type": "object", "minProperties": "x"});
        assert!(grammar(Some(&bad), None, &m, &[]).is_err());
    }

    #[test]
    fn references_are_lifted_or_rebased() {
        let t = Tool {
            name: "f".into(),
            schema: Some(
                json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"},
                "b": {"$ref": "#/properties/a"}}, "$defs": {"x": {"type": "integer"}}}),
            ),
        };
        let s = call_schema(&t);
        assert_eq!(s["$defs"], json!({"x": {"type": "integer"}}));
        let args = &s["properties"]["arguments"];
        assert_eq!(args["properties"]["a"]["$ref"], json!("#/$defs/x"));
        assert_eq!(
            args["properties"]["b"]["$ref"],
            json!("#/properties/arguments/properties/a")
        );
    }
}
