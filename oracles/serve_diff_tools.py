"""serve_diff.py's tools suite: tool calling and reasoning requests to `engine serve` and
`mlx_lm.server` on models/tiny-qwen3-tools, non-streamed and streamed.

Whole responses are compared, and streamed answers chunk by chunk (every `data:` chunk, in
order), after `normalize`: the fields that differ by design are dropped or masked — the
response id, `created`, `system_fingerprint`, each tool call's id (a fresh uuid per call in
mlx_lm.server: only its presence and type are compared) and usage's prompt-cache details
(they depend on what earlier requests left in the cache). One mlx_lm.server 0.32.2 quirk is
allowed for, not mirrored: its usage chunk (stream_options.include_usage) says
"object": "chat.completion"; it is read as the "chat.completion.chunk" the API specifies.
Everything else — content, reasoning, tool calls (name, arguments, index, type),
finish_reason, roles, model, object, usage and where it appears, token counts, and the
number and order of chunks — must be identical.
"""

import copy
import json
import urllib.error
import urllib.request

from make_tools_model import WEATHER_TOOL, tool_call, tool_result, weather_question

TOOLS = [WEATHER_TOOL]
OFF = {"enable_thinking": False}
ON = {"enable_thinking": True}


def ask(city):
    return [{"role": "user", "content": weather_question(city)}]


def answered(city, content):
    """The history after a tool call and its result, as an agent sends it back."""
    return ask(city) + [{"role": "assistant", "content": content, "tool_calls": [tool_call(city)]},
                        {"role": "tool", "tool_call_id": "call_1", "content": tool_result(city)}]


def cases():
    """(label, request body); each is sent non-streamed and streamed."""
    sky = [{"role": "user", "content": "What color is the sky?"}]
    who = [{"role": "user", "content": "Who are you?"}]
    history = [{"role": "system", "content": "You are brief."}, sky[0],
               {"role": "assistant", "content": "The sky is blue.",
                "reasoning_content": "A clear sky scatters blue light."}, who[0]]
    return [
        ("tools, thinking by default", {"messages": ask("Paris"), "tools": TOOLS}),
        ("tools, thinking off", {"messages": ask("Tokyo"), "tools": TOOLS, "chat_template_kwargs": OFF}),
        ("tools, thinking on, non-ASCII argument",
         {"messages": ask("São Paulo"), "tools": TOOLS, "chat_template_kwargs": ON}),
        ("tool result, thinking off",
         {"messages": answered("Oslo", ""), "tools": TOOLS, "chat_template_kwargs": OFF}),
        ("tool result (content null), thinking by default",
         {"messages": answered("Paris", None), "tools": TOOLS}),
        ("no tools, thinking off", {"messages": sky, "chat_template_kwargs": OFF}),
        ("no tools, thinking by default", {"messages": who}),
        ("system + reasoning_content in the history",
         {"messages": history, "chat_template_kwargs": OFF}),
        ("tools, an untrained city", {"messages": ask("Berlin"), "tools": TOOLS, "chat_template_kwargs": OFF}),
        ("tool call cut by max_tokens",
         {"messages": ask("Tokyo"), "tools": TOOLS, "chat_template_kwargs": OFF, "max_tokens": 8}),
        ("reasoning cut by max_tokens", {"messages": sky, "max_tokens": 6}),
    ]


def post(base, body):
    """The parsed response, or for a stream the list of its `data:` chunks (keep-alive
    comments and the final [DONE] are not chunks); an HTTP error as its status and body."""
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        r = urllib.request.urlopen(req, timeout=120)
    except urllib.error.HTTPError as e:
        return {"http_error": e.code, "body": e.read().decode(errors="replace")}
    with r:
        if not body.get("stream"):
            return json.loads(r.read())
        chunks = []
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
        return chunks


def normalize(response, peer=False):
    """One response or chunk with the by-design differences taken out (module docstring)."""
    r = copy.deepcopy(response)
    if peer and r.get("choices") == [] and "usage" in r and r.get("object") == "chat.completion":
        r["object"] = "chat.completion.chunk"
    for key in ("id", "created", "system_fingerprint"):
        r.pop(key, None)
    if isinstance(r.get("usage"), dict):
        r["usage"].pop("prompt_tokens_details", None)
    for choice in r.get("choices", []):
        for part in ("message", "delta"):
            for call in (choice.get(part) or {}).get("tool_calls") or []:
                if isinstance(call.get("id"), str) and call["id"]:
                    call["id"] = "<id>"
    return r


def first_difference(ours, peer, path="$"):
    """Where two JSON values first differ, as a path and the two values there."""
    if type(ours) is not type(peer):
        return f"{path}: ours {ours!r}, peer {peer!r}"
    if isinstance(ours, dict):
        for k in sorted(set(ours) | set(peer)):
            if k not in ours or k not in peer:
                return f"{path}.{k}: ours {ours.get(k, '<absent>')!r}, peer {peer.get(k, '<absent>')!r}"
            if (d := first_difference(ours[k], peer[k], f"{path}.{k}")) is not None:
                return d
        return None
    if isinstance(ours, list):
        for i, (a, b) in enumerate(zip(ours, peer)):
            if (d := first_difference(a, b, f"{path}[{i}]")) is not None:
                return d
        if len(ours) != len(peer):
            return f"{path}: ours has {len(ours)} items, peer {len(peer)}"
        return None
    return None if ours == peer else f"{path}: ours {ours!r}, peer {peer!r}"


def plant(body):
    """Our side's perturbation: the request as a server that drops tools and template kwargs
    would see it."""
    return {k: v for k, v in body.items() if k not in ("tools", "chat_template_kwargs")}


def run(ours_url, peer_url, model, planted) -> int:
    requests = []
    for label, extra in cases():
        for stream in (False, True):
            requests.append((label, stream, extra))
    requests.append(("tools, thinking by default, usage chunk", True,
                     dict(cases()[0][1], stream_options={"include_usage": True})))
    failed = 0
    for label, stream, extra in requests:
        body = {"model": model, "max_tokens": 64, "temperature": 0.0, **extra, "stream": stream}
        ours = post(ours_url, plant(body) if planted else body)
        peer = post(peer_url, body)
        if isinstance(ours, list) and isinstance(peer, list):
            ours, peer = [normalize(c) for c in ours], [normalize(c, peer=True) for c in peer]
        else:
            ours, peer = normalize(ours), normalize(peer, peer=True)
        diff = first_difference(ours, peer)
        failed += diff is not None
        print(f"{'ok  ' if diff is None else 'FAIL'} {'stream' if stream else 'plain '} {label}")
        if diff is not None:
            print(f"     first difference at {diff}")
    print(f"{len(requests) - failed}/{len(requests)} responses identical (tools suite)")
    return 1 if failed else 0
