//! The Python pieces the tag-style parsers (glm47, longcat, kimi_k2, minimax_m2) lean on:
//! `str.strip()`, `int(s)`, `str(x)`, `shlex.split(s)`, their shared "JSON, else a Python
//! literal, else the text" reading of a value, and the `<key>…</key>\s*<value>…</value>`
//! pairs glm47 and longcat match with a lazy regular expression.

use super::super::literal::literal_eval;
use super::super::value::{loads, PyValue};
use crate::pyfmt::float_repr;

/// Whether Python's `str.isspace()` holds for `c` (Unicode whitespace and the four
/// information separators).
pub(super) fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// `s.strip()`.
pub(super) fn py_strip(s: &str) -> &str {
    s.trim_matches(py_space)
}

/// `_deserialize`: `json.loads`, else `ast.literal_eval`, else the text itself.
pub(super) fn deserialize(value: &str) -> PyValue {
    loads(value, true)
        .or_else(|_| literal_eval(value))
        .unwrap_or_else(|_| PyValue::str(value))
}

/// `int(s)` for a decimal text: surrounding whitespace, a sign, digits with single
/// underscores between them; None where Python raises ValueError.
pub(super) fn py_int(s: &str) -> Option<PyValue> {
    let t = py_strip(s);
    let (neg, digits) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let ok = !digits.is_empty()
        && !digits.starts_with('_')
        && !digits.ends_with('_')
        && !digits.contains("__")
        && digits.chars().all(|c| c.is_ascii_digit() || c == '_');
    if !ok {
        return None;
    }
    let plain: String = digits.chars().filter(|&c| c != '_').collect();
    let plain = plain.trim_start_matches('0');
    let text = if plain.is_empty() {
        "0".to_owned()
    } else if neg {
        format!("-{plain}")
    } else {
        plain.to_owned()
    };
    Some(match text.parse::<i128>() {
        Ok(i) => PyValue::Int(i),
        Err(_) => PyValue::BigInt(text),
    })
}

/// `str(x)`: a string as it is, anything else as its `repr`.
pub(super) fn py_str(v: &PyValue) -> String {
    match v {
        PyValue::Str(s) => s.clone(),
        other => repr(other),
    }
}

fn repr(v: &PyValue) -> String {
    let join = |items: &mut dyn Iterator<Item = String>| items.collect::<Vec<_>>().join(", ");
    match v {
        PyValue::None => "None".into(),
        PyValue::Bool(b) => if *b { "True" } else { "False" }.into(),
        PyValue::Int(i) => i.to_string(),
        PyValue::BigInt(d) => d.clone(),
        PyValue::Float(x) => float_repr(*x),
        PyValue::Str(s) => str_repr(s),
        PyValue::List(items) => format!("[{}]", join(&mut items.iter().map(repr))),
        PyValue::Tuple(items) if items.len() == 1 => format!("({},)", repr(&items[0])),
        PyValue::Tuple(items) => format!("({})", join(&mut items.iter().map(repr))),
        PyValue::Dict(items) => format!(
            "{{{}}}",
            join(
                &mut items
                    .iter()
                    .map(|(k, v)| format!("{}: {}", repr(k), repr(v)))
            )
        ),
    }
}

