//! `json.dump(obj, f, indent=N)` of a JSON value, byte for byte as Python writes it
//! (`ensure_ascii`, `(",", ": ")` separators, float repr): what mlx_lm.convert's config and
//! index files are, and transformers' `tokenizer_config.json` (`sort_keys`, no ASCII
//! escapes).

use serde_json::Value;

use crate::pyfmt::{json_float, json_string, DumpOptions};

/// `json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)`.
pub fn dumps(value: &Value, indent: usize, ensure_ascii: bool, sort_keys: bool) -> String {
    let opts = DumpOptions {
        ensure_ascii,
        indent: Some(" ".repeat(indent)),
        separators: None,
        sort_keys,
    };
    let mut out = String::new();
    dump_into(value, &opts, 0, &mut out);
    out
}

fn dump_into(value: &Value, opts: &DumpOptions, level: usize, out: &mut String) {
    let (item_sep, key_sep) = opts.separators();
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => out.push_str(&i.to_string()),
            (None, Some(u)) => out.push_str(&u.to_string()),
            _ => out.push_str(&json_float(n.as_f64().unwrap_or(f64::NAN))),
        },
        Value::String(s) => json_string(s, opts.ensure_ascii, out),
        Value::Array(items) if items.is_empty() => out.push_str("[]"),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                opts.newline(level + 1, out);
                dump_into(item, opts, level + 1, out);
            }
            opts.newline(level, out);
            out.push(']');
        }
        Value::Object(map) if map.is_empty() => out.push_str("{}"),
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                opts.newline(level + 1, out);
                json_string(k, opts.ensure_ascii, out);
                out.push_str(key_sep);
                dump_into(v, opts, level + 1, out);
            }
            opts.newline(level, out);
            out.push('}');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_python() {
        let v: Value = serde_json::from_str(
            r#"{"b": [1, 2.0, 1e-05], "a": {"x": null, "é": "ü"}, "c": [], "d": {}}"#,
        )
        .unwrap();
        assert_eq!(
            dumps(&v, 4, true, false),
            "{\n    \"b\": [\n        1,\n        2.0,\n        1e-05\n    ],\n    \"a\": {\n        \"x\": null,\n        \"\\u00e9\": \"\\u00fc\"\n    },\n    \"c\": [],\n    \"d\": {}\n}"
        );
        assert!(dumps(&v, 2, false, true)
            .starts_with("{\n  \"a\": {\n    \"x\": null,\n    \"é\": \"ü\""));
    }
}
