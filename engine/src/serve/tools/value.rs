//! Python values as mlx-lm's tool parsers hold them: what `json.loads` and
//! `ast.literal_eval` return (dicts keep their insertion order), and `json.dumps(v,
//! ensure_ascii=False)` of them, byte for byte (", " and ": " separators, Python's float
//! repr, `NaN` / `Infinity`).

use std::fmt::Write;

use crate::pyfmt::{json_float, json_string};

/// A Python value a tool parser can produce.
#[derive(Debug, Clone, PartialEq)]
pub enum PyValue {
    None,
    Bool(bool),
    Int(i128),
    /// An integer past i128 (JSON allows any length), as its decimal digits.
    BigInt(String),
    Float(f64),
    Str(String),
    List(Vec<PyValue>),
    /// Dumps as a list.
    Tuple(Vec<PyValue>),
    /// Insertion order, as a Python dict keeps it.
    Dict(Vec<(PyValue, PyValue)>),
}

/// Why a value could not be read or written (Python's ValueError / TypeError).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ValueError(pub String);

pub fn err<T>(message: impl Into<String>) -> Result<T, ValueError> {
    Err(ValueError(message.into()))
}

impl PyValue {
    pub fn str(s: &str) -> Self {
        PyValue::Str(s.to_owned())
    }

    /// Inserts or replaces `key` (a replaced key keeps its place, as in a dict).
    pub fn dict_set(items: &mut Vec<(PyValue, PyValue)>, key: PyValue, value: PyValue) {
        match items.iter_mut().find(|(k, _)| k.same_key(&key)) {
            Some(slot) => slot.1 = value,
            None => items.push((key, value)),
        }
    }

    /// Python dict-key equality for the keys parsers make (1 == 1.0 == True).
    fn same_key(&self, other: &PyValue) -> bool {
        match (self.as_number(), other.as_number()) {
            (Some(a), Some(b)) => a == b,
            _ => self == other,
        }
    }

    fn as_number(&self) -> Option<f64> {
        match self {
            PyValue::Bool(b) => Some(f64::from(u8::from(*b))),
            PyValue::Int(i) => Some(*i as f64),
            PyValue::Float(x) => Some(*x),
            _ => None,
        }
    }

    /// The value under string key `key` of a dict.
    pub fn get(&self, key: &str) -> Option<&PyValue> {
        match self {
            PyValue::Dict(items) => items
                .iter()
                .find(|(k, _)| matches!(k, PyValue::Str(s) if s == key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    /// Python truthiness.
    pub fn truthy(&self) -> bool {
        match self {
            PyValue::None => false,
            PyValue::Bool(b) => *b,
            PyValue::Int(i) => *i != 0,
            PyValue::BigInt(_) => true,
            PyValue::Float(x) => *x != 0.0,
            PyValue::Str(s) => !s.is_empty(),
            PyValue::List(v) | PyValue::Tuple(v) => !v.is_empty(),
            PyValue::Dict(d) => !d.is_empty(),
        }
    }

    /// `json.dumps(self, ensure_ascii=False)`.
    pub fn dumps(&self) -> Result<String, ValueError> {
        let mut out = String::new();
        self.dump_into(&mut out)?;
        Ok(out)
    }

    fn dump_into(&self, out: &mut String) -> Result<(), ValueError> {
        match self {
            PyValue::None => out.push_str("null"),
            PyValue::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            PyValue::Int(i) => {
                let _ = write!(out, "{i}");
            }
            PyValue::BigInt(d) => out.push_str(d),
            PyValue::Float(x) => out.push_str(&json_float(*x)),
            PyValue::Str(s) => json_string(s, false, out),
            PyValue::List(items) | PyValue::Tuple(items) => {
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    v.dump_into(out)?;
                }
                out.push(']');
            }
            PyValue::Dict(items) => {
                out.push('{');
                for (i, (k, v)) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    json_string(&key_string(k)?, false, out);
                    out.push_str(": ");
                    v.dump_into(out)?;
                }
                out.push('}');
            }
        }
        Ok(())
    }

    /// The same value as serde_json holds it (for a response body).
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::Value;
        match self {
            PyValue::None => Value::Null,
            PyValue::Bool(b) => Value::Bool(*b),
            PyValue::Int(i) => i64::try_from(*i)
                .map(Value::from)
                .or_else(|_| u64::try_from(*i).map(Value::from))
                .unwrap_or_else(|_| Value::from(*i as f64)),
            PyValue::BigInt(d) => d.parse::<f64>().map_or(Value::Null, Value::from),
            PyValue::Float(x) => {
                serde_json::Number::from_f64(*x).map_or(Value::Null, Value::Number)
            }
            PyValue::Str(s) => Value::String(s.clone()),
            PyValue::List(v) | PyValue::Tuple(v) => {
                Value::Array(v.iter().map(Self::to_json).collect())
            }
            PyValue::Dict(items) => Value::Object(
                items
                    .iter()
                    .map(|(k, v)| (key_string(k).unwrap_or_default(), v.to_json()))
                    .collect(),
            ),
        }
    }
}

/// A dict key as json.dumps writes it (str, or a number / bool / None converted).
fn key_string(k: &PyValue) -> Result<String, ValueError> {
    Ok(match k {
        PyValue::Str(s) => s.clone(),
        PyValue::None => "null".into(),
        PyValue::Bool(b) => (if *b { "true" } else { "false" }).into(),
        PyValue::Int(i) => i.to_string(),
        PyValue::BigInt(d) => d.clone(),
        PyValue::Float(x) => json_float(*x),
        _ => return err("keys must be str, int, float, bool or None"),
    })
}

/// Python's `json.loads` (`strict`: control characters inside strings are refused).
pub fn loads(text: &str, strict: bool) -> Result<PyValue, ValueError> {
    let mut p = JsonReader {
        s: text.as_bytes(),
        text,
        pos: 0,
        strict,
    };
    p.ws();
    let v = p.value()?;
    p.ws();
    if p.pos != p.s.len() {
        return err(format!("Extra data: char {}", p.pos));
    }
    Ok(v)
}

/// `json.JSONDecoder().raw_decode(text, pos)`: one value starting exactly at byte `pos`
/// (no whitespace skipped), and the byte where it ended.
pub fn raw_decode(text: &str, pos: usize) -> Result<(PyValue, usize), ValueError> {
    let mut p = JsonReader {
        s: text.as_bytes(),
        text,
        pos,
        strict: true,
    };
    let v = p.value()?;
    Ok((v, p.pos))
}

struct JsonReader<'a> {
    s: &'a [u8],
    text: &'a str,
    pos: usize,
    strict: bool,
}

