//! Python's view of template values: `json.dumps` as transformers' `tojson` filter calls it
//! (`ensure_ascii`, `indent`, `separators`, `sort_keys`; no HTML escaping), and `str()` /
//! `repr()` of the values a template prints (`True`, `None`, `['a', 1.5]`, `{'k': 'v'}`).

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

use crate::plant::{self, Defect};
pub use crate::pyfmt::DumpOptions;
use crate::pyfmt::{float_repr, json_float, json_string};

fn invalid(message: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, message.into())
}

/// A Python int or str `indent` (json.dumps takes either; None is one line).
fn indent_of(value: Value) -> Result<Option<String>, Error> {
    if value.is_none() || value.is_undefined() {
        return Ok(None);
    }
    if let Some(s) = value.as_str() {
        return Ok(Some(s.to_owned()));
    }
    match value.as_i64() {
        Some(n) => Ok(Some(" ".repeat(n.max(0) as usize))),
        None => Err(invalid(format!(
            "tojson: indent must be an int or a str, not {value}"
        ))),
    }
}

fn separators_of(value: Value) -> Result<Option<(String, String)>, Error> {
    if value.is_none() || value.is_undefined() {
        return Ok(None);
    }
    let parts: Vec<Value> = value.try_iter()?.collect();
    match parts.as_slice() {
        [item, key] => match (item.as_str(), key.as_str()) {
            (Some(i), Some(k)) => Ok(Some((i.to_owned(), k.to_owned()))),
            _ => Err(invalid("tojson: separators must be two strings")),
        },
        _ => Err(invalid("tojson: separators must be an (item, key) pair")),
    }
}

/// The `tojson` filter: `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, positional or by keyword, as transformers defines it.
pub fn tojson_filter(value: Value, args: &[Value], kwargs: Kwargs) -> Result<Value, Error> {
    let mut slots: [Option<Value>; 4] = Default::default();
    if args.len() > slots.len() {
        return Err(invalid(
            "tojson takes at most 4 arguments besides the value",
        ));
    }
    for (slot, arg) in slots.iter_mut().zip(args) {
        *slot = Some(arg.clone());
    }
    for (i, name) in ["ensure_ascii", "indent", "separators", "sort_keys"]
        .iter()
        .enumerate()
    {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            if slots[i].is_some() {
                return Err(invalid(format!("tojson got multiple values for '{name}'")));
            }
            slots[i] = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = slots;
    let options = DumpOptions {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        indent: indent.map(indent_of).transpose()?.flatten(),
        separators: separators.map(separators_of).transpose()?.flatten(),
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
    };
    let mut out = String::new();
    dump(&value, &options, 0, &mut out)?;
    if plant::is(Defect::TemplateTojsonEscapesHtml) {
        // Jinja's own tojson (htmlsafe_json_dumps), which transformers replaces.
        out = out
            .replace('<', "\\u003c")
            .replace('>', "\\u003e")
            .replace('&', "\\u0026")
            .replace('\'', "\\u0027");
    }
    Ok(Value::from(out))
}

/// `json.dumps(value, ...)` of a template value.
pub fn dumps(value: &Value, options: &DumpOptions) -> Result<String, Error> {
    let mut out = String::new();
    dump(value, options, 0, &mut out)?;
    Ok(out)
}

fn dump(value: &Value, options: &DumpOptions, level: usize, out: &mut String) -> Result<(), Error> {
    let (item_sep, key_sep) = options.separators();
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&number_repr(value, true)),
        ValueKind::String => json_string(value.as_str().unwrap_or(""), options.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                options.newline(level + 1, out);
                dump(item, options, level + 1, out)?;
            }
            options.newline(level, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if options.sort_keys {
                keys.sort_by_key(key_string);
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                options.newline(level + 1, out);
                json_string(&key_string(key), options.ensure_ascii, out);
                out.push_str(key_sep);
                dump(&value.get_item(key)?, options, level + 1, out)?;
            }
            options.newline(level, out);
            out.push('}');
        }
        _ => {
            return Err(invalid(format!(
                "Object of type {} is not JSON serializable",
                python_type(value)
            )))
        }
    }
    Ok(())
}

