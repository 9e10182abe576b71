"""The official `anthropic` Python client against a running `engine serve`: the Messages API
as Claude Code and other Anthropic clients speak it.

    oracles/.venv/bin/python oracles/anthropic_client.py --base-url http://127.0.0.1:PORT [--agent] [--plant]

Without `--agent` (goldens/models/tiny-llama-trained, which answers "What color is the sky?"
with "The sky is blue.": five tokens and the EOS, output_tokens 6 as the chat route counts
them): messages.create plain and streamed (the client's typed events), the messages.stream
helper, count_tokens equal to a real request's input_tokens, a system prompt, stop_sequences,
max_tokens, structured outputs (output_config.format), the prompt cache
(cache_read_input_tokens on a repeat), and an error case. Every whole answer is also
validated strictly against the client's own pydantic model (`Message.model_validate_json`),
every raw stream event against `RawMessageStreamEvent`.
With `--plant` count_tokens is asked without the system prompt (the check must fail).

With `--agent` (goldens/models/tiny-qwen3-tools, trained on these exchanges by
oracles/make_tools_model.py): a Claude-Code-like exchange, streamed with thinking on
(`thinking: {type: enabled, budget_tokens}`): thinking and a tool_use block (stop_reason
tool_use, input an object), the assistant turn sent back as the client returned it
(thinking block and signature included) with a tool_result, then the final answer; a strict
tool forced by tool_choice; a tool_result marked is_error. With `--plant` the requests carry
no tools (the checks must fail).

Prints one line per check and exits non-zero if any fails.
"""

import argparse
import json
import sys

import anthropic
import httpx
import pydantic
from anthropic.types import Message, RawMessageStreamEvent

FAILED = []
SKY = [{"role": "user", "content": "What color is the sky?"}]
EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)


def check(name, cond, detail=""):
    print(f"{'ok  ' if cond else 'FAIL'} {name}{': ' + str(detail) if detail else ''}")
    if not cond:
        FAILED.append(name)


def text_of(message):
    return "".join(b.text for b in message.content if b.type == "text")


def create_validated(client, **kw):
    """messages.create, its raw body validated strictly against the client's `Message`."""
    raw = client.messages.with_raw_response.create(**kw)
    body = raw.http_response.text
    try:
        Message.model_validate_json(body, strict=False)
        check("schema: Message", True)
    except pydantic.ValidationError as e:
        check("schema: Message", False, str(e)[:400])
    return raw.parse()


def raw_events(base_url, api_key, body):
    """The SSE events of a streamed request as sent (ping included), each data validated
    against `RawMessageStreamEvent` (ping and error excepted: the client handles those)."""
    events = []
    with httpx.stream("POST", f"{base_url}/v1/messages", json={**body, "stream": True}, timeout=60,
                      headers={"x-api-key": api_key, "anthropic-version": "2023-06-01"}) as r:
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                events.append((kind, data))
    bad = []
    for kind, data in events:
        if kind != data.get("type"):
            bad.append(f"event {kind} carries type {data.get('type')}")
        if kind in ("ping", "error"):
            continue
        try:
            EVENTS.validate_python(data)
        except pydantic.ValidationError as e:
            bad.append(f"{kind}: {str(e)[:200]}")
    check("schema: every raw stream event", not bad, bad[:3])
    return events


