"""Tool-parser goldens: what mlx-lm 0.32.2's own parsers (`mlx_lm.tool_parsers.<name>`) make
of tool-call texts, and what its server's text state machine makes of whole answers.

    oracles/.venv/bin/python oracles/gen_tool_parsers.py

Parsers: glm47 (GLM-4.5 / 4.6 / 4.7, glm4_moe and glm4_moe_lite templates; laguna is the same
module), kimi_k2 (Kimi K2 / K2.5), minimax_m2 (MiniMax M2), longcat. Each case is a text as the
server hands it to the parser (the markers already cut out), parsed with TOOLS or with no tools
(`"tools": false`). The expected output is ToolCallFormatter's view of the result: a dict
becomes a one-call list, each call keeps its keys in order with `arguments` written by
`json.dumps(…, ensure_ascii=False)`; or, where the parser raised, the exception's type and
message (mlx_lm.server drops a ValueError / JSONDecodeError with a warning and fails the
request on any other; the engine drops both with a warning).

Streams: a whole answer (reasoning, text, tool calls) cut into pieces, run through
`make_text_state_machine`'s transitions for the family's markers (`<think>` … `</think>`,
the parser's tool_call_start / tool_call_end) and collected as mlx_lm.server's
handle_completion collects it: the reasoning, the content, and the calls the finished tool
texts parse to (unparsable ones dropped).

Output: goldens/tool_parsers/index.json (text only, no machine layer).
"""

import importlib
import json

from mlx_lm.generate import TextStateMachine

from provenance import GOLDENS, provenance, write_json

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
        "metric": {"type": "boolean"}, "tags": {"type": "array"}, "opts": {"type": "object"},
        "unit": {"enum": ["c", "f"]}, "maybe": {"type": ["integer", "null"]},
        "either": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "any": {}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "ping", "parameters": None}},
]

GLM = [
    ("single call", "get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"),
    ("typed values, newlines between tags",
     "get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
     "<arg_key>temp</arg_key>\n<arg_value>-1.5e1</arg_value>\n<arg_key>metric</arg_key>\n<arg_value>true</arg_value>\n"),
    ("nested JSON and a Python literal",
     'get_weather<arg_key>opts</arg_key><arg_value>{"deep": {"list": [1, 2, {"x": null}]}}</arg_value>'
     "<arg_key>tags</arg_key><arg_value>['a', (1, 2), None]</arg_value><arg_key>any</arg_key><arg_value>not json</arg_value>"),
    ("quotes, backslashes, newlines and unicode in a string argument",
     'search<arg_key>query</arg_key><arg_value>  say "hi"\\n to Zoë 東京 🌧\n second line  </arg_value>'),
    ("literal backslash-n separators and a repeated key",
     "search<arg_key> limit </arg_key>\\n\\n <arg_value> 5 </arg_value><arg_key>limit</arg_key><arg_value>7</arg_value>"),
    ("a key whose value tag never follows (the key runs on to the next pair)",
     "search<arg_key>a</arg_key>junk<arg_key>b</arg_key><arg_value>1</arg_value>"),
    ("an unclosed value", "search<arg_key>query</arg_key><arg_value>cut off"),
    ("no tools: every value deserialized", "search<arg_key>query</arg_key><arg_value>123</arg_value>", False),
    ("JSON payload", '{"name": "get_weather", "arguments": {"city": 7, "days": "4", "tags": [1, "a"]}}'),
    ("JSON list, function key, arguments as a string",
     '[{"function": "search", "arguments": "{\\"query\\": [1, true, null], \\"limit\\": \\"2\\"}"}, {"name": "x"}]'),
    ("JSON with a nested tool object", '{"tool": {"name": "ping"}}'),
    ("JSON with a name object", '{"name": {"name": "search", "arguments": {"limit": 1.5}}, "arguments": null}'),
    ("JSON without a usable name", '{"name": 5, "arguments": {}}'),
    ("name, newline, JSON object", 'get_weather\n{"city": {"a": 1}, "days": "2"}'),
    ("plain name only", "  ping  "),
    ("name and JSON on one line", 'search {"query": "x y", "limit": "10"}'),
    ("key=value pairs with shell quoting",
     "get_weather city=\"New York\" days=3 metric=True tags='[1, 2]' opts=a\\ b"),
    ("key=value pairs with an unclosed quote", 'get_weather city="Paris days=3'),
    ("free text after a name", "search for the weather please"),
    ("empty", "   "),
    ("name with text around (reasoning-like prose before it)",
     "I will call it.\nget_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"),
    ("a key with no close before the value", "f<arg_key>a<arg_value>1</arg_value>"),
    ("a JSON list of numbers", "[1, 2]"),
    ("key=value with an empty key", 'search query="a\\"b\\\\c\\d" =5'),
    ("information separators around a bare name", "\x1cping\x1f"),
    ("JSON arguments null", '{"name": "ping", "arguments": null}'),
    ("JSON arguments a list", '{"name": "ping", "arguments": [1]}'),
]

