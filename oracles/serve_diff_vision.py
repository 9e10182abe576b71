"""The same greedy requests with images to two servers — `engine serve` and `mlx_vlm.server`
0.7.10 on the same assembled vision model — compared answer by answer and chunk by chunk.

    /work/vlmserve-venv/bin/python oracles/serve_diff_vision.py --ours URL --peer URL \
        --model DIR [--plant]

(the harness runs it with the vlm-serve venv's Python: the goldens check below reads the
model's tokenizer with transformers). `harness serve-diff --vision` starts both servers and
runs this; `--ours` may be the peer's own URL (the harness's `--peer-only`), which checks the
requests, the peer's determinism and the plant without our server.

Requests: one and two PNG pictures (the vision goldens' goldens/vision/images/rgb_64x64.png
and rgb_97x61.png, as `data:image/png;base64,` URLs or Anthropic base64 sources), each with
the pictures before the text and after it, on the three APIs mlx_vlm.server serves with
images — chat/completions, Responses, Messages — each non-streamed and streamed; plus a
chat whose picture is in an earlier user turn. All greedy (temperature 0), 16 tokens.

Compared, per request (the rest of each body is not: see below):
  chat/completions  message content, finish_reason, usage prompt/completion/total tokens,
                    and (asked with logprobs: true) each token's log-probability;
                    streamed: every content delta in order, finish_reason, the usage chunk
                    (stream_options.include_usage)
  Responses         output text, status, incomplete_details.reason, usage input/output/
                    total tokens; streamed: every response.output_text.delta in order, the
                    closing event's type (response.completed / .incomplete) and its response's
                    status, reason and usage
  Messages          text of the text blocks, stop_reason, usage input/output tokens;
                    streamed: every text_delta in order, message_delta's stop_reason and
                    output_tokens, message_start's input_tokens
By design not compared (normalized away by taking only the fields above): ids, created /
created_at, mlx_vlm.server's extra fields (`timings`, the null `reasoning_content` /
`reasoning` / `tool_calls` / `tool_call_id` / `name` in each message and delta, usage's
`prompt_tokens_details` / `input_tokens_details` / cache counts that depend on what earlier
requests left cached), the echoed request settings in a Response (temperature, top_p, store,
…), message_start's placeholder output_tokens (mlx_vlm.server says 1 before any token), and
the `token` of each log-probability entry (mlx_vlm.server: the token decoded alone, " one";
ours, as for mlx_lm.server: the vocabulary piece, "Ġone"; the tokens themselves are compared
through the text and chunks).

What mlx_vlm.server 0.7.10 does that its generate CLI does not (found here, not documented):
it keeps the client's order of text and image parts in a user message, so the picture's
tokens stand where the client put them; `mlx_vlm.generate` (prompt_utils with num_images,
as the goldens in goldens/vision/generate were made) puts them before the text on Qwen3-VL,
Qwen3.5 and gemma4, and after it on Gemma 3. Hence both orders here. And it strips whitespace at both ends of a
non-streamed answer's text on all three APIs (server/responses_state.py `_split_thinking`,
which every non-streamed answer goes through, thinking or not), while streamed chat and
Messages deltas are sent as decoded; streamed Responses deltas drop the first delta's leading
whitespace and hold trailing whitespace back into the next delta (openai.py `stream_delta`).
These are compared as they are, not normalized: they are what its clients receive.

The peer's plain chat answers are also held against goldens/vision/generate (mlx_vlm.generate,
which the engine's vision gates use): prompt token count, and the golden ids as their first
tokens (`against_goldens`).

`--plant`: our side's first picture is swapped for the other one (rgb_64x64 <-> rgb_97x61);
the diff must then fail. Prints one line per request, naming for a failure the side that
refused (HTTP status and message) or the first field that differs; exits non-zero on any
difference or refusal.
"""

import argparse
import base64
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

import serve_diff

IMAGES = ["rgb_64x64.png", "rgb_97x61.png"]
PROMPT = "Describe this."
MAX_TOKENS = 16


def png(name):
    path = Path(__file__).resolve().parent.parent / "goldens/vision/images" / name
    return base64.b64encode(path.read_bytes()).decode()


def chat_content(images, first):
    parts = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png(i)}"}}
             for i in images]
    text = [{"type": "text", "text": PROMPT}]
    return parts + text if first else text + parts


def responses_content(images, first):
    parts = [{"type": "input_image", "image_url": f"data:image/png;base64,{png(i)}"}
             for i in images]
    text = [{"type": "input_text", "text": PROMPT}]
    return parts + text if first else text + parts


def messages_content(images, first):
    parts = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": png(i)}} for i in images]
    text = [{"type": "text", "text": PROMPT}]
    return parts + text if first else text + parts


