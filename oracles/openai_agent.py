"""An agent-style exchange with the official `openai` client against a server on
goldens/models/tiny-qwen3-tools (run by `openai_client.py --agent`): a request with tools
gets a tool call (finish_reason "tool_calls"); the client appends the assistant message and
the tool's result, as agent loops do, and the next answer is plain content. Non-streamed
(the returned message object appended as is) and streamed (the tool call assembled from its
deltas by index, as agent frameworks do), plus a first turn with thinking on by default
(reasoning beside the tool call). The model was trained on these exchanges
(oracles/make_tools_model.py), so the answers are known exactly. With `plant` the requests
carry an empty tools list (as a server that drops tools would render them): checks must fail.
"""

import json

from make_tools_model import WEATHER_TOOL, call_reasoning, final_answer, tool_result, weather_question

TOOLS = [WEATHER_TOOL]
PLANTED = False
THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}


def tools():
    return [] if PLANTED else TOOLS


def ask(city):
    return [{"role": "user", "content": weather_question(city)}]


def check_call(check, label, finish, calls, city):
    """One get_weather call for `city`; returns its id."""
    check(f"{label}: finish_reason tool_calls", finish == "tool_calls", finish)
    ok = len(calls) == 1 and calls[0]["name"] == "get_weather" and bool(calls[0]["id"])
    check(f"{label}: one get_weather call with an id", ok, calls)
    args = calls[0]["arguments"] if calls else None
    try:
        parsed = json.loads(args)
    except (TypeError, ValueError):
        parsed = None
    check(f"{label}: arguments are JSON for {city}", parsed == {"city": city}, args)
    return calls[0]["id"] if calls else "missing"


def plain(client, model, city, check):
    messages = ask(city)
    r = client.chat.completions.create(model=model, messages=messages, tools=tools(), extra_body=THINKING_OFF)
    msg = r.choices[0].message
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in msg.tool_calls or []]
    call_id = check_call(check, "agent", r.choices[0].finish_reason, calls, city)
    check("agent: no text beside the call", not msg.content, repr(msg.content))
    messages += [msg, {"role": "tool", "tool_call_id": call_id, "content": tool_result(city)}]
    r = client.chat.completions.create(model=model, messages=messages, tools=tools(), extra_body=THINKING_OFF)
    msg = r.choices[0].message
    check("agent: final answer after the tool result", msg.content == final_answer(city), repr(msg.content))
    check("agent: final finish_reason stop", r.choices[0].finish_reason == "stop" and not msg.tool_calls,
          r.choices[0].finish_reason)


def collect(stream):
    """Content, tool calls (by index: id, name, concatenated arguments) and finish_reason."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                if tc.function:
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def streamed(client, model, city, check):
    messages = ask(city)
    content, calls, finish = collect(client.chat.completions.create(
        model=model, messages=messages, tools=tools(), extra_body=THINKING_OFF, stream=True))
    call_id = check_call(check, "agent stream", finish, calls, city)
    messages += [{"role": "assistant", "content": content or None,
                  "tool_calls": [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]},
                 {"role": "tool", "tool_call_id": call_id, "content": tool_result(city)}]
    content, calls, finish = collect(client.chat.completions.create(
        model=model, messages=messages, tools=tools(), extra_body=THINKING_OFF, stream=True))
    check("agent stream: final answer after the tool result", content == final_answer(city), repr(content))
    check("agent stream: final finish_reason stop", finish == "stop" and not calls, finish)


def thinking(client, model, city, check):
    """Thinking on (the template's default, as mlx_lm.server passes it): reasoning, then the call."""
    r = client.chat.completions.create(model=model, messages=ask(city), tools=tools())
    msg = r.choices[0].message
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in msg.tool_calls or []]
    check_call(check, "agent thinking", r.choices[0].finish_reason, calls, city)
    reasoning = (msg.model_extra or {}).get("reasoning")
    check("agent thinking: reasoning separated", (reasoning or "").strip() == call_reasoning(city)
          and "<think>" not in (msg.content or ""), repr(reasoning))


def run(client, check, model=None, plant=False) -> None:
    """`check(name, cond, detail)` records each check (openai_client.check); `model` is the
    served model's id (default: the first one /v1/models lists)."""
    global PLANTED
    PLANTED = plant
    model = model or client.models.list().data[0].id
    plain(client, model, "Paris", check)
    streamed(client, model, "Tokyo", check)
    thinking(client, model, "Oslo", check)
