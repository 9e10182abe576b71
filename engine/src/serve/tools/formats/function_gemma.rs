//! mlx-lm 0.32.2's `function_gemma` tool parser (`mlx_lm/tool_parsers/function_gemma.py`).

use serde_json::Value;

use super::super::value::{err, loads, PyValue, ValueError};
use super::{call, is_word, run, Parser};

/// The `function_gemma` format.
pub struct FunctionGemma;

impl Parser for FunctionGemma {
    fn parse(&self, text: &str, _tools: Option<&Value>) -> Result<Vec<PyValue>, ValueError> {
        function_gemma(text)
    }
}

/// function_gemma: `call:NAME{key:value,…}`, strings in `<escape>`; the first call only.
fn function_gemma(text: &str) -> Result<Vec<PyValue>, ValueError> {
    let mut found = None;
    let mut from = 0;
    while let Some(at) = text[from..].find("call:").map(|i| from + i) {
        let name_start = at + 5;
        let n = run(&text[name_start..], is_word);
        let brace = name_start + n;
        if n > 0 && text[brace..].starts_with('{') {
            if let Some(close) = text[brace + 1..].find('}') {
                found = Some((
                    &text[name_start..brace],
                    &text[brace + 1..brace + 1 + close],
                ));
                break;
            }
        }
        from = at + 1;
    }
    let Some((name, args)) = found else {
        return err("No function provided.");
    };
    let escape = "<escape>";
    let mut arguments = Vec::new();
    // Python's `s[n:]`, and `s[n + 1:]` past one more character.
    let from = |s: &str, n: usize| s.get(n..).unwrap_or("").to_owned();
    let skip_one = |s: &str| s.chars().skip(1).collect::<String>();
    let mut args = args.to_owned();
    while !args.is_empty() {
        let split = args
            .find(':')
            .ok_or_else(|| ValueError("substring not found".into()))?;
        let key = args[..split].to_owned();
        args = from(&args, split + 1);
        if let Some(after) = args.strip_prefix(escape) {
            let split = after
                .find(escape)
                .ok_or_else(|| ValueError("substring not found".into()))?;
            let value = PyValue::str(&after[..split]);
            PyValue::dict_set(&mut arguments, PyValue::Str(key), value);
            args = skip_one(&from(after, split + escape.len()));
            continue;
        }
        let split = args.find(',').unwrap_or(args.len());
        let value = args[..split].to_owned();
        args = skip_one(&from(&args, split));
        let v = loads(&value, true).unwrap_or(PyValue::Str(value));
        PyValue::dict_set(&mut arguments, PyValue::Str(key), v);
    }
    Ok(vec![call(name, PyValue::Dict(arguments))])
}
