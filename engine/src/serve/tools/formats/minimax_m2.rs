//! mlx-lm 0.32.2's `minimax_m2` tool parser (MiniMax M2): `<invoke name="NAME">` blocks
//! of `<parameter name="KEY">VALUE</parameter>`, each value converted by the types its
//! tool's schema allows (`type`, type lists, `enum` values, `anyOf` / `oneOf` / `allOf`),
//! tried integer, number, boolean, object / array, string; untyped ones are strings.

use std::collections::HashMap;

use serde_json::Value;

use super::super::literal::literal_eval;
use super::super::value::{err, loads, PyValue, ValueError};
use super::pyish::{py_int, py_strip};
use super::{call, py_float, py_truthy, run, Parser};

/// The `minimax_m2` format.
pub struct MinimaxM2;

impl Parser for MinimaxM2 {
    fn parse(&self, text: &str, tools: Option<&Value>) -> Result<Vec<PyValue>, ValueError> {
        let invokes = blocks(text, "<invoke name=", "</invoke>");
        if invokes.is_empty() {
            return err("No tool call found");
        }
        let config = param_configs(tools);
        let mut calls = Vec::new();
        for invoke in invokes {
            let n = run(invoke, |c| c != '>');
            if n == 0 {
                continue;
            }
            let name = extract_name(&invoke[..n]);
            let properties = config.get(name).copied().flatten();
            let mut args = Vec::new();
            for param in blocks(invoke, "<parameter name=", "</parameter>") {
                let n = run(param, |c| c != '>');
                if n == 0 || n == param.len() {
                    continue;
                }
                let key = extract_name(&param[..n]);
                let value = py_strip(&param[n + 1..]);
                let types = match properties.and_then(|p| p.get(key)) {
                    Some(schema) => schema_types(Some(schema)),
                    None => vec!["string".to_owned()],
                };
                let v = convert(value, &types)?;
                PyValue::dict_set(&mut args, PyValue::str(key), v);
            }
            calls.push(call(name, PyValue::Dict(args)));
        }
        Ok(calls)
    }
}

/// `OPEN(.*?)CLOSE`, every match's group.
fn blocks<'t>(text: &'t str, open: &str, close: &str) -> Vec<&'t str> {
    let mut out = Vec::new();
    let mut pos = 0;
    while let Some(o) = text[pos..].find(open) {
        let start = pos + o + open.len();
        let Some(c) = text[start..].find(close) else {
            break;
        };
        out.push(&text[start..start + c]);
        pos = start + c + close.len();
    }
    out
}

/// `_extract_name`: stripped, and one pair of surrounding quotes taken off.
fn extract_name(s: &str) -> &str {
    let s = py_strip(s);
    let quoted = |q: char| s.starts_with(q) && s.ends_with(q);
    if quoted('"') || quoted('\'') {
        // A lone quote starts and ends the text: nothing is left.
        s.get(1..s.len().saturating_sub(1)).unwrap_or("")
    } else {
        s
    }
}

/// Each tool's `parameters.properties`, by name (a later tool of the same name wins; None
/// where they are not an object).
fn param_configs(tools: Option<&Value>) -> HashMap<&str, Option<&serde_json::Map<String, Value>>> {
    let mut out = HashMap::new();
    for tool in tools.and_then(Value::as_array).into_iter().flatten() {
        let Some(function) = tool.get("function").filter(|f| py_truthy(f)) else {
            continue;
        };
        let Some(params) = function.get("parameters").filter(|p| py_truthy(p)) else {
            continue;
        };
        if let Some(name) = function.get("name").and_then(Value::as_str) {
            out.insert(name, params.get("properties").and_then(Value::as_object));
        }
    }
    out
}

/// `_extract_types_from_schema`: every type a schema allows ("string" where it names none).
fn schema_types(schema: Option<&Value>) -> Vec<String> {
    let Some(Value::Object(schema)) = schema else {
        return vec!["string".to_owned()];
    };
    let mut types: Vec<String> = Vec::new();
    let mut add = |t: &str| {
        if !types.iter().any(|x| x == t) {
            types.push(t.to_owned());
        }
    };
    match schema.get("type") {
        Some(Value::String(t)) => add(t),
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).for_each(&mut add),
        _ => {}
    }
    if let Some(Value::Array(values)) = schema.get("enum") {
        for v in values {
            add(match v {
                Value::Null => "null",
                Value::Bool(_) => "boolean",
                Value::Number(n) if n.is_f64() => "number",
                Value::Number(_) => "integer",
                Value::String(_) => "string",
                Value::Array(_) => "array",
                Value::Object(_) => "object",
            });
        }
    }
    for field in ["anyOf", "oneOf", "allOf"] {
        if let Some(Value::Array(choices)) = schema.get(field) {
            for choice in choices {
                schema_types(Some(choice)).iter().for_each(|t| add(t));
            }
        }
    }
    if types.is_empty() {
        types.push("string".to_owned());
    }
    types
}

const PRIORITY: [&str; 11] = [
    "integer", "int", "number", "float", "boolean", "bool", "object", "array", "string", "str",
    "text",
];

/// `_convert_param_value_with_types`: the first of the allowed types (in `PRIORITY`'s
/// order) the text converts to; else JSON, else the text.
fn convert(value: &str, types: &[String]) -> Result<PyValue, ValueError> {
    let lower = value.to_lowercase();
    if lower == "null" {
        return Ok(PyValue::None);
    }
    let types: Vec<String> = types.iter().map(|t| t.to_lowercase()).collect();
    let allows = |t: &str| types.iter().any(|x| x == t);
    if allows("null") && ["none", "nil"].contains(&lower.as_str()) {
        return Ok(PyValue::None);
    }
    for ty in PRIORITY.into_iter().filter(|t| allows(t)) {
        match ty {
            "string" | "str" | "text" => return Ok(PyValue::str(value)),
            "integer" | "int" => {
                if let Some(i) = py_int(value) {
                    return Ok(i);
                }
            }
            "number" | "float" => {
                if let Some(v) = number(value)? {
                    return Ok(v);
                }
            }
            "boolean" | "bool" => match py_strip(&lower) {
                "true" | "1" | "yes" | "on" => return Ok(PyValue::Bool(true)),
                "false" | "0" | "no" | "off" => return Ok(PyValue::Bool(false)),
                _ => {}
            },
            _ => {
                if let Ok(v) = loads(value, false).or_else(|_| literal_eval(value)) {
                    return Ok(v);
                }
            }
        }
    }
    Ok(loads(value, true).unwrap_or_else(|_| PyValue::str(value)))
}

/// `float(value)`, an integer where it is whole: None where Python's ValueError sends the
/// conversion on to the next type (not a number, NaN); an error where it raises
/// OverflowError (infinity), which mlx-lm does not catch.
fn number(value: &str) -> Result<Option<PyValue>, ValueError> {
    let Ok(x) = py_float(value) else {
        return Ok(None);
    };
    if x.is_nan() {
        return Ok(None);
    }
    if x.is_infinite() {
        return err("cannot convert float infinity to integer");
    }
    let whole =
        x.fract() == 0.0 && !crate::plant::is(crate::plant::Defect::MinimaxWholeNumbersFloat);
    Ok(Some(if whole && x.abs() < 1.7e38 {
        PyValue::Int(x as i128)
    } else if whole {
        PyValue::BigInt(format!("{x:.0}"))
    } else {
        PyValue::Float(x)
    }))
}
