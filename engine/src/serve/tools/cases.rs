//! The tool parsers against mlx-lm 0.32.2's on the same texts: each expected output is
//! what `mlx_lm.tool_parsers.<family>.parse_tool_call(text, TOOLS)` returned, its
//! arguments dumped as ToolCallFormatter dumps them (`json.dumps(…, ensure_ascii=False)`),
//! or `None` where it raised.

use super::Family;

/// The tools list every case was parsed with (qwen3_coder reads parameter types from it).
pub const TOOLS: &str = r#"[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"}, "metric": {"type": "boolean"}, "tags": {"type": "array"}, "opts": {"type": "object"}, "any": {}, "t": {"type": "tuple"}}}}}]"#;

/// (family, text, Some([(name, arguments, id)]) or None for an error).
#[allow(clippy::type_complexity)]
pub const CASES: &[(&str, &str, Option<&[(&str, &str, Option<&str>)]>)] = &[
    (
        r#"json_tools"#,
        r#"{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}"#,
        Some(&[(r#"get_weather"#, r#"{"city": "Paris", "days": 3}"#, None)]),
    ),
    (
        r#"json_tools"#,
        r#"
{"name":"f","arguments":{"b":1.0,"a":[1e-5,true,null,"é"]}}
"#,
        Some(&[(r#"f"#, r#"{"b": 1.0, "a": [1e-05, true, null, "é"]}"#, None)]),
    ),
    (
        r#"json_tools"#,
        r#"[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": "y"}, "id": "call_7"}]"#,
        Some(&[
            (r#"a"#, r#"{}"#, None),
            (r#"b"#, r#"{"x": "y"}"#, Some(r#"call_7"#)),
        ]),
    ),
    (
        r#"json_tools"#,
        r#"{"name": "f", "arguments": "already a string"}"#,
        Some(&[(r#"f"#, r#""already a string""#, None)]),
    ),
    (
        r#"json_tools"#,
        r#"{"name": "f", "arguments": {"q": "line\nnext \"quoted\" \\ tab\t"}}"#,
        Some(&[(r#"f"#, r#"{"q": "line\nnext \"quoted\" \\ tab\t"}"#, None)]),
    ),
    (
        r#"json_tools"#,
        r#"{"name": "f", "arguments": {"n": 12345678901234567890123}}"#,
        Some(&[(r#"f"#, r#"{"n": 12345678901234567890123}"#, None)]),
    ),
    (
        r#"json_tools"#,
        r#"{"name": "f", "arguments": {"x": 1}"#,
        None,
    ),
    (
        r#"qwen3_coder"#,
        r#"
<function=get_weather>
<parameter=city>
Paris
</parameter>
<parameter=days>
3
</parameter>
</function>
"#,
        Some(&[(r#"get_weather"#, r#"{"city": "Paris", "days": 3}"#, None)]),
    ),
    (
        r#"qwen3_coder"#,
        r#"<function=get_weather>
<parameter=temp>
21.5
</parameter>
<parameter=days>
2.0
</parameter>
<parameter=metric>
True
</parameter>
</function>"#,
        Some(&[(
            r#"get_weather"#,
            r#"{"temp": 21.5, "days": 2, "metric": true}"#,
            None,
        )]),
    ),
    (
        r#"qwen3_coder"#,
        r#"<function=get_weather>
<parameter=tags>
["a", "b"]
</parameter>
<parameter=opts>
{"k": 1}
</parameter>
<parameter=any>
[1, 2]
</parameter>
<parameter=t>
(1, 2)
</parameter>
</function>
"#,
        Some(&[(
            r#"get_weather"#,
            r#"{"tags": ["a", "b"], "opts": {"k": 1}, "any": "[1, 2]", "t": [1, 2]}"#,
            None,
        )]),
    ),
    (
        r#"qwen3_coder"#,
        r#"<function=get_weather>
<parameter=city>
null
</parameter>
<parameter=unknown>
42
</parameter>
<parameter=any>
plain
</parameter>
</function>"#,
        Some(&[(
            r#"get_weather"#,
            r#"{"city": null, "unknown": "42", "any": "plain"}"#,
            None,
        )]),
    ),
    (
        r#"qwen3_coder"#,
        r#"<function=other>
<parameter=days>
3
</parameter>
</function>
"#,
        Some(&[(r#"other"#, r#"{"days": "3"}"#, None)]),
    ),
    (
        r#"qwen3_coder"#,
        r#"<function=get_weather>
<parameter=days>
2.5
</parameter>
</function>"#,
        None,
    ),
    (
        r#"qwen3_coder"#,
        r#"<function=get_weather>
<parameter=city>
Paris
</parameter>
"#,
        None,
    ),
    (
        r#"qwen3_coder"#,
        r#"<function= spaced>
<parameter= key>
v
</parameter>
</function>"#,
        Some(&[(r#"spaced"#, r#"{"key": "v"}"#, None)]),
    ),
    (
        r#"gemma4"#,
        r#"call:get_weather{city:<|"|>Paris<|"|>,days:3}"#,
        Some(&[(r#"get_weather"#, r#"{"city": "Paris", "days": 3}"#, None)]),
    ),
    (
        r#"gemma4"#,
        r#"call:get_weather{city:<|"|>a, b: {c}<|"|>,opts:{deep:true,list:[1,2]}}call:noop{}"#,
        Some(&[
            (
                r#"get_weather"#,
                r#"{"city": "a, b: {c}", "opts": {"deep": true, "list": [1, 2]}}"#,
                None,
            ),
            (r#"noop"#, r#"{}"#, None),
        ]),
    ),
    (
        r#"gemma4"#,
        r#"call:f-x{msg:<|"|>say "hi"
<|"|>}"#,
        Some(&[(r#"f-x"#, r#"{"msg": "say \"hi\"\n"}"#, None)]),
    ),
    (r#"gemma4"#, r#"call:f{a:1"#, None),
    (r#"gemma4"#, r#"nothing here"#, None),
    (
        r#"function_gemma"#,
        r#"call:get_weather{city:<escape>Paris<escape>,days:3}"#,
        Some(&[(r#"get_weather"#, r#"{"city": "Paris", "days": 3}"#, None)]),
    ),
    (
        r#"function_gemma"#,
        r#"call:get_weather{days:3,flag:true,name:bare words}"#,
        Some(&[(
            r#"get_weather"#,
            r#"{"days": 3, "flag": true, "name": "bare words"}"#,
            None,
        )]),
    ),
    (
        r#"function_gemma"#,
        r#"call:f{a:<escape>x, y<escape>}"#,
        Some(&[(r#"f"#, r#"{"a": "x, y"}"#, None)]),
    ),
    (
        r#"function_gemma"#,
        r#"call:f{}"#,
        Some(&[(r#"f"#, r#"{}"#, None)]),
    ),
    (r#"function_gemma"#, r#"call:f{noval}"#, None),
    (
        r#"mistral"#,
        r#"[{"name": "get_weather", "arguments": {"city": "Paris"}}]"#,
        Some(&[(r#"get_weather"#, r#"{"city": "Paris"}"#, None)]),
    ),
    (
        r#"mistral"#,
        r#"[{"name": "a", "arguments": "{\"x\": 1}", "id": "abc123XYZ"}]"#,
        Some(&[(r#"a"#, r#"{"x": 1}"#, Some(r#"abc123XYZ"#))]),
    ),
    (
        r#"mistral"#,
        r#"get_weather[ARGS]{"city": "Paris"}"#,
        Some(&[(r#"get_weather"#, r#"{"city": "Paris"}"#, None)]),
    ),
    (
        r#"mistral"#,
        r#"a[ARGS]{"x": 1} b [ARGS] {"y": [2]}"#,
        Some(&[
            (r#"a"#, r#"{"x": 1}"#, None),
            (r#"b"#, r#"{"y": [2]}"#, None),
        ]),
    ),
    (r#"mistral"#, r#"[{"name": 5, "arguments": {}}]"#, None),
    (r#"mistral"#, r#"get_weather[ARGS]{"city": "#, None),
    (r#"mistral"#, r#"plain text"#, None),
    (
        r#"pythonic"#,
        r#"[get_weather(city="Paris", days=3)]"#,
        Some(&[(r#"get_weather"#, r#"{"city": "Paris", "days": 3}"#, None)]),
    ),
    (
        r#"pythonic"#,
        r#"[get_weather(city='Paris'), lookup.item(id=7, flags=[true, false, null], m={'a': 1.5})]"#,
        Some(&[
            (r#"get_weather"#, r#"{"city": "Paris"}"#, None),
            (
                r#"lookup.item"#,
                r#"{"id": 7, "flags": [true, false, null], "m": {"a": 1.5}}"#,
                None,
            ),
        ]),
    ),
    (
        r#"pythonic"#,
        r#"[f(a=1)]"#,
        Some(&[(r#"f"#, r#"{"a": 1}"#, None)]),
    ),
    (
        r#"pythonic"#,
        r#"[f(x=undefined_name, y=2)]"#,
        Some(&[(r#"f"#, r#"{"x": "undefined_name", "y": 2}"#, None)]),
    ),
    (
        r#"pythonic"#,
        r#"[f(a="unterminated, b=2)]"#,
        Some(&[(r#"f"#, r#"{"a": "\"unterminated", "b": 2}"#, None)]),
    ),
    (
        r#"pythonic"#,
        r#"[get_weather(city=Paris, days= 3 )]"#,
        Some(&[(r#"get_weather"#, r#"{"city": "Paris", "days": 3}"#, None)]),
    ),
    (r#"pythonic"#, r#"no call at all"#, None),
    (
        r#"pythonic"#,
        r#"[f(1, 2)]"#,
        Some(&[(r#"f"#, r#"{}"#, None)]),
    ),
];

#[test]
fn every_parser_gives_what_mlx_lm_gives() {
    let tools: serde_json::Value = serde_json::from_str(TOOLS).unwrap();
    for (family, text, want) in CASES {
        let f = Family::from_name(family).unwrap();
        let got = f.parse(text, Some(&tools)).ok().map(|calls| {
            calls
                .iter()
                .map(|c| {
                    let name = match c.get("name") {
                        Some(super::value::PyValue::Str(s)) => s.clone(),
                        other => format!("{other:?}"),
                    };
                    let args = c.get("arguments").unwrap().dumps().unwrap();
                    let id = match c.get("id") {
                        Some(super::value::PyValue::Str(s)) => Some(s.clone()),
                        _ => None,
                    };
                    (name, args, id)
                })
                .collect::<Vec<_>>()
        });
        let want = want.map(|w| {
            w.iter()
                .map(|(n, a, i)| (n.to_string(), a.to_string(), i.map(str::to_owned)))
                .collect::<Vec<_>>()
        });
        assert_eq!(got, want, "{family} on {text:?}");
    }
}