/// `repr(str)`: single quotes unless the text has one and no double quote; backslash
/// escapes for the quote, backslashes and unprintable characters.
fn str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
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
            c if c.is_control() || (c != ' ' && py_space(c)) => {
                let n = c as u32;
                out.push_str(&match n {
                    0..=0xff => format!("\\x{n:02x}"),
                    0x100..=0xffff => format!("\\u{n:04x}"),
                    _ => format!("\\U{n:08x}"),
                });
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// `shlex.split(s)` (POSIX mode, no comments): None where it raises ValueError (an
/// unclosed quote, a trailing backslash).
pub(super) fn shlex_split(s: &str) -> Option<Vec<String>> {
    let mut tokens = Vec::new();
    let mut cur = String::new();
    let mut in_token = false;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            ' ' | '\t' | '\r' | '\n' => {
                if in_token {
                    tokens.push(std::mem::take(&mut cur));
                    in_token = false;
                }
            }
            '\\' => {
                cur.push(chars.next()?);
                in_token = true;
            }
            '\'' => {
                in_token = true;
                loop {
                    match chars.next()? {
                        '\'' => break,
                        c => cur.push(c),
                    }
                }
            }
            '"' => {
                in_token = true;
                loop {
                    match chars.next()? {
                        '"' => break,
                        '\\' => {
                            let next = chars.next()?;
                            if next != '"' && next != '\\' {
                                cur.push('\\');
                            }
                            cur.push(next);
                        }
                        c => cur.push(c),
                    }
                }
            }
            c => {
                cur.push(c);
                in_token = true;
            }
        }
    }
    if in_token {
        tokens.push(cur);
    }
    Some(tokens)
}

/// The tags of one key/value pair format.
pub(super) struct PairTags {
    pub key: (&'static str, &'static str),
    pub value: (&'static str, &'static str),
}

/// Every `KEY_OPEN(.*?)KEY_CLOSE(?:\\n|\s)*VALUE_OPEN(.*?)VALUE_CLOSE` match, left to right
/// and not overlapping, as `finditer` gives them: a key runs to the first key close that
/// a value follows (past other pairs' tags where none does), the separator is whitespace
/// or literal backslash-n pairs, the value runs to the first value close.
pub(super) fn tag_pairs<'t>(text: &'t str, tags: &PairTags) -> Vec<(&'t str, &'t str)> {
    let (ko, kc) = tags.key;
    let (vo, vc) = tags.value;
    let mut out = Vec::new();
    let mut pos = 0;
    while let Some(found) = text[pos..].find(ko) {
        let start = pos + found;
        let key_start = start + ko.len();
        let mut search = key_start;
        let mut hit = None;
        while let Some(c) = text[search..].find(kc) {
            let key_end = search + c;
            let after = skip_separator(text, key_end + kc.len());
            if text[after..].starts_with(vo) {
                let value_start = after + vo.len();
                // No value close after this key: none after a longer key either.
                let Some(v) = text[value_start..].find(vc) else {
                    break;
                };
                hit = Some((key_start..key_end, value_start..value_start + v));
                break;
            }
            search = key_end + kc.len();
        }
        match hit {
            Some((k, v)) => {
                pos = v.end + vc.len();
                out.push((&text[k], &text[v]));
            }
            None => pos = start + ko.len(),
        }
    }
    out
}

/// Past `(?:\\n|\s)*` from `at`.
fn skip_separator(text: &str, mut at: usize) -> usize {
    loop {
        let rest = &text[at..];
        if rest.starts_with("\\n") {
            at += 2;
        } else if let Some(c) = rest.chars().next().filter(|&c| py_space(c)) {
            at += c.len_utf8();
        } else {
            return at;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shlex_and_repr_as_python_gives_them() {
        // Expected: shlex.split and repr in Python 3.11.
        assert_eq!(
            shlex_split(r#"a="b c" d\ e 'f\g' "h\"i\j" """#).unwrap(),
            ["a=b c", "d e", r"f\g", r#"h"i\j"#, ""]
        );
        assert_eq!(shlex_split("x='open"), None);
        assert_eq!(shlex_split("x\\"), None);
        let v = PyValue::List(vec![
            PyValue::Int(1),
            PyValue::str("it's"),
            PyValue::Tuple(vec![PyValue::None]),
            PyValue::Dict(vec![(PyValue::str("a\n"), PyValue::Float(1.0))]),
        ]);
        assert_eq!(py_str(&v), r#"[1, "it's", (None,), {'a\n': 1.0}]"#);
        assert_eq!(py_int(" -1_000 "), Some(PyValue::Int(-1000)));
        assert_eq!(py_int("1__0"), None);
        assert_eq!(py_int("3.0"), None);
    }
}