KIMI = [
    ("one call in a section",
     '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'),
    ("two calls, whitespace between",
     ' <|tool_call_begin|> functions.get_weather:0 <|tool_call_argument_begin|> {"city": "Oslo", "days": 2} <|tool_call_end|>\n'
     '<|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>{"query": "a \\"q\\"\\nb", "limit": 3}<|tool_call_end|> '),
    ("no functions. prefix, a colon in the name",
     '<|tool_call_begin|>ns:get:12<|tool_call_argument_begin|>{"x": [1, {"y": "東京"}]}<|tool_call_end|>'),
    ("bare call without the per-call markers", 'functions.ping:3<|tool_call_argument_begin|>{}'),
    ("arguments as a Python literal", "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{'a': (1, 2), 'b': None}<|tool_call_end|>"),
    ("arguments not JSON: kept as a string",
     "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>just words \n<|tool_call_end|>"),
    ("a prefix with an empty name", "<|tool_call_begin|>functions.:0<|tool_call_argument_begin|>[1, 2]<|tool_call_end|>"),
    ("no index", '<|tool_call_begin|>functions.f<|tool_call_argument_begin|>{}<|tool_call_end|>'),
    ("no argument marker", "<|tool_call_begin|>functions.f:0 {}<|tool_call_end|>"),
    ("one bad call spoils the section",
     '<|tool_call_begin|>functions.a:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_call_begin|>oops<|tool_call_end|>'),
    ("unclosed call (cut off)", '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": 1'),
    ("text before the name", 'I call functions.f:0<|tool_call_argument_begin|>{}'),
    ("empty", ""),
    ("whitespace is the name", " \t:0<|tool_call_argument_begin|>{}"),
    ("whitespace around the index", 'functions.f:12  \n<|tool_call_argument_begin|>  \n{"a": "x"}  '),
]

MINIMAX = [
    ("single call", '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>'),
    ("typed parameters",
     '<invoke name="get_weather"><parameter name="days">\n 3 \n</parameter><parameter name="temp">2.0</parameter>'
     '<parameter name="metric">Yes</parameter><parameter name="tags">["a", "b"]</parameter>'
     '<parameter name="opts">{\'k\': (1, 2)}</parameter></invoke>'),
    ("two calls", '<invoke name="search"><parameter name="query">x</parameter></invoke>\n'
                  "<invoke name='get_weather'><parameter name=city>Oslo</parameter></invoke>"),
    ("enum, type lists, anyOf and an untyped parameter",
     '<invoke name="get_weather"><parameter name="unit">c</parameter><parameter name="maybe">None</parameter>'
     '<parameter name="either">off</parameter><parameter name="any">[1, 2]</parameter>'
     '<parameter name="extra">{"a": 1}</parameter></invoke>'),
    ("values that fail their type",
     '<invoke name="get_weather"><parameter name="days">3.5</parameter><parameter name="temp">abc</parameter>'
     '<parameter name="metric">maybe</parameter><parameter name="tags">not a list</parameter>'
     '<parameter name="either">1_000</parameter><parameter name="maybe">NULL</parameter></invoke>'),
    ("string with quotes, newlines and unicode",
     '<invoke name="search"><parameter name="query">\n  line "one"\nline \\two 🌧\n</parameter><parameter name="limit">+7</parameter></invoke>'),
    ("number parameter at infinity", '<invoke name="get_weather"><parameter name="temp">inf</parameter></invoke>'),
    ("no tools", '<invoke name="search"><parameter name="limit">5</parameter><parameter name="q">{"a": [1]}</parameter></invoke>', False),
    ("no invoke", '<parameter name="city">Paris</parameter>'),
    ("unclosed invoke", '<invoke name="get_weather"><parameter name="city">Paris</parameter>'),
    ("invoke with no name", '<invoke name=></invoke><invoke name=">x</invoke>'),
    ("text around the invoke", 'Sure.\n<invoke name="ping">\n</invoke>\nDone.'),
    ("parameter without a closing >", '<invoke name="search"><parameter name="query</parameter></invoke>'),
    ("big whole numbers", '<invoke name="get_weather"><parameter name="temp">1e30</parameter><parameter name="days">-0_7</parameter></invoke>'),
    ("nan, and a boolean with spaces", '<invoke name="get_weather"><parameter name="temp">nan</parameter><parameter name="metric"> On </parameter></invoke>'),
]