/// A dict key as json.dumps writes it: strings as they are, True/False/None and numbers as
/// their JSON text.
fn key_string(key: &Value) -> String {
    match key.kind() {
        ValueKind::String => key.as_str().unwrap_or("").to_owned(),
        ValueKind::None => "null".to_owned(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_owned(),
        ValueKind::Number => number_repr(key, true),
        _ => key.to_string(),
    }
}

fn python_type(value: &Value) -> &'static str {
    match value.kind() {
        ValueKind::Undefined => "Undefined",
        ValueKind::Bytes => "bytes",
        ValueKind::Plain => "object",
        _ => "object",
    }
}

fn number_repr(value: &Value, json: bool) -> String {
    if value.is_integer() {
        return i128::try_from(value.clone())
            .map(|n| n.to_string())
            .unwrap_or_else(|_| value.to_string());
    }
    f64::try_from(value.clone())
        .map(|x| if json { json_float(x) } else { float_repr(x) })
        .unwrap_or_else(|_| value.to_string())
}

/// `repr(str)`: single quotes unless the text has a single quote and no double quote.
fn string_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..=0xa0).contains(&(c as u32)) => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// `repr()` of a value inside a list or dict.
fn repr(value: &Value, out: &mut String) -> Result<(), Error> {
    match value.kind() {
        ValueKind::String => string_repr(value.as_str().unwrap_or(""), out),
        ValueKind::Seq => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                repr(&item, out)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                repr(&key, out)?;
                out.push_str(": ");
                repr(&value.get_item(&key)?, out)?;
            }
            out.push('}');
        }
        ValueKind::Undefined => out.push_str("Undefined"),
        _ => out.push_str(&python_str(value)?),
    }
    Ok(())
}

/// `str()` of a value as Jinja prints it (`{{ x }}`, `x | string`): strings as they are,
/// `True`/`False`/`None`, Python number reprs, lists and dicts as their repr.
pub fn python_str(value: &Value) -> Result<String, Error> {
    Ok(match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".to_owned(),
        ValueKind::Bool => (if value.is_true() { "True" } else { "False" }).to_owned(),
        ValueKind::Number => number_repr(value, false),
        ValueKind::String => value.as_str().unwrap_or("").to_owned(),
        ValueKind::Seq | ValueKind::Map => {
            let mut out = String::new();
            repr(value, &mut out)?;
            out
        }
        _ => value.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(v: serde_json::Value, options: &DumpOptions) -> String {
        dumps(&Value::from_serialize(&v), options).unwrap()
    }

    #[test]
    fn dumps_matches_python_json_dumps() {
        let v = serde_json::json!({"b": 1, "a": [true, null, 2.0, "é <&> \"q\"\n\u{1}"], "c": {}});
        let d = DumpOptions::default();
        assert_eq!(
            json(v.clone(), &d),
            r#"{"b": 1, "a": [true, null, 2.0, "é <&> \"q\"\n\u0001"], "c": {}}"#
        );
        let sorted = DumpOptions {
            sort_keys: true,
            ..d.clone()
        };
        assert!(json(v.clone(), &sorted).starts_with(r#"{"a": ["#));
        let indented = DumpOptions {
            indent: Some("  ".into()),
            ..d.clone()
        };
        assert_eq!(
            json(serde_json::json!({"a": [1, []], "b": "x"}), &indented),
            "{\n  \"a\": [\n    1,\n    []\n  ],\n  \"b\": \"x\"\n}"
        );
        let compact = DumpOptions {
            separators: Some((",".into(), ":".into())),
            ..d.clone()
        };
        assert_eq!(
            json(serde_json::json!({"a": [1, 2]}), &compact),
            r#"{"a":[1,2]}"#
        );
        let ascii = DumpOptions {
            ensure_ascii: true,
            ..d
        };
        assert_eq!(
            json(serde_json::json!("é😀\u{7f}"), &ascii),
            r#""\u00e9\ud83d\ude00\u007f""#
        );
    }

    #[test]
    fn str_is_python_str() {
        let v = Value::from_serialize(serde_json::json!([1, "it's", true, null, {"k": 1.5}]));
        assert_eq!(
            python_str(&v).unwrap(),
            r#"[1, "it's", True, None, {'k': 1.5}]"#
        );
        assert_eq!(python_str(&Value::from(false)).unwrap(), "False");
    }
}
