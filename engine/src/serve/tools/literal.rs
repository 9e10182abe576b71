//! Python literals as `ast.literal_eval` reads them (numbers, strings, True / False /
//! None, lists, tuples, dicts, signed numbers), and the call lists the pythonic parser
//! reads with `ast.parse` (`[name(key=literal, …), …]`, where `true` / `false` / `null`
//! stand for True / False / None as chat templates render them). Anything else is an
//! error, which is where mlx-lm's parsers fall back or give up too.

use super::value::{err, PyValue, ValueError};

const KEYWORDS: [&str; 35] = [
    "False", "None", "True", "and", "as", "assert", "async", "await", "break", "class", "continue",
    "def", "del", "elif", "else", "except", "finally", "for", "from", "global", "if", "import",
    "in", "is", "lambda", "nonlocal", "not", "or", "pass", "raise", "return", "try", "while",
    "with", "yield",
];

/// `ast.literal_eval(text)` (leading spaces and tabs stripped, as 3.11 does).
pub fn literal_eval(text: &str) -> Result<PyValue, ValueError> {
    let mut p = Reader::new(text.trim_start_matches([' ', '\t']), false);
    let v = p.top()?;
    p.end()?;
    Ok(v)
}

/// A call of the pythonic format: dotted name and keyword arguments, in order.
pub type Call = (String, Vec<(String, PyValue)>);

/// `[f(a=1), g.h(b="x")]` as the pythonic parser's `ast.parse` path reads it; None where
/// that path gives None or raises (the caller then tries its regex).
pub fn call_list(text: &str) -> Option<Vec<Call>> {
    let mut p = Reader::new(text, true);
    p.ws();
    if !p.eat("[") {
        return None;
    }
    let mut calls = Vec::new();
    loop {
        p.ws();
        if p.eat("]") {
            break;
        }
        calls.push(p.call().ok()?);
        p.ws();
        if p.eat("]") {
            break;
        }
        if !p.eat(",") {
            return None;
        }
    }
    p.end().ok()?;
    (!calls.is_empty()).then_some(calls)
}

struct Reader<'a> {
    s: &'a str,
    pos: usize,
    /// `true` / `false` / `null` are literals (the pythonic parser's `_JSONLiterals`).
    json_names: bool,
}

impl<'a> Reader<'a> {
    fn new(s: &'a str, json_names: bool) -> Self {
        Reader {
            s,
            pos: 0,
            json_names,
        }
    }

