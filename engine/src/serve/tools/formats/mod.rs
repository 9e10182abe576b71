//! The tool-call formats of mlx-lm 0.32.2 (`mlx_lm/tool_parsers/`), one table (`FORMATS`):
//! each format's name, its markers, and its parser where this engine has one — one file
//! per parsed format, each a `Parser` (the text between a tool-call start and end marker to
//! the calls it holds, each a dict with `name` and `arguments`, and the model's own `id`
//! where a format carries one). The regular expressions are matched by hand, with the same
//! leftmost / lazy / greedy choices as Python's `regex` module makes for them.

mod function_gemma;
mod gemma4;
mod glm47;
mod json_tools;
mod kimi_k2;
mod longcat;
mod minimax_m2;
mod mistral;
mod pyish;
mod pythonic;
mod qwen3_coder;

use serde_json::Value;

use super::value::{PyValue, ValueError};
use super::Family;

/// A format's `parse_tool_call(text, tools)`.
pub trait Parser: Sync {
    /// The calls in one tool-call text (`tools`: the request's, which some formats read
    /// for the arguments' types).
    fn parse(&self, text: &str, tools: Option<&Value>) -> Result<Vec<PyValue>, ValueError>;
}

/// One tool-call format.
pub struct Format {
    pub family: Family,
    /// Its module name in mlx_lm.tool_parsers (tokenizer_config.json's
    /// `tool_parser_type`).
    pub name: &'static str,
    /// `tool_call_start`, `tool_call_end` ("" for none: the call runs to the end).
    pub markers: (&'static str, &'static str),
    /// None: not parsed by this engine (a request bringing tools is refused).
    pub parser: Option<&'static dyn Parser>,
}

const fn row(
    family: Family,
    name: &'static str,
    markers: (&'static str, &'static str),
    parser: Option<&'static dyn Parser>,
) -> Format {
    Format {
        family,
        name,
        markers,
        parser,
    }
}

const TOOL_CALL: (&str, &str) = ("<tool_call>", "</tool_call>");

/// Every format, in mlx-lm's order.
pub static FORMATS: [Format; 14] = [
    row(
        Family::JsonTools,
        "json_tools",
        TOOL_CALL,
        Some(&json_tools::JsonTools),
    ),
    row(
        Family::Qwen3Coder,
        "qwen3_coder",
        TOOL_CALL,
        Some(&qwen3_coder::Qwen3Coder),
    ),
    row(
        Family::Gemma4,
        "gemma4",
        ("<|tool_call>", "<tool_call|>"),
        Some(&gemma4::Gemma4),
    ),
    row(
        Family::FunctionGemma,
        "function_gemma",
        ("<start_function_call>", "<end_function_call>"),
        Some(&function_gemma::FunctionGemma),
    ),
    row(
        Family::Mistral,
        "mistral",
        ("[TOOL_CALLS]", ""),
        Some(&mistral::Mistral),
    ),
    row(
        Family::Pythonic,
        "pythonic",
        ("<|tool_call_start|>", "<|tool_call_end|>"),
        Some(&pythonic::Pythonic),
    ),
    row(
        Family::MinimaxM2,
        "minimax_m2",
        ("<minimax:tool_call>", "</minimax:tool_call>"),
        Some(&minimax_m2::MinimaxM2),
    ),
    row(
        Family::Longcat,
        "longcat",
        ("<longcat_tool_call>", "</longcat_tool_call>"),
        Some(&longcat::Longcat),
    ),
    row(Family::Glm47, "glm47", TOOL_CALL, Some(&glm47::Glm47)),
    // mlx-lm's laguna module is glm47's parser under another name.
    row(Family::Laguna, "laguna", TOOL_CALL, Some(&glm47::Glm47)),
    row(
        Family::KimiK2,
        "kimi_k2",
        ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
        Some(&kimi_k2::KimiK2),
    ),
    row(
        Family::KimiK3,
        "kimi_k3",
        ("<|open|>tools<|sep|>", "<|close|>tools<|sep|>"),
        None,
    ),
    row(
        Family::Minicpm5,
        "minicpm5",
        ("<function name=", "</function>"),
        None,
    ),
    row(
        Family::MuseSpark,
        "muse_spark",
        ("<atem:function_calls>", "</atem:function_calls>"),
        None,
    ),
];

/// A parsed call's dict: `{"name", "arguments"}`.
fn call(name: &str, arguments: PyValue) -> PyValue {
    PyValue::Dict(vec![
        (PyValue::str("name"), PyValue::str(name)),
        (PyValue::str("arguments"), arguments),
    ])
}

fn is_word(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Length in bytes of the run of chars at the start of `s` that satisfy `f`.
fn run(s: &str, f: impl Fn(char) -> bool) -> usize {
    s.find(|c: char| !f(c)).unwrap_or(s.len())
}

/// Python truthiness of a JSON value.
pub(super) fn py_truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// Python's `float(s)` for the texts a parameter holds.
pub(super) fn py_float(s: &str) -> Result<f64, ValueError> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let unsigned = lower.trim_start_matches(['+', '-']);
    let special = matches!(unsigned, "inf" | "infinity" | "nan");
    let ok = special
        || (!t.is_empty()
            && !t.contains("__")
            && !t.starts_with('_')
            && !t.ends_with('_')
            && t.chars()
                .all(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '+' | '-' | '_')));
    let parsed = if ok {
        t.replace('_', "").parse::<f64>().ok()
    } else {
        None
    };
    parsed.ok_or_else(|| ValueError(format!("could not convert string to float: {s:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_has_each_family_once_under_its_own_name() {
        for (i, f) in FORMATS.iter().enumerate() {
            assert_eq!(f.family as usize, i, "{}: rows in the enum's order", f.name);
            assert_eq!(Family::from_name(f.name), Some(f.family));
            assert_eq!(f.family.name(), f.name);
        }
    }
}
