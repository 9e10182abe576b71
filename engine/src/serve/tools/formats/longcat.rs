//! mlx-lm 0.32.2's `longcat` tool parser (LongCat):
//! `NAME<longcat_arg_key>KEY</longcat_arg_key><longcat_arg_value>VALUE…`, each value read
//! as JSON or a Python literal unless the tool's schema types it "string"; a text that is a
//! JSON object is taken whole.

use serde_json::Value;

use super::super::value::{err, loads, PyValue, ValueError};
use super::pyish::{deserialize, py_strip, tag_pairs, PairTags};
use super::{call, Parser};

/// The `longcat` format.
pub struct Longcat;

const TAGS: PairTags = PairTags {
    key: ("<longcat_arg_key>", "</longcat_arg_key>"),
    value: ("<longcat_arg_value>", "</longcat_arg_value>"),
};

impl Parser for Longcat {
    fn parse(&self, text: &str, tools: Option<&Value>) -> Result<Vec<PyValue>, ValueError> {
        let text = py_strip(text);
        if text.starts_with('{') && !crate::plant::is(crate::plant::Defect::LongcatJsonIgnored) {
            if let Ok(v) = loads(text, true) {
                return Ok(vec![v]);
            }
        }
        // mlx-lm reads `.group(1)` of a failed search here (AttributeError).
        let Some(at) = text.find(TAGS.key.0) else {
            return err("no function name before the first <longcat_arg_key>");
        };
        let name = py_strip(&text[..at]);
        let mut args = Vec::new();
        for (key, value) in tag_pairs(text, &TAGS) {
            let (key, value) = (py_strip(key), py_strip(value));
            let v = if is_string(name, key, tools)? {
                PyValue::str(value)
            } else {
                deserialize(value)
            };
            PyValue::dict_set(&mut args, PyValue::str(key), v);
        }
        Ok(vec![call(name, PyValue::Dict(args))])
    }
}

/// `_is_string_type`: the first tool of that name types the argument "string" (a tool
/// without `function`, `name` or, when it is the one, `parameters` is mlx-lm's KeyError).
fn is_string(name: &str, arg: &str, tools: Option<&Value>) -> Result<bool, ValueError> {
    let Some(tools) = tools.and_then(Value::as_array) else {
        return Ok(false);
    };
    let missing = |k: &str| ValueError(format!("a tool has no {k:?} (KeyError)"));
    for tool in tools {
        let function = tool.get("function").ok_or_else(|| missing("function"))?;
        let tool_name = function.get("name").ok_or_else(|| missing("name"))?;
        if tool_name.as_str() != Some(name) {
            continue;
        }
        let params = function
            .get("parameters")
            .ok_or_else(|| missing("parameters"))?;
        let ty = params
            .get("properties")
            .and_then(|p| p.get(arg))
            .and_then(|a| a.get("type"));
        return Ok(ty.and_then(Value::as_str) == Some("string"));
    }
    Ok(false)
}
