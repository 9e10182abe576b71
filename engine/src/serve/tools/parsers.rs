//! mlx-lm 0.32.2's tool parsers (`mlx_lm/tool_parsers/*.py`), one function per format:
//! the text between a tool-call start and end marker to the calls it holds, each a dict
//! with `name` and `arguments` (and the model's own `id`, where a format carries one).
//! The regular expressions are matched by hand, with the same leftmost / lazy / greedy
//! choices as Python's `regex` module makes for them.

use serde_json::Value;

use super::literal::{call_list, literal_eval};
use super::value::{err, loads, raw_decode, PyValue, ValueError};

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

/// json_tools: the text is one JSON value (a call, or a list of them).
pub fn json_tools(text: &str) -> Result<Vec<PyValue>, ValueError> {
    Ok(match loads(text.trim(), true)? {
        PyValue::List(items) => items,
        v => vec![v],
    })
}

/// qwen3_coder: `<function=NAME>` then `<parameter=KEY>\nVALUE\n</parameter>`s, each value
/// converted by the type its tool's schema gives it.
pub fn qwen3_coder(text: &str, tools: Option<&Value>) -> Result<Vec<PyValue>, ValueError> {
    // `<function=(.*?)</function>$`: from the first `<function=` to a `</function>` that
    // ends the text (or precedes its final newline).
    let body = text.strip_suffix('\n').unwrap_or(text);
    let close = "</function>";
    let found = body
        .strip_suffix(close)
        .map(|_| body.len() - close.len())
        .and_then(|end| {
            text.find("<function=")
                .filter(|&s| s + 10 <= end)
                .map(|s| (s, end))
        });
    let Some((start, end)) = found else {
        return err("No function provided.");
    };
    let inner = &text[start + 10..end];
    let (name, after) =
        qwen_name(inner).ok_or_else(|| ValueError("No function name provided.".into()))?;
    let config = qwen_arguments_config(name, tools)?;
    let mut params = Vec::new();
    let mut rest = &inner[after..];
    while let Some(open) = rest.find("<parameter=") {
        let from = &rest[open + 11..];
        let Some(close) = from.find("</parameter>") else {
            break;
        };
        let m = &from[..close];
        rest = &from[close + 12..];
        let Some((key, after)) = qwen_name(m) else {
            continue;
        };
        let mut value = &m[after..];
        value = value.strip_prefix('\n').unwrap_or(value);
        value = value.strip_suffix('\n').unwrap_or(value);
        let v = qwen_convert(value, key, config)?;
        PyValue::dict_set(&mut params, PyValue::str(key), v);
    }
    Ok(vec![call(name, PyValue::Dict(params))])
}

/// `\s*([^\s<>]+)>?` at the start of `s`: the name and where the match ends.
fn qwen_name(s: &str) -> Option<(&str, usize)> {
    let ws = run(s, char::is_whitespace);
    let n = run(&s[ws..], |c| !c.is_whitespace() && c != '<' && c != '>');
    if n == 0 {
        return None;
    }
    let end = ws + n + usize::from(s[ws + n..].starts_with('>'));
    Some((&s[ws..ws + n], end))
}

fn qwen_arguments_config<'t>(
    name: &str,
    tools: Option<&'t Value>,
) -> Result<Option<&'t serde_json::Map<String, Value>>, ValueError> {
    let Some(tools) = tools.and_then(Value::as_array) else {
        return Ok(None);
    };
    for tool in tools {
        let Some(function) = tool.get("function").filter(|f| py_truthy(f)) else {
            continue;
        };
        if function.get("name").and_then(Value::as_str) == Some(name) {
            return Ok(function
                .get("parameters")
                .filter(|p| py_truthy(p))
                .and_then(|p| p.get("properties"))
                .and_then(Value::as_object));
        }
    }
    Ok(None)
}

fn py_truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// Python's `str(x)` for a schema's `type` (a list or such never matches a type name).
fn type_name(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Bool(b) => if *b { "True" } else { "False" }.to_owned(),
        Value::Null => "None".to_owned(),
        other => other.to_string(),
    }
}

/// Python's `float(s)` for the texts a parameter holds.
fn py_float(s: &str) -> Result<f64, ValueError> {
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

fn qwen_convert(
    value: &str,
    key: &str,
    config: Option<&serde_json::Map<String, Value>>,
) -> Result<PyValue, ValueError> {
    if value.to_lowercase() == "null" {
        return Ok(PyValue::None);
    }
    let Some(param) = config.and_then(|c| c.get(key)).filter(|p| py_truthy(p)) else {
        return Ok(PyValue::str(value));
    };
    let Some(ty) = param.get("type") else {
        return Ok(match loads(value, true) {
            Ok(v @ (PyValue::Dict(_) | PyValue::List(_))) => v,
            _ => PyValue::str(value),
        });
    };
    let ty = type_name(ty).trim().to_lowercase();
    if ["string", "str", "text", "varchar", "char", "enum"].contains(&ty.as_str()) {
        return Ok(PyValue::str(value));
    }
    if ["int", "uint", "long", "short", "unsigned"]
        .iter()
        .any(|p| ty.starts_with(p))
    {
        let x = py_float(value)?;
        if !x.is_finite() {
            return err(format!("Invalid integer literal {value:?}"));
        }
        if x.fract() != 0.0 {
            return err(format!("Invalid integer literal {value:?}"));
        }
        return Ok(PyValue::Int(x as i128));
    }
    if ty.starts_with("num") || ty.starts_with("float") {
        let x = py_float(value)?;
        return Ok(if x.is_finite() && x.fract() == 0.0 {
            PyValue::Int(x as i128)
        } else {
            PyValue::Float(x)
        });
    }
    if ["boolean", "bool", "binary"].contains(&ty.as_str()) {
        return Ok(PyValue::Bool(value.to_lowercase() == "true"));
    }
    if ["object", "array", "arr"].contains(&ty.as_str())
        || ty.starts_with("dict")
        || ty.starts_with("list")
    {
        if let Ok(v) = loads(value, false) {
            return Ok(v);
        }
    }
    Ok(literal_eval(value).unwrap_or_else(|_| PyValue::str(value)))
}

const GEMMA_QUOTE: &str = "<|\"|>";

/// gemma4: `call:NAME{key:value,…}` (one or several), keys bare and strings in `<|"|>`.
pub fn gemma4(text: &str) -> Result<Vec<PyValue>, ValueError> {
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

/// function_gemma: `call:NAME{key:value,…}`, strings in `<escape>`; the first call only.
pub fn function_gemma(text: &str) -> Result<Vec<PyValue>, ValueError> {
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

/// mistral: `[{"name": …, "arguments": …}, …]`, or `NAME[ARGS]{…}` repeated (no end marker,
/// so the text may hold several calls).
pub fn mistral(text: &str) -> Result<Vec<PyValue>, ValueError> {
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

/// pythonic: `[name(key=value, …), …]` read as Python, else its regex fallback.
pub fn pythonic(text: &str) -> Result<Vec<PyValue>, ValueError> {
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