LONGCAT = [
    ("single call", "get_weather<longcat_arg_key>city</longcat_arg_key><longcat_arg_value>Paris</longcat_arg_value>"),
    ("typed values",
     "\nsearch\n<longcat_arg_key>query</longcat_arg_key>\n<longcat_arg_value>12</longcat_arg_value>\n"
     "<longcat_arg_key>limit</longcat_arg_key>\\n<longcat_arg_value>12</longcat_arg_value>\n"),
    ("nested JSON, literal and text",
     'get_weather<longcat_arg_key>opts</longcat_arg_key><longcat_arg_value>{"a": {"b": [true, null]}}</longcat_arg_value>'
     "<longcat_arg_key>tags</longcat_arg_key><longcat_arg_value>('x', 1)</longcat_arg_value>"
     "<longcat_arg_key>unit</longcat_arg_key><longcat_arg_value>c</longcat_arg_value>"),
    ("quotes, newlines and unicode",
     'search<longcat_arg_key>query</longcat_arg_key><longcat_arg_value> "q" \\ ü\nnext 🌧 </longcat_arg_value>'),
    ("a JSON object payload", ' {"name": "search", "arguments": {"limit": 2}, "id": "call_9"} '),
    ("a broken JSON object falls to the tags",
     '{oops get_weather<longcat_arg_key>days</longcat_arg_key><longcat_arg_value>2</longcat_arg_value>'),
    ("no tools", "search<longcat_arg_key>query</longcat_arg_key><longcat_arg_value>5</longcat_arg_value>", False),
    ("a tool with parameters None", "ping<longcat_arg_key>x</longcat_arg_key><longcat_arg_value>1</longcat_arg_value>"),
    ("unknown tool", "nope<longcat_arg_key>x</longcat_arg_key><longcat_arg_value>\"1\"</longcat_arg_value>"),
    ("no argument tags", "get_weather"),
    ("an unclosed value", "search<longcat_arg_key>query</longcat_arg_key><longcat_arg_value>cut"),
    ("a key that runs on",
     "search<longcat_arg_key>a</longcat_arg_key>x<longcat_arg_key>b</longcat_arg_key><longcat_arg_value>[1]</longcat_arg_value>"),
    ("a JSON list payload", '[{"name": "a"}]'),
]