impl JsonReader<'_> {
    fn ws(&mut self) {
        while matches!(self.s.get(self.pos), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    fn eat(&mut self, lit: &str) -> bool {
        if self.s[self.pos..].starts_with(lit.as_bytes()) {
            self.pos += lit.len();
            true
        } else {
            false
        }
    }

    fn value(&mut self) -> Result<PyValue, ValueError> {
        let Some(&c) = self.s.get(self.pos) else {
            return err("Expecting value");
        };
        match c {
            b'{' => self.object(),
            b'[' => self.array(),
            b'"' => Ok(PyValue::Str(self.string()?)),
            _ if self.eat("null") => Ok(PyValue::None),
            _ if self.eat("true") => Ok(PyValue::Bool(true)),
            _ if self.eat("false") => Ok(PyValue::Bool(false)),
            _ if self.eat("NaN") => Ok(PyValue::Float(f64::NAN)),
            _ if self.eat("Infinity") => Ok(PyValue::Float(f64::INFINITY)),
            _ if self.eat("-Infinity") => Ok(PyValue::Float(f64::NEG_INFINITY)),
            b'-' | b'0'..=b'9' => self.number(),
            _ => err(format!("Expecting value: char {}", self.pos)),
        }
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while self.s.get(self.pos).is_some_and(u8::is_ascii_digit) {
            self.pos += 1;
        }
        self.pos - start
    }

    fn number(&mut self) -> Result<PyValue, ValueError> {
        let start = self.pos;
        self.eat("-");
        match self.s.get(self.pos) {
            Some(b'0') => self.pos += 1,
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return err(format!("Expecting value: char {start}")),
        }
        let int_end = self.pos;
        let mut float = false;
        if self.s.get(self.pos) == Some(&b'.') {
            self.pos += 1;
            if self.digits() == 0 {
                self.pos = int_end;
            } else {
                float = true;
            }
        }
        let before_exp = self.pos;
        if matches!(self.s.get(self.pos), Some(b'e' | b'E')) {
            self.pos += 1;
            if matches!(self.s.get(self.pos), Some(b'+' | b'-')) {
                self.pos += 1;
            }
            if self.digits() == 0 {
                self.pos = before_exp;
            } else {
                float = true;
            }
        }
        let lit = &self.text[start..self.pos];
        if float {
            return lit
                .parse::<f64>()
                .map(PyValue::Float)
                .or_else(|_| err("bad float"));
        }
        Ok(match lit.parse::<i128>() {
            Ok(i) => PyValue::Int(i),
            Err(_) => PyValue::BigInt(lit.to_owned()),
        })
    }

    fn hex4(&mut self) -> Result<u32, ValueError> {
        let h = self
            .text
            .get(self.pos..self.pos + 4)
            .filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| ValueError("Invalid \\uXXXX escape".into()))?;
        self.pos += 4;
        Ok(u32::from_str_radix(h, 16).unwrap_or(0))
    }

    fn string(&mut self) -> Result<String, ValueError> {
        self.pos += 1;
        let mut out = String::new();
        loop {
            let rest = &self.text[self.pos..];
            let Some(c) = rest.chars().next() else {
                return err("Unterminated string");
            };
            self.pos += c.len_utf8();
            match c {
                '"' => return Ok(out),
                '\\' => out.push(self.escape()?),
                c if self.strict && (c as u32) < 0x20 => return err("Invalid control character"),
                c => out.push(c),
            }
        }
    }

    fn escape(&mut self) -> Result<char, ValueError> {
        let Some(&e) = self.s.get(self.pos) else {
            return err("Unterminated string");
        };
        self.pos += 1;
        Ok(match e {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let hi = self.hex4()?;
                if (0xd800..0xdc00).contains(&hi) && self.text[self.pos..].starts_with("\\u") {
                    let save = self.pos;
                    self.pos += 2;
                    let lo = self.hex4()?;
                    if (0xdc00..0xe000).contains(&lo) {
                        let c = 0x10000 + ((hi - 0xd800) << 10) + (lo - 0xdc00);
                        return Ok(char::from_u32(c).unwrap_or('\u{fffd}'));
                    }
                    self.pos = save;
                }
                char::from_u32(hi).unwrap_or('\u{fffd}')
            }
            _ => return err("Invalid \\escape"),
        })
    }

    fn array(&mut self) -> Result<PyValue, ValueError> {
        self.pos += 1;
        let mut items = Vec::new();
        self.ws();
        if self.eat("]") {
            return Ok(PyValue::List(items));
        }
        loop {
            self.ws();
            items.push(self.value()?);
            self.ws();
            if self.eat("]") {
                return Ok(PyValue::List(items));
            }
            if !self.eat(",") {
                return err("Expecting ',' delimiter");
            }
        }
    }

    fn object(&mut self) -> Result<PyValue, ValueError> {
        self.pos += 1;
        let mut items = Vec::new();
        self.ws();
        if self.eat("}") {
            return Ok(PyValue::Dict(items));
        }
        loop {
            self.ws();
            if self.s.get(self.pos) != Some(&b'"') {
                return err("Expecting property name enclosed in double quotes");
            }
            let key = self.string()?;
            self.ws();
            if !self.eat(":") {
                return err("Expecting ':' delimiter");
            }
            self.ws();
            let value = self.value()?;
            PyValue::dict_set(&mut items, PyValue::Str(key), value);
            self.ws();
            if self.eat("}") {
                return Ok(PyValue::Dict(items));
            }
            if !self.eat(",") {
                return err("Expecting ',' delimiter");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_then_dumps_is_pythons() {
        // Expected: json.dumps(json.loads(s), ensure_ascii=False) in Python 3.11.
        let cases = [
            (
                r#"{"b": 1, "a": [1.0, 2e3, -0, "x\u00e9\n"], "c": null}"#,
                r#"{"b": 1, "a": [1.0, 2000.0, 0, "xé\n"], "c": null}"#,
            ),
            (r#"  {"k":"v","k":2} "#, r#"{"k": 2}"#),
            (r#""tab\there \ud83d\ude00""#, r#""tab\there 😀""#),
            (
                "123456789012345678901234567890123456789012",
                "123456789012345678901234567890123456789012",
            ),
            (r#"[NaN, -Infinity, true]"#, r#"[NaN, -Infinity, true]"#),
            ("\"\u{1}\u{7f}\"", r#""\u0001""#),
        ];
        for (src, want) in cases {
            let strict = !src.contains('\u{1}');
            let v = loads(src, strict).unwrap();
            let got = v.dumps().unwrap();
            if src.contains('\u{1}') {
                assert_eq!(got, "\"\\u0001\u{7f}\"");
            } else {
                assert_eq!(got, want, "{src}");
            }
        }
        assert!(loads("\"a\u{1}\"", true).is_err());
        assert!(loads("{\"a\": 1,}", true).is_err());
        assert!(loads("[1] x", true).is_err());
        assert_eq!(raw_decode("x {\"a\": 1} tail", 2).unwrap().1, 10);
    }
}
