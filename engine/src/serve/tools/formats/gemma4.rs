//! mlx-lm 0.32.2's `gemma4` tool parser (`mlx_lm/tool_parsers/gemma4.py`).

use serde_json::Value;

use super::super::value::{err, loads, PyValue, ValueError};
use super::{call, is_word, run, Parser};

/// The `gemma4` format.
pub struct Gemma4;

impl Parser for Gemma4 {
    fn parse(&self, text: &str, _tools: Option<&Value>) -> Result<Vec<PyValue>, ValueError> {
        gemma4(text)
    }
}

const GEMMA_QUOTE: &str = "<|\"|>";

/// gemma4: `call:NAME{key:value,…}` (one or several), keys bare and strings in `<|"|>`.
fn gemma4(text: &str) -> Result<Vec<PyValue>, ValueError> {
    let mut calls = Vec::new();
    let mut from = 0;
    while let Some(at) = text[from..].find("call:").map(|i| from + i) {
        let name_start = at + 5;
        let n = run(&text[name_start..], |c| is_word(c) || c == '-');
        let brace = name_start + n;
        match (n > 0).then(|| gemma_braces(text, brace)).flatten() {
            Some(end) => {
                let name = &text[name_start..brace];
                let arguments = loads(&gemma4_args_to_json(&text[brace..end]), true)?;
                calls.push(call(name, arguments));
                from = end;
            }
            None => from = at + 1,
        }
    }
    if calls.is_empty() {
        return err("No function provided.");
    }
    Ok(calls)
}

/// A balanced `{…}` at `at` (quoted strings opaque); the byte after its `}`.
fn gemma_braces(text: &str, at: usize) -> Option<usize> {
    if !text[at..].starts_with('{') {
        return None;
    }
    let mut i = at;
    let mut depth = 0usize;
    loop {
        let rest = &text[i..];
        let c = rest.chars().next()?;
        if let Some(inside) = rest.strip_prefix(GEMMA_QUOTE) {
            let close = inside.find(GEMMA_QUOTE)?;
            i += 2 * GEMMA_QUOTE.len() + close;
            continue;
        }
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
        i += c.len_utf8();
    }
}

/// `_gemma4_args_to_json`: strings out, bare keys quoted, strings back JSON-escaped.
fn gemma4_args_to_json(text: &str) -> String {
    let mut strings = Vec::new();
    let mut held = String::new();
    let mut rest = text;
    while let Some(open) = rest.find(GEMMA_QUOTE) {
        let after = &rest[open + GEMMA_QUOTE.len()..];
        let Some(close) = after.find(GEMMA_QUOTE) else {
            break;
        };
        held.push_str(&rest[..open]);
        held.push_str(&format!("\0{}\0", strings.len()));
        strings.push(after[..close].to_owned());
        rest = &after[close + GEMMA_QUOTE.len()..];
    }
    held.push_str(rest);
    // `(?<=[{,])(\w+):` → `"\1":`
    let mut quoted = String::with_capacity(held.len());
    let mut prev: Option<char> = None;
    let mut i = 0;
    while i < held.len() {
        let c = held[i..].chars().next().unwrap_or(' ');
        if matches!(prev, Some('{' | ',')) {
            let n = run(&held[i..], is_word);
            if n > 0 && held[i + n..].starts_with(':') {
                quoted.push('"');
                quoted.push_str(&held[i..i + n]);
                quoted.push_str("\":");
                prev = Some(':');
                i += n + 1;
                continue;
            }
        }
        quoted.push(c);
        prev = Some(c);
        i += c.len_utf8();
    }
    for (i, s) in strings.iter().enumerate() {
        let escaped = PyValue::str(s).dumps().unwrap_or_default();
        quoted = quoted.replace(&format!("\0{i}\0"), &escaped);
    }
    quoted
}
