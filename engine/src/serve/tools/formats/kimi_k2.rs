//! mlx-lm 0.32.2's `kimi_k2` tool parser (Kimi K2 / K2.5): inside the tool-calls
//! section, `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>ARGS
//! <|tool_call_end|>` per call (or one such call without the per-call markers); the id is
//! `functions.NAME:INDEX` as written, the arguments JSON or a Python literal (else the text).

use serde_json::Value;

use super::super::value::{err, PyValue, ValueError};
use super::pyish::{deserialize, py_space};
use super::Parser;

/// The `kimi_k2` format.
pub struct KimiK2;

const CALL: (&str, &str) = ("<|tool_call_begin|>", "<|tool_call_end|>");
const ARGUMENTS: &str = "<|tool_call_argument_begin|>";
const PREFIX: &str = "functions.";

impl Parser for KimiK2 {
    fn parse(&self, text: &str, _tools: Option<&Value>) -> Result<Vec<PyValue>, ValueError> {
        let calls = sections(text);
        if calls.is_empty() {
            return Ok(vec![single(text)?]);
        }
        calls.into_iter().map(single).collect()
    }
}

/// `<|tool_call_begin|>(.*?)<|tool_call_end|>`, every match.
fn sections(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut pos = 0;
    while let Some(b) = text[pos..].find(CALL.0) {
        let start = pos + b + CALL.0.len();
        let Some(e) = text[start..].find(CALL.1) else {
            break;
        };
        out.push(&text[start..start + e]);
        pos = start + e + CALL.1.len();
    }
    out
}

/// One call: `_parse_single_tool`.
fn single(text: &str) -> Result<PyValue, ValueError> {
    let Some((id, name)) = id_and_name(text) else {
        return err("No tool call found.");
    };
    let Some(at) = text.find(ARGUMENTS) else {
        return err("No tool call arguments found.");
    };
    let arguments = text[at + ARGUMENTS.len()..].trim_start_matches(py_space);
    let id = if crate::plant::is(crate::plant::Defect::KimiK2IdWithoutPrefix) {
        id.trim_start_matches(PREFIX)
    } else {
        id
    };
    Ok(PyValue::Dict(vec![
        (PyValue::str("id"), PyValue::str(id)),
        (PyValue::str("name"), PyValue::str(name)),
        (PyValue::str("arguments"), deserialize(arguments)),
    ]))
}

/// `^\s*((?:functions\.)?(.+?):\d+)\s*<|tool_call_argument_begin|>`: the id (group 1) and
/// the name (group 2), with the regex's backtracking order (most leading whitespace
/// first, the prefix taken before it is left, the shortest name).
fn id_and_name(text: &str) -> Option<(&str, &str)> {
    let ws_end = text.len() - text.trim_start_matches(py_space).len();
    let mut starts: Vec<usize> = text[..ws_end]
        .char_indices()
        .map(|(i, _)| i)
        .chain([ws_end])
        .collect();
    starts.reverse();
    for start in starts {
        let prefixed = text[start..].starts_with(PREFIX);
        for skip in [prefixed.then_some(PREFIX.len()), Some(0)]
            .into_iter()
            .flatten()
        {
            let name_start = start + skip;
            for (i, _) in text[name_start..]
                .match_indices(':')
                .filter(|(i, _)| *i > 0)
            {
                let colon = name_start + i;
                if let Some(id_end) = index_then_arguments(text, colon + 1) {
                    return Some((&text[start..id_end], &text[name_start..colon]));
                }
            }
        }
    }
    None
}

/// `\d+\s*<|tool_call_argument_begin|>` at `at`: where the digits end.
fn index_then_arguments(text: &str, at: usize) -> Option<usize> {
    let rest = &text[at..];
    let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
    if digits == 0 {
        return None;
    }
    let after = rest[digits..].trim_start_matches(py_space);
    after.starts_with(ARGUMENTS).then_some(at + digits)
}