    fn rest(&self) -> &'a str {
        &self.s[self.pos..]
    }

    fn peek(&self) -> Option<char> {
        self.rest().chars().next()
    }

    /// Whitespace, newlines (we are inside brackets or at the ends) and comments.
    fn ws(&mut self) {
        loop {
            let r = self.rest();
            let t = r.trim_start_matches([' ', '\t', '\n', '\r', '\x0c']);
            self.pos += r.len() - t.len();
            if let Some(stripped) = t.strip_prefix("\\\n") {
                self.pos += t.len() - stripped.len();
            } else if t.starts_with('#') {
                self.pos += t.find('\n').unwrap_or(t.len());
            } else {
                return;
            }
        }
    }

    fn eat(&mut self, lit: &str) -> bool {
        if self.rest().starts_with(lit) {
            self.pos += lit.len();
            true
        } else {
            false
        }
    }

    fn end(&mut self) -> Result<(), ValueError> {
        self.ws();
        if self.pos == self.s.len() {
            Ok(())
        } else {
            err("malformed node or string")
        }
    }

    fn ident(&mut self) -> Option<&'a str> {
        let r = self.rest();
        let mut chars = r.char_indices();
        let (_, first) = chars.next()?;
        if !(first.is_alphabetic() || first == '_') {
            return None;
        }
        let len = chars
            .find(|(_, c)| !(c.is_alphanumeric() || *c == '_'))
            .map_or(r.len(), |(i, _)| i);
        self.pos += len;
        Some(&r[..len])
    }

    fn call(&mut self) -> Result<Call, ValueError> {
        let mut name = String::new();
        loop {
            self.ws();
            match self.ident() {
                Some(id) if !KEYWORDS.contains(&id) => name.push_str(id),
                _ => return err("not a call"),
            }
            self.ws();
            if !self.eat(".") {
                break;
            }
            name.push('.');
        }
        if !self.eat("(") {
            return err("not a call");
        }
        let mut args: Vec<(String, PyValue)> = Vec::new();
        loop {
            self.ws();
            if self.eat(")") {
                return Ok((name, args));
            }
            let key = match self.ident() {
                Some(id) if !KEYWORDS.contains(&id) => id.to_owned(),
                _ => return err("positional argument"),
            };
            self.ws();
            if !self.eat("=") || self.rest().starts_with('=') {
                return err("positional argument");
            }
            self.ws();
            let value = self.expr()?;
            if args.iter().any(|(k, _)| *k == key) {
                return err("keyword argument repeated");
            }
            args.push((key, value));
            self.ws();
            if self.eat(")") {
                return Ok((name, args));
            }
            if !self.eat(",") {
                return err("expected ,");
            }
        }
    }

    /// A top-level expression: a bare tuple (`1, 2`) is allowed.
    fn top(&mut self) -> Result<PyValue, ValueError> {
        self.ws();
        let first = self.expr()?;
        self.ws();
        if !self.rest().starts_with(',') {
            return Ok(first);
        }
        let mut items = vec![first];
        while self.eat(",") {
            self.ws();
            if self.pos == self.s.len() {
                break;
            }
            items.push(self.expr()?);
            self.ws();
        }
        Ok(PyValue::Tuple(items))
    }

    fn expr(&mut self) -> Result<PyValue, ValueError> {
        self.ws();
        let Some(c) = self.peek() else {
            return err("unexpected end");
        };
        match c {
            '[' => {
                self.pos += 1;
                Ok(PyValue::List(self.items("]")?.0))
            }
            '(' => {
                self.pos += 1;
                let (items, comma) = self.items(")")?;
                match (items.len(), comma) {
                    (1, false) => Ok(items.into_iter().next().unwrap_or(PyValue::None)),
                    _ => Ok(PyValue::Tuple(items)),
                }
            }
            '{' => {
                self.pos += 1;
                self.dict_or_set()
            }
            '+' | '-' => {
                self.pos += 1;
                self.ws();
                match self.number()? {
                    PyValue::Int(i) if c == '-' => Ok(PyValue::Int(-i)),
                    PyValue::Float(x) if c == '-' => Ok(PyValue::Float(-x)),
                    v => Ok(v),
                }
            }
            '0'..='9' | '.' => self.number(),
            _ => self.name_or_string(),
        }
    }

    fn name_or_string(&mut self) -> Result<PyValue, ValueError> {
        let save = self.pos;
        if let Some(id) = self.ident() {
            let quote = self.peek();
            if matches!(quote, Some('"' | '\'')) && id.len() <= 2 {
                self.pos = save;
                return self.strings();
            }
            return match id {
                "True" => Ok(PyValue::Bool(true)),
                "False" => Ok(PyValue::Bool(false)),
                "None" => Ok(PyValue::None),
                "true" if self.json_names => Ok(PyValue::Bool(true)),
                "false" if self.json_names => Ok(PyValue::Bool(false)),
                "null" if self.json_names => Ok(PyValue::None),
                _ => err("malformed node or string"),
            };
        }
        self.strings()
    }

    /// Comma-separated expressions up to `close`; whether a comma was seen.
    fn items(&mut self, close: &str) -> Result<(Vec<PyValue>, bool), ValueError> {
        let mut items = Vec::new();
        let mut comma = false;
        loop {
            self.ws();
            if self.eat(close) {
                return Ok((items, comma));
            }
            items.push(self.expr()?);
            self.ws();
            if self.eat(close) {
                return Ok((items, comma));
            }
            if !self.eat(",") {
                return err("expected ,");
            }
            comma = true;
        }
    }

    fn dict_or_set(&mut self) -> Result<PyValue, ValueError> {
        let mut items = Vec::new();
        loop {
            self.ws();
            if self.eat("}") {
                return Ok(PyValue::Dict(items));
            }
            let key = self.expr()?;
            self.ws();
            if !self.eat(":") {
                // A set: literal_eval gives one, json.dumps cannot write it.
                return err("a set is not JSON serializable");
            }
            let value = self.expr()?;
            if matches!(key, PyValue::List(_) | PyValue::Dict(_)) {
                return err("unhashable type");
            }
            PyValue::dict_set(&mut items, key, value);
            self.ws();
            if self.eat("}") {
                return Ok(PyValue::Dict(items));
            }
            if !self.eat(",") {
                return err("expected ,");
            }
        }
    }

    fn number(&mut self) -> Result<PyValue, ValueError> {
        let r = self.rest();
        let len = r
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.'))
            .unwrap_or(r.len());
        // An exponent's sign: 1e-5, 2E+3.
        let mut len = len;
        while len > 0
            && len < r.len()
            && matches!(r.as_bytes()[len], b'+' | b'-')
            && matches!(r.as_bytes()[len - 1], b'e' | b'E')
            && !r[..len].starts_with("0x")
            && !r[..len].starts_with("0X")
        {
            len += 1;
            len += r[len..]
                .find(|c: char| !(c.is_ascii_digit() || c == '_'))
                .unwrap_or(r.len() - len);
        }
        let lit = &r[..len];
        self.pos += len;
        parse_number(lit)
    }

    /// One or more adjacent string literals (concatenated, as Python does).
    fn strings(&mut self) -> Result<PyValue, ValueError> {
        let mut out = String::new();
        let mut any = false;
        loop {
            let save = self.pos;
            if any {
                self.ws();
            }
            let prefix_len = self
                .rest()
                .find(['"', '\''])
                .filter(|&n| n <= 2 && self.rest()[..n].chars().all(|c| c.is_ascii_alphabetic()));
            let Some(n) = prefix_len else {
                self.pos = save;
                break;
            };
            let prefix = self.rest()[..n].to_ascii_lowercase();
            if !["", "r", "u"].contains(&prefix.as_str()) {
                // bytes and f-strings are not JSON values / not literals.
                return err("unsupported string prefix");
            }
            self.pos += n;
            out.push_str(&self.string_body(prefix == "r")?);
            any = true;
        }
        if any {
            Ok(PyValue::Str(out))
        } else {
            err("malformed node or string")
        }
    }

    fn string_body(&mut self, raw: bool) -> Result<String, ValueError> {
        let r = self.rest();
        let q = &r[..1];
        let triple = r.starts_with(&q.repeat(3));
        let close = if triple { q.repeat(3) } else { q.to_owned() };
        self.pos += close.len();
        let mut out = String::new();
        loop {
            let r = self.rest();
            if r.starts_with(&close) {
                self.pos += close.len();
                return Ok(out);
            }
            let Some(c) = r.chars().next() else {
                return err("unterminated string literal");
            };
            self.pos += c.len_utf8();
            match c {
                '\n' if !triple => return err("unterminated string literal"),
                '\\' if raw => {
                    out.push('\\');
                    if let Some(n) = self.peek() {
                        out.push(n);
                        self.pos += n.len_utf8();
                    }
                }
                '\\' => self.escape(&mut out)?,
                c => out.push(c),
            }
        }
    }

    fn escape(&mut self, out: &mut String) -> Result<(), ValueError> {
        let Some(e) = self.peek() else {
            return err("unterminated string literal");
        };
        self.pos += e.len_utf8();
        let hex = |p: &mut Self, n: usize| -> Result<char, ValueError> {
            let h = p
                .rest()
                .get(..n)
                .filter(|h| h.chars().all(|c| c.is_ascii_hexdigit()));
            let h = h.ok_or_else(|| ValueError("truncated escape".into()))?;
            p.pos += n;
            char::from_u32(u32::from_str_radix(h, 16).unwrap_or(u32::MAX))
                .ok_or_else(|| ValueError("illegal Unicode character".into()))
        };
        match e {
            '\n' => {}
            '\\' | '\'' | '"' => out.push(e),
            'n' => out.push('\n'),
            't' => out.push('\t'),
            'r' => out.push('\r'),
            'a' => out.push('\u{7}'),
            'b' => out.push('\u{8}'),
            'f' => out.push('\u{c}'),
            'v' => out.push('\u{b}'),
            'x' => out.push(hex(self, 2)?),
            'u' => out.push(hex(self, 4)?),
            'U' => out.push(hex(self, 8)?),
            '0'..='7' => {
                let mut v = e as u32 - '0' as u32;
                for _ in 0..2 {
                    match self.peek() {
                        Some(d @ '0'..='7') => {
                            v = v * 8 + (d as u32 - '0' as u32);
                            self.pos += 1;
                        }
                        _ => break,
                    }
                }
                out.push(char::from_u32(v).unwrap_or('\u{fffd}'));
            }
            'N' => return err("named escapes are not supported"),
            other => {
                out.push('\\');
                out.push(other);
            }
        }
        Ok(())
    }
}

