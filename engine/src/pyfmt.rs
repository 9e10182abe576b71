//! The text Python writes for values, shared by the chat templates (`tojson`, `str()`) and
//! the tool parsers (`json.dumps` of parsed arguments): `repr(float)`, a float as
//! `json.dumps` writes it, a JSON string literal (with or without `ensure_ascii`), and
//! `json.dumps`' layout (`indent`, `separators`).

use std::fmt::Write;

/// The options of `json.dumps` that transformers' `tojson` exposes (the tool parsers use
/// the defaults with `ensure_ascii` off).
#[derive(Debug, Clone, Default)]
pub struct DumpOptions {
    pub ensure_ascii: bool,
    /// `None`: one line; `Some(s)`: newlines, each level indented by `s`.
    pub indent: Option<String>,
    /// (item separator, key separator); Python's defaults are (", ", ": "), or (",", ": ")
    /// with an indent.
    pub separators: Option<(String, String)>,
    pub sort_keys: bool,
}

impl DumpOptions {
    /// The (item, key) separators `json.dumps` uses with these options.
    pub fn separators(&self) -> (&str, &str) {
        match (&self.separators, &self.indent) {
            (Some((i, k)), _) => (i.as_str(), k.as_str()),
            (None, Some(_)) => (",", ": "),
            (None, None) => (", ", ": "),
        }
    }

    /// With an indent, a newline and `level` indents; without one, nothing.
    pub fn newline(&self, level: usize, out: &mut String) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    }
}

/// A JSON string literal as Python's json module writes it (`ensure_ascii`: everything
/// outside printable ASCII as `\uXXXX`, astral characters as surrogate pairs).
pub fn json_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A float as `json.dumps` writes it: Python's repr, `NaN`, `Infinity`, `-Infinity`.
pub fn json_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    float_repr(x)
}

/// Python's `repr(float)`: the shortest digits that round-trip, positional for exponents
/// -4 ≤ e < 16, else `d.ddde±XX`; `nan`, `inf`, `-inf`.
pub fn float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    // `{:e}` gives the shortest round-trip digits: "-1.2345e-7" (and "-0e0" for -0.0).
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if !(-4..16).contains(&exp) {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{first}{frac}e{esign}{:02}", exp.abs());
    }
    let point = exp + 1;
    let body = if point <= 0 {
        format!("0.{}{digits}", "0".repeat((-point) as usize))
    } else if point as usize >= digits.len() {
        format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
    } else {
        let (int, frac) = digits.split_at(point as usize);
        format!("{int}.{frac}")
    };
    format!("{sign}{body}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_repr() {
        // Expected strings: Python 3.11 `repr(x)` / `json.dumps(x)`.
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (1e15, "1000000000000000.0"),
            (123456789012345.0, "123456789012345.0"),
            (123456789012345680.0, "1.2345678901234568e+17"),
            (0.0001, "0.0001"),
            (1e-5, "1e-05"),
            (1.2345e-7, "1.2345e-07"),
            (2.71234, "2.71234"),
            (1e300, "1e+300"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
        ];
        for (x, want) in cases {
            assert_eq!(float_repr(x), want, "{x}");
            assert_eq!(json_float(x), want, "{x}");
        }
        assert_eq!(float_repr(f64::NAN), "nan");
        assert_eq!(float_repr(f64::NEG_INFINITY), "-inf");
        assert_eq!(json_float(f64::NAN), "NaN");
        assert_eq!(json_float(f64::INFINITY), "Infinity");
        assert_eq!(json_float(f64::NEG_INFINITY), "-Infinity");
    }

    #[test]
    fn strings_are_json_module_literals() {
        // Expected: json.dumps(s) and json.dumps(s, ensure_ascii=False).
        let s = "é😀\u{7f} <&> \"q\"\\\n\r\t\u{8}\u{c}\u{1}";
        let mut ascii = String::new();
        json_string(s, true, &mut ascii);
        assert_eq!(
            ascii,
            r#""\u00e9\ud83d\ude00\u007f <&> \"q\"\\\n\r\t\b\f\u0001""#
        );
        let mut raw = String::new();
        json_string(s, false, &mut raw);
        assert_eq!(raw, "\"é😀\u{7f} <&> \\\"q\\\"\\\\\\n\\r\\t\\b\\f\\u0001\"");
    }

    #[test]
    fn layout_is_json_dumps() {
        let d = DumpOptions::default();
        assert_eq!(d.separators(), (", ", ": "));
        let indented = DumpOptions {
            indent: Some("  ".into()),
            ..d.clone()
        };
        assert_eq!(indented.separators(), (",", ": "));
        let mut out = String::new();
        indented.newline(2, &mut out);
        assert_eq!(out, "\n    ");
        let compact = DumpOptions {
            separators: Some((",".into(), ":".into())),
            ..d
        };
        assert_eq!(compact.separators(), (",", ":"));
    }
}
