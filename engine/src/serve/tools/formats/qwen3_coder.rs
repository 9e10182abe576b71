//! mlx-lm 0.32.2's `qwen3_coder` tool parser (`mlx_lm/tool_parsers/qwen3_coder.py`).

use serde_json::Value;

use super::super::literal::literal_eval;
use super::super::value::{err, loads, PyValue, ValueError};
use super::{call, py_float, py_truthy, run, Parser};

/// The `qwen3_coder` format.
pub struct Qwen3Coder;

impl Parser for Qwen3Coder {
    fn parse(&self, text: &str, tools: Option<&Value>) -> Result<Vec<PyValue>, ValueError> {
        qwen3_coder(text, tools)
    }
}

/// qwen3_coder: `<function=NAME>` then `<parameter=KEY>\nVALUE\n</parameter>`s, each value
/// converted by the type its tool's schema gives it.
fn qwen3_coder(text: &str, tools: Option<&Value>) -> Result<Vec<PyValue>, ValueError> {
    // `<function=(.*?)</function>$`: from the first `<function=` to a `</function>` that
    // ends the text (or precedes its final newline).
    let body = text.strip_suffix('\n').unwrap_or(text);
    let close = "</function>";
    let found = body
        .strip_suffix(close)
        .map(|_| body.len() - close.len())
        .and_then(|end| {
            text.find("<function=")
                .filter(|&s| s + 10 <= end)
                .map(|s| (s, end))
        });
    let Some((start, end)) = found else {
        return err("No function provided.");
    };
    let inner = &text[start + 10..end];
    let (name, after) =
        qwen_name(inner).ok_or_else(|| ValueError("No function name provided.".into()))?;
    let config = qwen_arguments_config(name, tools)?;
    let mut params = Vec::new();
    let mut rest = &inner[after..];
    while let Some(open) = rest.find("<parameter=") {
        let from = &rest[open + 11..];
        let Some(close) = from.find("</parameter>") else {
            break;
        };
        let m = &from[..close];
        rest = &from[close + 12..];
        let Some((key, after)) = qwen_name(m) else {
            continue;
        };
        let mut value = &m[after..];
        value = value.strip_prefix('\n').unwrap_or(value);
        value = value.strip_suffix('\n').unwrap_or(value);
        let v = qwen_convert(value, key, config)?;
        PyValue::dict_set(&mut params, PyValue::str(key), v);
    }
    Ok(vec![call(name, PyValue::Dict(params))])
}

/// `\s*([^\s<>]+)>?` at the start of `s`: the name and where the match ends.
fn qwen_name(s: &str) -> Option<(&str, usize)> {
    let ws = run(s, char::is_whitespace);
    let n = run(&s[ws..], |c| !c.is_whitespace() && c != '<' && c != '>');
    if n == 0 {
        return None;
    }
    let end = ws + n + usize::from(s[ws + n..].starts_with('>'));
    Some((&s[ws..ws + n], end))
}

fn qwen_arguments_config<'t>(
    name: &str,
    tools: Option<&'t Value>,
) -> Result<Option<&'t serde_json::Map<String, Value>>, ValueError> {
    let Some(tools) = tools.and_then(Value::as_array) else {
        return Ok(None);
    };
    for tool in tools {
        let Some(function) = tool.get("function").filter(|f| py_truthy(f)) else {
            continue;
        };
        if function.get("name").and_then(Value::as_str) == Some(name) {
            return Ok(function
                .get("parameters")
                .filter(|p| py_truthy(p))
                .and_then(|p| p.get("properties"))
                .and_then(Value::as_object));
        }
    }
    Ok(None)
}

/// Python's `str(x)` for a schema's `type` (a list or such never matches a type name).
fn type_name(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Bool(b) => if *b { "True" } else { "False" }.to_owned(),
        Value::Null => "None".to_owned(),
        other => other.to_string(),
    }
}

fn qwen_convert(
    value: &str,
    key: &str,
    config: Option<&serde_json::Map<String, Value>>,
) -> Result<PyValue, ValueError> {
    if value.to_lowercase() == "null" {
        return Ok(PyValue::None);
    }
    let Some(param) = config.and_then(|c| c.get(key)).filter(|p| py_truthy(p)) else {
        return Ok(PyValue::str(value));
    };
    let Some(ty) = param.get("type") else {
        return Ok(match loads(value, true) {
            Ok(v @ (PyValue::Dict(_) | PyValue::List(_))) => v,
            _ => PyValue::str(value),
        });
    };
    let ty = type_name(ty).trim().to_lowercase();
    if ["string", "str", "text", "varchar", "char", "enum"].contains(&ty.as_str()) {
        return Ok(PyValue::str(value));
    }
    if ["int", "uint", "long", "short", "unsigned"]
        .iter()
        .any(|p| ty.starts_with(p))
    {
        let x = py_float(value)?;
        if !x.is_finite() {
            return err(format!("Invalid integer literal {value:?}"));
        }
        if x.fract() != 0.0 {
            return err(format!("Invalid integer literal {value:?}"));
        }
        return Ok(PyValue::Int(x as i128));
    }
    if ty.starts_with("num") || ty.starts_with("float") {
        let x = py_float(value)?;
        return Ok(if x.is_finite() && x.fract() == 0.0 {
            PyValue::Int(x as i128)
        } else {
            PyValue::Float(x)
        });
    }
    if ["boolean", "bool", "binary"].contains(&ty.as_str()) {
        return Ok(PyValue::Bool(value.to_lowercase() == "true"));
    }
    if ["object", "array", "arr"].contains(&ty.as_str())
        || ty.starts_with("dict")
        || ty.starts_with("list")
    {
        if let Ok(v) = loads(value, false) {
            return Ok(v);
        }
    }
    Ok(literal_eval(value).unwrap_or_else(|_| PyValue::str(value)))
}
