//! mlx-lm 0.32.2's `json_tools` tool parser (`mlx_lm/tool_parsers/json_tools.py`).

use serde_json::Value;

use super::super::value::{loads, PyValue, ValueError};
use super::Parser;

/// The `json_tools` format.
pub struct JsonTools;

impl Parser for JsonTools {
    fn parse(&self, text: &str, _tools: Option<&Value>) -> Result<Vec<PyValue>, ValueError> {
        json_tools(text)
    }
}

/// json_tools: the text is one JSON value (a call, or a list of them).
fn json_tools(text: &str) -> Result<Vec<PyValue>, ValueError> {
    Ok(match loads(text.trim(), true)? {
        PyValue::List(items) => items,
        v => vec![v],
    })
}