# (parser, think markers, pieces of one answer, whether it ended at EOS (else at the length limit)).
STREAMS = [
    ("glm47", ("<think>", "</think>"),
     ["<think>The user", " wants weather.</think>Checking.", "<tool_call>get_weather<arg_key>city",
      "</arg_key><arg_value>Paris</arg_value></tool_call>", "<tool_call>search<arg_key>query</arg_key>",
      "<arg_value>x</arg_value></tool_call>"], True),
    ("glm47", ("<think>", "</think>"),
     ["<think>hm</think>", "<tool_call>get_weather<arg_key>days</arg_key><arg_value>4"], False),
    ("kimi_k2", ("<think>", "</think>"),
     ["<think>call it</think>", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0",
      '<|tool_call_argument_begin|>{"city": "São Paulo"}<|tool_call_end|>',
      '<|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>{"query": "q"}<|tool_call_end|>',
      "<|tool_calls_section_end|>"], True),
    ("kimi_k2", ("<think>", "</think>"),
     ["Sure. <|tool_calls_", "section_begin|><|tool_call_begin|>oops<|tool_call_end|><|tool_calls_section_end|> after"], True),
    ("minimax_m2", ("<think>", "</think>"),
     ["<think>\nthinking\n</think>\n\n", "<minimax:tool_call>\n<invoke name=\"get_weather\">",
      "<parameter name=\"days\">3</parameter></invoke>\n</minimax:tool_call>", " done"], True),
    ("minimax_m2", ("<think>", "</think>"),
     ["<think>a</think>b<minimax:tool_call><invoke name=\"search\">"], True),
    ("longcat", ("<longcat_think>", "</longcat_think>"),
     ["<longcat_think>why</longcat_think>", "<longcat_tool_call>search<longcat_arg_key>limit",
      "</longcat_arg_key><longcat_arg_value>3</longcat_arg_value></longcat_tool_call>"], True),
    ("longcat", ("<longcat_think>", "</longcat_think>"),
     ["text <longcat_tool_call>{\"name\": \"ping\", \"arguments\": {}}</longcat_tool_call>"], True),
]


def parser(name):
    return importlib.import_module(f"mlx_lm.tool_parsers.{name}")


def formatted(parsed):
    """ToolCallFormatter's view: a list of calls, arguments dumped, other keys as they are."""
    calls = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for c in calls:
        c = dict(c)
        if "arguments" in c:
            c["arguments"] = json.dumps(c["arguments"], ensure_ascii=False)
        out.append(c)
    return out


def run_parser(name, text, tools):
    try:
        return {"calls": formatted(parser(name).parse_tool_call(text, tools))}
    except Exception as e:  # the golden records any exception the parser raises
        return {"error": type(e).__name__, "message": str(e)}


def parser_cases():
    out = []
    for name, cases in (("glm47", GLM), ("kimi_k2", KIMI), ("minimax_m2", MINIMAX), ("longcat", LONGCAT)):
        for label, text, *rest in cases:
            with_tools = rest[0] if rest else True
            tools = TOOLS if with_tools else None
            out.append({"parser": name, "label": label, "text": text, "tools": with_tools,
                        "expect": run_parser(name, text, tools)})
    return out


def run_stream(name, think, pieces, eos):
    p = parser(name)
    sm = TextStateMachine({
        "normal": [(think[0], "reasoning"), (p.tool_call_start, "tool")],
        "reasoning": [(think[1], "normal"), (p.tool_call_start, "tool")],
        "tool": [(p.tool_call_end, "normal")] if p.tool_call_end else [],
    })
    state = sm.make_state("normal")
    content, reasoning, tool_text, finished, prev = "", "", "", [], "normal"

    def collect(segments):
        nonlocal content, reasoning, tool_text, prev
        for s, text in segments:
            if s == "reasoning":
                reasoning += text
            elif s == "tool":
                tool_text += text
            else:
                if prev == "tool":
                    finished.append(tool_text)
                    tool_text = ""
                content += text
            prev = s

    for piece in pieces:
        state, segments = sm.split(state, piece)
        collect(segments)
    if eos:
        state, s = sm.discard(state)
    else:
        state, held, s = sm.flush(state)
        collect([(s, held)])
    if prev == "tool" and tool_text:
        finished.append(tool_text)
    calls = []
    for text in finished:
        got = run_parser(name, text, TOOLS)
        if "calls" in got:
            calls += got["calls"]
    return {"content": content, "reasoning": reasoning, "tool_texts": finished, "calls": calls}


def main():
    cases = parser_cases()
    streams = [{"parser": name, "think": list(think), "pieces": pieces, "eos": eos,
                "expect": run_stream(name, think, pieces, eos)} for name, think, pieces, eos in STREAMS]
    dest = GOLDENS / "tool_parsers" / "index.json"
    write_json(dest, {"provenance": provenance("mlx-lm", "mlx-lm"), "generator": "oracles/gen_tool_parsers.py", "tools": TOOLS, "cases": cases,
                      "streams": streams})
    counts = {}
    for c in cases:
        counts[c["parser"]] = counts.get(c["parser"], 0) + 1
    print(f"{dest}: {counts}, {len(streams)} streams")


if __name__ == "__main__":
    main()