def basic(client, args, model):
    r = create_validated(client, model=model, max_tokens=64, messages=SKY)
    check("messages.create", text_of(r) == "The sky is blue.", repr(text_of(r)))
    check("stop_reason end_turn", r.stop_reason == "end_turn" and r.stop_sequence is None, r.stop_reason)
    check("usage", r.usage.input_tokens == 14 and r.usage.output_tokens == 6, r.usage)
    check("id and type", r.id.startswith("msg_") and r.type == "message" and r.role == "assistant", r.id)
    check("model echoed", r.model == model, r.model)

    again = client.messages.create(model=model, max_tokens=64, messages=SKY)
    cached = again.usage.cache_read_input_tokens or 0
    check("prompt cache: cache_read_input_tokens > 0 on a repeat", cached > 0, again.usage)

    events = list(client.messages.create(model=model, max_tokens=64, messages=SKY, stream=True))
    kinds = [e.type for e in events]
    text = "".join(e.delta.text for e in events
                   if e.type == "content_block_delta" and e.delta.type == "text_delta")
    check("stream text", text == "The sky is blue.", repr(text))
    check("stream event order", kinds[0] == "message_start" and kinds[1] == "content_block_start"
          and kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"], kinds)
    delta = [e for e in events if e.type == "message_delta"]
    check("stream stop_reason and usage", bool(delta) and delta[0].delta.stop_reason == "end_turn"
          and delta[0].usage.output_tokens == 6, delta[:1])

    raw = raw_events(args.base_url, "not-needed", {"model": model, "max_tokens": 64, "messages": SKY})
    kinds = [k for k, _ in raw]
    check("raw stream: ping after message_start", kinds[:2] == ["message_start", "ping"], kinds[:3])

    with client.messages.stream(model=model, max_tokens=64, messages=SKY) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    check("messages.stream helper", streamed == "The sky is blue." and text_of(final) == streamed,
          repr(streamed))
    check("messages.stream final message", final.stop_reason == "end_turn"
          and final.usage.output_tokens == 6, final.usage)

    system = "You are brief."
    r = create_validated(client, model=model, max_tokens=64, messages=SKY, system=system)
    counted = client.messages.count_tokens(
        model=model, messages=SKY, **({} if args.plant else {"system": system}))
    check("count_tokens equals input_tokens", counted.input_tokens == r.usage.input_tokens,
          f"count_tokens {counted.input_tokens}, input_tokens {r.usage.input_tokens}")

    r = create_validated(client, model=model, max_tokens=64, messages=SKY, stop_sequences=[" blue"])
    check("stop_sequences", text_of(r) == "The sky is" and r.stop_reason == "stop_sequence"
          and r.stop_sequence == " blue", (text_of(r), r.stop_reason, r.stop_sequence))

    r = create_validated(client, model=model, max_tokens=2, messages=SKY)
    check("max_tokens", r.stop_reason == "max_tokens" and r.usage.output_tokens == 2,
          (text_of(r), r.stop_reason))

    schema = {"type": "object", "properties": {"sky": {"enum": ["blue", "grey"]}},
              "required": ["sky"], "additionalProperties": False}
    r = create_validated(client, model=model, max_tokens=64, messages=SKY,
                         output_config={"format": {"type": "json_schema", "schema": schema}})
    try:
        doc = json.loads(text_of(r))
        ok = isinstance(doc, dict) and set(doc) == {"sky"} and doc["sky"] in ("blue", "grey")
    except ValueError:
        ok = False
    check("output_config.format json_schema", ok, repr(text_of(r)))

    try:
        client.messages.create(model=model, max_tokens=0, messages=SKY)
        check("bad request raises", False, "no error")
    except anthropic.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        check("bad request raises BadRequestError in Anthropic's shape",
              e.status_code == 400 and body.get("type") == "error"
              and body.get("error", {}).get("type") == "invalid_request_error", e.body)


def agent(client, args, model):
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from make_tools_model import WEATHER_TOOL, call_reasoning, final_answer, tool_result, weather_question

    f = WEATHER_TOOL["function"]
    tool = {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
    tools = [] if args.plant else [tool]
    thinking = {"type": "enabled", "budget_tokens": 64}
    city = "Oslo"
    messages = [{"role": "user", "content": weather_question(city)}]

    with client.messages.stream(model=model, max_tokens=200, messages=messages, tools=tools,
                                thinking=thinking) as s:
        first = s.get_final_message()
    kinds = [b.type for b in first.content]
    check("agent: thinking then tool_use", kinds == ["thinking", "tool_use"], kinds)
    check("agent: stop_reason tool_use", first.stop_reason == "tool_use", first.stop_reason)
    thought = next((b for b in first.content if b.type == "thinking"), None)
    check("agent: the thinking text", thought is not None
          and thought.thinking.strip() == call_reasoning(city)
          and isinstance(thought.signature, str), thought)
    use = next((b for b in first.content if b.type == "tool_use"), None)
    check("agent: tool_use input is an object", use is not None and use.name == "get_weather"
          and use.input == {"city": city} and use.id.startswith("toolu_"), use)

    # Turn 2 as Claude Code sends it: the assistant turn as the client returned it (thinking
    # block and signature included), then the tool's result. The tiny model was trained
    # without past reasoning in its prompts, so its answer is checked against the chat
    # route's answer to the same conversation (reasoning_content, tool_calls, a tool message).
    call_id = use.id if use else "toolu_missing"
    result = [{"type": "tool_result", "tool_use_id": call_id, "content": tool_result(city)}]
    sent_back = messages + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": result}]
    with client.messages.stream(model=model, max_tokens=200, messages=sent_back, tools=tools,
                                thinking=thinking) as s:
        streamed = "".join(s.text_stream)
        second = s.get_final_message()
    chat = httpx.post(f"{args.base_url}/v1/chat/completions", timeout=60, json={
        "model": model, "max_tokens": 200, "tools": [WEATHER_TOOL],
        "chat_template_kwargs": {"enable_thinking": True},
        "messages": messages + [
            {"role": "assistant", "content": "", "reasoning_content": thought.thinking if thought else "",
             "tool_calls": [{"id": call_id, "type": "function", "function": {
                 "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": tool_result(city)}]}).json()
    said = chat["choices"][0]["message"]
    thought2 = "".join(b.thinking for b in second.content if b.type == "thinking")
    check("agent: the answer after the tool result is the chat route's",
          text_of(second).strip() == (said.get("content") or "").strip()
          and thought2.strip() == (said.get("reasoning") or "").strip() and streamed == text_of(second),
          (second.content, said))
    check("agent: final stop_reason end_turn", second.stop_reason == "end_turn", second.stop_reason)

    # A client that leaves past thinking out gets the answer the model was trained on.
    without = messages + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content
                                          if b.type != "thinking"]},
        {"role": "user", "content": result}]
    with client.messages.stream(model=model, max_tokens=200, messages=without, tools=tools,
                                thinking=thinking) as s:
        streamed = "".join(s.text_stream)
        third = s.get_final_message()
    check("agent: final answer after the tool result", text_of(third).strip() == final_answer(city)
          and streamed == text_of(third) and third.stop_reason == "end_turn", repr(text_of(third)))

    strict = {**tool, "strict": True}
    r = create_validated(client, model=model, max_tokens=64,
                         messages=[{"role": "user", "content": weather_question("Paris")}],
                         tools=[] if args.plant else [strict],
                         tool_choice={"type": "tool", "name": "get_weather"} if not args.plant else {"type": "auto"},
                         )
    use = next((b for b in r.content if b.type == "tool_use"), None)
    check("strict tool forced by tool_choice", use is not None and isinstance(use.input, dict)
          and isinstance(use.input.get("city"), str) and set(use.input) == {"city"}, r.content)

    errored = [{"role": "user", "content": weather_question("Paris")},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                  "input": {"city": "Paris"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                             "content": [{"type": "text", "text": "the weather service is down"}]}]}]
    r = create_validated(client, model=model, max_tokens=32, messages=errored, tools=tools)
    check("a tool_result with is_error is answered", r.stop_reason in ("end_turn", "max_tokens", "tool_use"),
          r.stop_reason)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True, help="the server's root (the client adds /v1/messages)")
    ap.add_argument("--agent", action="store_true", help="the agent exchange (tiny-qwen3-tools)")
    ap.add_argument("--plant", action="store_true", help="a planted client-side difference (must fail)")
    args = ap.parse_args()
    client = anthropic.Anthropic(base_url=args.base_url, api_key="not-needed", max_retries=0, timeout=60)
    model = httpx.get(f"{args.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
    (agent if args.agent else basic)(client, args, model)
    print(f"anthropic {anthropic.__version__}: "
          f"{'all checks passed' if not FAILED else 'FAILED: ' + ', '.join(FAILED)}")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