/// A Python numeric literal (ints in any base, floats; underscores between digits).
fn parse_number(lit: &str) -> Result<PyValue, ValueError> {
    let bad = || ValueError(format!("invalid number literal {lit:?}"));
    if lit.is_empty() || lit.ends_with(['j', 'J']) || lit.contains("__") || lit.ends_with('_') {
        return Err(bad());
    }
    let lower = lit.to_ascii_lowercase();
    for (prefix, radix) in [("0x", 16), ("0o", 8), ("0b", 2)] {
        if let Some(digits) = lower.strip_prefix(prefix) {
            let digits = digits.strip_prefix('_').unwrap_or(digits).replace('_', "");
            return i128::from_str_radix(&digits, radix)
                .map(PyValue::Int)
                .map_err(|_| bad());
        }
    }
    let clean = lit.replace('_', "");
    if clean.chars().all(|c| c.is_ascii_digit()) {
        if clean.len() > 1 && clean.starts_with('0') && clean.chars().any(|c| c != '0') {
            return Err(bad());
        }
        return clean.parse::<i128>().map(PyValue::Int).map_err(|_| bad());
    }
    if !clean
        .chars()
        .all(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '+' | '-'))
        || lit.contains("_.")
        || lit.contains("._")
    {
        return Err(bad());
    }
    clean.parse::<f64>().map(PyValue::Float).map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dumped(text: &str) -> Result<String, ValueError> {
        literal_eval(text)?.dumps()
    }

    #[test]
    fn literal_eval_reads_what_python_reads() {
        // Expected: json.dumps(ast.literal_eval(s), ensure_ascii=False) in Python 3.11.
        let cases = [
            ("42", "42"),
            ("-3.5", "-3.5"),
            ("1_000", "1000"),
            ("0x1F", "31"),
            ("1e3", "1000.0"),
            (".5", "0.5"),
            (
                "  [1, 'a', \"b\", None, True]",
                "[1, \"a\", \"b\", null, true]",
            ),
            ("(1,)", "[1]"),
            ("(1)", "1"),
            ("1, 2", "[1, 2]"),
            ("{'a': 1, 2: 'b', 'a': 3}", "{\"a\": 3, \"2\": \"b\"}"),
            ("'x\\ny' 'z'", "\"x\\nyz\""),
            ("r'a\\d'", "\"a\\\\d\""),
            ("'\\u00e9\\x41'", "\"éA\""),
            ("'''tri\nple'''", "\"tri\\nple\""),
        ];
        for (src, want) in cases {
            assert_eq!(dumped(src).as_deref(), Ok(want), "{src:?}");
        }
        for bad in [
            "hello", "true", "{1, 2}", "b'x'", "1 +", "f(x)", "01", "--1",
        ] {
            assert!(dumped(bad).is_err(), "{bad:?} should not evaluate");
        }
    }

    #[test]
    fn call_lists_read_keyword_calls_only() {
        let calls = call_list("[get_weather(city='Paris', days=3), a.b(x=true, y=null)]").unwrap();
        assert_eq!(calls[0].0, "get_weather");
        assert_eq!(calls[1].0, "a.b");
        assert_eq!(calls[1].1[0], ("x".to_owned(), PyValue::Bool(true)));
        for bad in [
            "[f(1)]",
            "[f(a=1, a=2)]",
            "[]",
            "[f(a=1)] x",
            "[f(**k)]",
            "[x]",
            "[f(a=g())]",
        ] {
            assert!(call_list(bad).is_none(), "{bad:?}");
        }
    }
}
