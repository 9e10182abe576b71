//! mlx-lm 0.32.2's `pythonic` tool parser (`mlx_lm/tool_parsers/pythonic.py`).

use serde_json::Value;

use super::super::literal::{call_list, literal_eval};
use super::super::value::{PyValue, ValueError};
use super::{call, is_word, run, Parser};

/// The `pythonic` format.
pub struct Pythonic;

impl Parser for Pythonic {
    fn parse(&self, text: &str, _tools: Option<&Value>) -> Result<Vec<PyValue>, ValueError> {
        pythonic(text)
    }
}

/// pythonic: `[name(key=value, …), …]` read as Python, else its regex fallback.
fn pythonic(text: &str) -> Result<Vec<PyValue>, ValueError> {
    if let (Some(start), Some(end)) = (text.find('['), text.rfind(']')) {
        if end > start {
            if let Some(calls) = call_list(&text[start..=end]) {
                return Ok(calls
                    .into_iter()
                    .map(|(name, args)| {
                        let args = args
                            .into_iter()
                            .map(|(k, v)| (PyValue::Str(k), v))
                            .collect();
                        call(&name, PyValue::Dict(args))
                    })
                    .collect());
            }
        }
    }
    let (name, args) =
        pythonic_regex(text).ok_or_else(|| ValueError("No function provided.".into()))?;
    let mut arguments = Vec::new();
    for (key, value, bare) in pythonic_args(args) {
        let v = if bare { value.trim() } else { value };
        let parsed = literal_eval(v).unwrap_or_else(|_| PyValue::str(v));
        PyValue::dict_set(&mut arguments, PyValue::str(key.trim()), parsed);
    }
    Ok(vec![call(name, PyValue::Dict(arguments))])
}

/// `\[(?P<name>[\w.]+)\((?P<args>.*?)\)\]` searched in `text`.
fn pythonic_regex(text: &str) -> Option<(&str, &str)> {
    let mut from = 0;
    while let Some(at) = text[from..].find('[').map(|i| from + i) {
        let name_start = at + 1;
        let n = run(&text[name_start..], |c| is_word(c) || c == '.');
        let paren = name_start + n;
        if n > 0 && text[paren..].starts_with('(') {
            if let Some(close) = text[paren + 1..].find(")]") {
                return Some((
                    &text[name_start..paren],
                    &text[paren + 1..paren + 1 + close],
                ));
            }
        }
        from = at + 1;
    }
    None
}

/// `(?P<key>\w+)=(?:"(?P<quoted>[^"]*)"|'(?P<quoted>[^']*)'|(?P<bare>[^,]+))(?:,\s*|$)`
/// found over `args`: (key, value, whether it was bare).
fn pythonic_args(args: &str) -> Vec<(&str, &str, bool)> {
    let mut out = Vec::new();
    let mut i = 0;
    'scan: while i < args.len() {
        let rest = &args[i..];
        // Leftmost start: every position of a word char (a shorter key fails the same way).
        let n = run(rest, is_word);
        for k in 0..n {
            if !rest.is_char_boundary(k) {
                continue;
            }
            if let Some((len, value, bare)) = pythonic_arg_at(&rest[k..]) {
                let key_len = run(&rest[k..], is_word);
                out.push((&rest[k..k + key_len], value, bare));
                i += k + len.max(1);
                continue 'scan;
            }
        }
        i += if n > 0 {
            n
        } else {
            rest.chars().next().map_or(1, char::len_utf8)
        };
    }
    out
}

/// One `key=value(,\s*|$)` match at the start of `s`: its length, value, whether bare.
fn pythonic_arg_at(s: &str) -> Option<(usize, &str, bool)> {
    let key = run(s, is_word);
    if key == 0 || !s[key..].starts_with('=') {
        return None;
    }
    let v = key + 1;
    let tail = |end: usize| -> Option<usize> {
        let r = &s[end..];
        // `$`: the end, or just before a final newline.
        if r.is_empty() || r == "\n" {
            Some(end)
        } else {
            r.strip_prefix(',')
                .map(|after| end + 1 + run(after, char::is_whitespace))
        }
    };
    for q in ['"', '\''] {
        if s[v..].starts_with(q) {
            if let Some(close) = s[v + 1..].find(q) {
                let end = v + 1 + close + 1;
                if let Some(len) = tail(end) {
                    return Some((len, &s[v + 1..v + 1 + close], false));
                }
            }
        }
    }
    // `[^,]+` greedy, backtracking to a shorter value only helps at the end of text.
    let n = run(&s[v..], |c| c != ',');
    if n == 0 {
        return None;
    }
    tail(v + n).map(|len| (len, &s[v..v + n], true))
}