def body(api, images, first, stream, model):
    if api.startswith("chat"):
        messages = [{"role": "user", "content": chat_content(images, first)}]
        if api == "chat, earlier turn":
            messages += [{"role": "assistant", "content": "A picture."},
                         {"role": "user", "content": "What else?"}]
        b = {"messages": messages, "max_tokens": MAX_TOKENS}
        if stream:
            b["stream_options"] = {"include_usage": True}
        else:
            b["logprobs"] = True
    elif api == "responses":
        b = {"input": [{"role": "user", "content": responses_content(images, first)}],
             "max_output_tokens": MAX_TOKENS}
    else:
        b = {"messages": [{"role": "user", "content": messages_content(images, first)}],
             "max_tokens": MAX_TOKENS}
    return {"model": model, "temperature": 0.0, "stream": stream, **b}


PATHS = {"chat": "/v1/chat/completions", "chat, earlier turn": "/v1/chat/completions",
         "responses": "/v1/responses", "messages": "/v1/messages"}


def events(r):
    """A server-sent event stream's `data:` payloads, parsed ([DONE] is not one)."""
    out = []
    for raw in r:
        line = raw.decode().strip()
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            out.append(json.loads(line[5:]))
    return out


def summary(api, base, b):
    """The compared fields of one answer (module docstring), or the refusal."""
    path = PATHS[api]
    try:
        if api.startswith("chat"):
            r = serve_diff.post(base, path, b)
            if b.get("stream"):
                u = r["usage"] or {}
                return {"chunks": r["chunks"], "finish_reason": r["finish_reason"],
                        "usage": [u.get(k) for k in ("prompt_tokens", "completion_tokens",
                                                     "total_tokens")] if u else None}
            c, u = r["choices"][0], r["usage"]
            lp = (c.get("logprobs") or {}).get("content", [])
            return {"text": c["message"]["content"], "finish_reason": c["finish_reason"],
                    "usage": [u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]],
                    "logprobs": [t["logprob"] for t in lp] or None,
                    "_tokens": [t["token"] for t in lp]}
        req = urllib.request.Request(base + path, data=json.dumps(b).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            if not b.get("stream"):
                d = json.loads(r.read())
                return (responses_summary(d) if api == "responses" else messages_summary(d))
            evs = events(r)
        return responses_stream(evs) if api == "responses" else messages_stream(evs)
    except urllib.error.HTTPError as e:
        return {"refused": e.code, "message": e.read().decode(errors="replace")[:300]}


def responses_summary(d):
    text = "".join(p.get("text", "") for item in d.get("output", []) if item.get("type") == "message"
                   for p in item.get("content", []) if p.get("type") == "output_text")
    u = d.get("usage") or {}
    return {"text": text, "status": d.get("status"),
            "reason": (d.get("incomplete_details") or {}).get("reason"),
            "usage": [u.get("input_tokens"), u.get("output_tokens"), u.get("total_tokens")]}


def responses_stream(evs):
    deltas = [e["delta"] for e in evs if e.get("type") == "response.output_text.delta"]
    last = evs[-1] if evs else {}
    closing = (responses_summary(last["response"]) if "response" in last else {})
    closing.pop("text", None)
    return {"chunks": deltas, "closing": last.get("type"), **closing}


def messages_summary(d):
    text = "".join(b.get("text", "") for b in d.get("content", []) if b.get("type") == "text")
    u = d.get("usage") or {}
    return {"text": text, "stop_reason": d.get("stop_reason"),
            "usage": [u.get("input_tokens"), u.get("output_tokens")]}


def messages_stream(evs):
    deltas = [e["delta"]["text"] for e in evs if e.get("type") == "content_block_delta"
              and e["delta"].get("type") == "text_delta"]
    start = next((e["message"] for e in evs if e.get("type") == "message_start"), {})
    end = next((e for e in evs if e.get("type") == "message_delta"), {})
    return {"chunks": deltas, "stop_reason": (end.get("delta") or {}).get("stop_reason"),
            "usage": [(start.get("usage") or {}).get("input_tokens"),
                      (end.get("usage") or {}).get("output_tokens")],
            "closing": evs[-1].get("type") if evs else None}


def cases():
    """(api, images, pictures first, stream)."""
    out = []
    for api in ("chat", "responses", "messages"):
        for images in (IMAGES[:1], IMAGES):
            for first in (True, False):
                for stream in (False, True):
                    out.append((api, images, first, stream))
    # Text first: on tiny-gemma3-vl a picture before the text leaves the answer's text
    # independent of the pixels (only the log-probabilities see them).
    out += [("chat, earlier turn", IMAGES[:1], False, False),
            ("chat, earlier turn", IMAGES[:1], False, True)]
    return out


def planted(images):
    """Our side's perturbation: the first picture swapped for the other one."""
    other = {IMAGES[0]: IMAGES[1], IMAGES[1]: IMAGES[0]}
    return [other[images[0]]] + images[1:]


def brief(s):
    """An answer's summary, shortened for a line that is about the other side's refusal."""
    text = s.get("text", "".join(s.get("chunks", [])))
    rest = {k: v for k, v in s.items()
            if k not in ("text", "chunks", "logprobs") and not k.startswith("_")}
    return f"{text[:60]!r}{'…' if len(text) > 60 else ''} {rest}"


def verdict(ours, peer):
    """None if the same, else what to print: who refused, or the first differing field."""
    if "refused" in ours or "refused" in peer:
        sides = [f"{who} refused it (HTTP {s['refused']}: {s['message']})"
                 for who, s in (("ours", ours), ("mlx_vlm.server", peer)) if "refused" in s]
        answered = [f"{who} answered {brief(s)}" for who, s in (("ours", ours),
                                                                ("mlx_vlm.server", peer))
                    if "refused" not in s]
        return "; ".join(sides + answered)
    keys = [k for k in sorted(set(ours) | set(peer))
            if not k.startswith("_") and ours.get(k) != peer.get(k)]
    if not keys:
        return None
    k = keys[0]
    return (f"differs in {', '.join(keys)}; {k}: ours {ours.get(k)!r}, "
            f"mlx_vlm.server {peer.get(k)!r}")


def against_goldens(model, answers):
    """The peer's plain chat answers against goldens/vision/generate (mlx_vlm.generate, 8
    greedy ids): for each golden case of this model, the answer with its pictures in the order
    the golden prompt has them must have its prompt token count, and its first tokens (the
    `token` of its log-probability entries: the id decoded alone by the model's tokenizer,
    app.py `_decode_token`) must be the golden ids decoded the same way. Ties the server to
    the reference the engine's vision gates use. Returns the failures and the cases seen."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found"
    from transformers import AutoTokenizer

    path = Path(__file__).resolve().parent.parent / "goldens/vision/generate/generate.json"
    tok = AutoTokenizer.from_pretrained(model)
    bad, seen = [], 0
    for case in json.loads(path.read_text())["cases"]:
        if case["model"] != Path(model).name or case["prompt"] != PROMPT:
            continue
        seen += 1
        t = case["templated"]
        marks = [t.find(m) for m in ("<start_of_image>", "<|vision_start|>", "<|image|>") if m in t]
        first = min(marks) < t.find(PROMPT)
        images = [Path(i).name for i in case["images"]]
        got = answers.get((tuple(images), first))
        want = [tok.decode([i]) for i in case["generated"]]
        if case["finish_reason"] == "stop":
            want = want[:-1]  # the EOS that stopped mlx_vlm.generate is not an answer token
        if got is None or "refused" in got:
            bad.append(f"{images} (pictures {'first' if first else 'last'}): no answer: {got}")
        elif got["usage"][0] != len(case["prompt_ids"]) or got["_tokens"][:len(want)] != want:
            bad.append(f"{images}: golden {len(case['prompt_ids'])} prompt tokens, {want}; "
                       f"mlx_vlm.server {got['usage'][0]}, {got['_tokens'][:len(want)]}")
    if not seen:
        bad.append(f"no case for {Path(model).name} (asking {PROMPT!r}) in {path}")
    return bad, seen


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True)
    ap.add_argument("--peer", required=True)
    ap.add_argument("--model", required=True, help="the model directory both servers serve "
                    "(the `model` every request names)")
    ap.add_argument("--plant", action="store_true")
    args = ap.parse_args()
    failed = refused_ours = refused_peer = chunks = 0
    todo = cases()
    peer_chat = {}
    for api, images, first, stream in todo:
        b = body(api, images, first, stream, args.model)
        ob = body(api, planted(images), first, stream, args.model) if args.plant else b
        ours, peer = summary(api, args.ours, ob), summary(api, args.peer, b)
        if api == "chat" and not stream:
            peer_chat[(tuple(images), first)] = peer
        refused_ours += "refused" in ours
        refused_peer += "refused" in peer
        why = verdict(ours, peer)
        failed += why is not None
        chunks += len(ours.get("chunks", []))
        order = "pictures first" if first else "text first"
        label = (f"{PATHS[api]} {'stream' if stream else 'plain '} {api}, "
                 f"{len(images)} image{'s' if len(images) > 1 else ''}, {order}")
        print(f"{'ok  ' if why is None else 'FAIL'} {label}")
        if why is not None:
            print(f"     {why}")
    print(f"{len(todo) - failed}/{len(todo)} answers identical ({chunks} streamed text chunks); "
          f"refused by ours: {refused_ours}, by mlx_vlm.server: {refused_peer}")
    off, seen = against_goldens(args.model, peer_chat)
    for why in off:
        print(f"FAIL mlx_vlm.server vs goldens/vision/generate: {why}")
    if not off:
        print(f"mlx_vlm.server's plain chat answers agree with goldens/vision/generate on its "
              f"{seen} cases (prompt tokens, the golden's 8 ids as their first tokens)")
    return 1 if failed or off else 0


if __name__ == "__main__":
    sys.exit(main())
