//! mlx-lm 0.32.2's `mistral` tool parser (`mlx_lm/tool_parsers/mistral.py`).

use serde_json::Value;

use super::super::value::{err, loads, raw_decode, PyValue, ValueError};
use super::{call, is_word, run, Parser};

/// The `mistral` format.
pub struct Mistral;

impl Parser for Mistral {
    fn parse(&self, text: &str, _tools: Option<&Value>) -> Result<Vec<PyValue>, ValueError> {
        mistral(text)
    }
}

/// mistral: `[{"name": …, "arguments": …}, …]`, or `NAME[ARGS]{…}` repeated (no end marker,
/// so the text may hold several calls).
fn mistral(text: &str) -> Result<Vec<PyValue>, ValueError> {
    let calls = match mistral_json(text)? {
        calls if !calls.is_empty() => calls,
        _ => mistral_headers(text)?,
    };
    if calls.is_empty() {
        return err(format!("Could not parse tool call from: {text}"));
    }
    Ok(calls)
}

fn mistral_json(text: &str) -> Result<Vec<PyValue>, ValueError> {
    let Ok(PyValue::List(items)) = loads(text, true) else {
        return Ok(Vec::new());
    };
    let mut calls = Vec::new();
    for item in items {
        let name = item.get("name");
        let mut arguments = match &item {
            PyValue::Dict(_) => Some(
                item.get("arguments")
                    .cloned()
                    .unwrap_or(PyValue::Dict(Vec::new())),
            ),
            _ => None,
        };
        if let Some(PyValue::Str(s)) = &arguments {
            arguments = loads(s, true).ok();
        }
        let (Some(PyValue::Str(name)), Some(arguments @ PyValue::Dict(_))) = (name, arguments)
        else {
            return err(format!("Could not parse tool call from: {text}"));
        };
        let mut parsed = match call(name, arguments) {
            PyValue::Dict(d) => d,
            _ => Vec::new(),
        };
        if let Some(id @ PyValue::Str(_)) = item.get("id") {
            parsed.push((PyValue::str("id"), id.clone()));
        }
        calls.push(PyValue::Dict(parsed));
    }
    Ok(calls)
}

fn mistral_headers(text: &str) -> Result<Vec<PyValue>, ValueError> {
    let mut calls = Vec::new();
    let mut pos = 0;
    while let Some((name, end)) = mistral_header(text, pos) {
        let (arguments, next) = raw_decode(text, end)
            .map_err(|_| ValueError(format!("Could not parse tool call from: {text}")))?;
        calls.push(call(name, arguments));
        pos = next;
    }
    Ok(calls)
}

/// `([\w-]+)\s*\[ARGS\]\s*` searched from byte `from`: the name and the match's end.
fn mistral_header(text: &str, from: usize) -> Option<(&str, usize)> {
    let word = |c: char| is_word(c) || c == '-';
    let mut i = from;
    while i < text.len() {
        let rest = &text[i..];
        let n = run(rest, word);
        if n == 0 {
            i += rest.chars().next().map_or(1, char::len_utf8);
            continue;
        }
        let ws = run(&rest[n..], char::is_whitespace);
        if rest[n + ws..].starts_with("[ARGS]") {
            let after = n + ws + 6;
            let tail = run(&rest[after..], char::is_whitespace);
            return Some((&rest[..n], i + after + tail));
        }
        i += n;
    }
    None
}
