//! mlx-lm 0.32.2's `glm47` tool parser (GLM-4.5 … 4.7; also `laguna`):
//! `NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>…`, each value read as JSON or
//! a Python literal unless the tool's schema declares it a string; where the text has no
//! `<arg_key>`, a JSON call object, then `NAME {json}` / `NAME key=value …` / a bare name.

use serde_json::Value;

use super::super::value::{loads, PyValue, ValueError};
use super::pyish::{deserialize, py_str, py_strip, shlex_split, tag_pairs, PairTags};
use super::{call, py_truthy, Parser};

/// The `glm47` format.
pub struct Glm47;

const TAGS: PairTags = PairTags {
    key: ("<arg_key>", "</arg_key>"),
    value: ("<arg_value>", "</arg_value>"),
};

impl Parser for Glm47 {
    fn parse(&self, text: &str, tools: Option<&Value>) -> Result<Vec<PyValue>, ValueError> {
        Ok(vec![glm47(text, tools)])
    }
}

fn glm47(text: &str, tools: Option<&Value>) -> PyValue {
    let Some(at) = text.find(TAGS.key.0) else {
        return json_call(text, tools)
            .or_else(|| plain_call(text, tools))
            .unwrap_or_else(|| {
                let raw = PyValue::str(py_strip(text));
                call("unknown", PyValue::Dict(vec![(PyValue::str("raw"), raw)]))
            });
    };
    let name = py_strip(&text[..at]);
    let strings = string_args(name, tools);
    let mut args = Vec::new();
    for (key, value) in tag_pairs(text, &TAGS) {
        let (key, value) = (py_strip(key), py_strip(value));
        let planted = crate::plant::is(crate::plant::Defect::Glm47StringArgsDeserialized);
        let v = if strings.contains(&key) && !planted {
            PyValue::str(value)
        } else {
            deserialize(value)
        };
        PyValue::dict_set(&mut args, PyValue::str(key), v);
    }
    call(name, PyValue::Dict(args))
}

/// `_get_string_arg_names`: the parameters the named tool's schema types as "string".
fn string_args<'t>(name: &str, tools: Option<&'t Value>) -> Vec<&'t str> {
    let Some(tools) = tools.and_then(Value::as_array) else {
        return Vec::new();
    };
    for tool in tools {
        let Some(function) = tool.get("function").filter(|f| py_truthy(f)) else {
            continue;
        };
        if function.get("name").and_then(Value::as_str) != Some(name) {
            continue;
        }
        let truthy = |v: Option<&'t Value>| v.filter(|v| py_truthy(v));
        let properties = truthy(function.get("parameters"))
            .and_then(|p| truthy(p.get("properties")))
            .and_then(Value::as_object);
        return properties
            .into_iter()
            .flatten()
            .filter(|(_, schema)| schema.get("type").and_then(Value::as_str) == Some("string"))
            .map(|(k, _)| k.as_str())
            .collect();
    }
    Vec::new()
}

/// `_normalize_arguments`: declared strings made strings (`str(x)`), other string values
/// deserialized.
fn normalize(name: &str, args: Vec<(PyValue, PyValue)>, tools: Option<&Value>) -> PyValue {
    let strings = string_args(name, tools);
    let items = args
        .into_iter()
        .map(|(k, v)| {
            let declared = matches!(&k, PyValue::Str(s) if strings.contains(&s.as_str()));
            let v = match v {
                v if declared => PyValue::Str(py_str(&v)),
                PyValue::Str(s) => deserialize(&s),
                v => v,
            };
            (k, v)
        })
        .collect();
    PyValue::Dict(items)
}

/// `_parse_json_tool_call`: `{"name", "arguments"}`, `{"function", "arguments"}` or
/// `{"tool": {…}}` (the first of a list), the name possibly an object holding both.
fn json_call(text: &str, tools: Option<&Value>) -> Option<PyValue> {
    let mut parsed = loads(py_strip(text), true).ok()?;
    if let PyValue::List(items) = &parsed {
        if let Some(first @ PyValue::Dict(_)) = items.first() {
            parsed = first.clone();
        }
    }
    if !matches!(parsed, PyValue::Dict(_)) {
        return None;
    }
    let has = |k: &str| parsed.get(k).is_some();
    let field = |v: Option<&PyValue>| v.cloned().unwrap_or(PyValue::None);
    let (mut name, mut arguments) = if has("name") && has("arguments") {
        (field(parsed.get("name")), field(parsed.get("arguments")))
    } else if has("function") && has("arguments") {
        (
            field(parsed.get("function")),
            field(parsed.get("arguments")),
        )
    } else if let Some(tool @ PyValue::Dict(_)) = parsed.get("tool") {
        (field(tool.get("name")), field(tool.get("arguments")))
    } else {
        (PyValue::None, PyValue::None)
    };
    if let PyValue::Dict(_) = &name {
        if !arguments.truthy() {
            arguments = field(name.get("arguments"));
        }
        name = field(name.get("name"));
    }
    if let PyValue::Str(s) = &arguments {
        arguments = deserialize(s);
    }
    let PyValue::Str(name) = name else {
        return None;
    };
    match arguments {
        PyValue::None => Some(call(&name, PyValue::Dict(Vec::new()))),
        PyValue::Dict(args) => Some(call(&name, normalize(&name, args, tools))),
        _ => None,
    }
}

/// `_parse_plain_text_tool_call`: `NAME\n{json}`, `NAME {json}`, `NAME key=value …`,
/// `NAME` alone, or `NAME` and the rest as `raw`.
fn plain_call(text: &str, tools: Option<&Value>) -> Option<PyValue> {
    let stripped = py_strip(text);
    if stripped.is_empty() {
        return None;
    }
    if let Some((first, rest)) = stripped.split_once('\n') {
        let (name, rest) = (py_strip(first), py_strip(rest));
        if !name.is_empty() && !rest.is_empty() {
            if let PyValue::Dict(args) = deserialize(rest) {
                return Some(call(name, normalize(name, args, tools)));
            }
        }
    }
    let (name, rest) = stripped.split_once(' ').unwrap_or((stripped, ""));
    let rest = py_strip(rest);
    if rest.is_empty() {
        return Some(call(name, PyValue::Dict(Vec::new())));
    }
    if let PyValue::Dict(args) = deserialize(rest) {
        return Some(call(name, normalize(name, args, tools)));
    }
    let args = key_values(rest, name, tools)
        .unwrap_or_else(|| vec![(PyValue::str("raw"), PyValue::str(rest))]);
    Some(call(name, PyValue::Dict(args)))
}

/// `_parse_key_value_pairs`: shell-quoted `key=value` tokens, every one of them.
fn key_values(text: &str, name: &str, tools: Option<&Value>) -> Option<Vec<(PyValue, PyValue)>> {
    if !text.contains('=') {
        return None;
    }
    let tokens = shlex_split(text).filter(|t| !t.is_empty())?;
    let strings = string_args(name, tools);
    let mut args = Vec::new();
    for token in &tokens {
        let (key, value) = token.split_once('=')?;
        let key = py_strip(key);
        if key.is_empty() {
            return None;
        }
        let v = if strings.contains(&key) {
            PyValue::str(value)
        } else {
            deserialize(value)
        };
        PyValue::dict_set(&mut args, PyValue::str(key), v);
    }
    Some(args)
}
