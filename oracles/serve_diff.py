"""The same greedy requests to two OpenAI-compatible servers — `engine serve` and
`mlx_lm.server` on the same model — compared field by field: the text, every streamed chunk
of text, finish_reason and token counts.

    oracles/.venv/bin/python oracles/serve_diff.py --ours URL --peer URL --model DIR [--plant]

`--plant` asks our server for at most 4 tokens (the check must then fail).
Prints one line per request and exits non-zero on any difference.
"""

import argparse
import json
import sys
import urllib.request

PROMPTS = ["What color is the sky?", "Who fixed the clock?", "Tell me about Mira.",
           "Héllo — what is 日本語? 🙂"]
MAX_TOKENS = 32


def post(base, path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        if not body.get("stream"):
            return json.loads(r.read())
        chunks, finish, usage = [], None, None
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            usage = d.get("usage") or usage
            for c in d.get("choices", []):
                piece = c.get("delta", {}).get("content") if "delta" in c else c.get("text")
                if piece:
                    chunks.append(piece)
                finish = c.get("finish_reason") or finish
        return {"chunks": chunks, "finish_reason": finish, "usage": usage}


def summary(kind, r):
    if "chunks" in r:
        return {"chunks": r["chunks"], "finish_reason": r["finish_reason"]}
    c = r["choices"][0]
    text = c["message"]["content"] if kind == "chat" else c["text"]
    u = r["usage"]
    return {"text": text, "finish_reason": c["finish_reason"],
            "tokens": [u["prompt_tokens"], u["completion_tokens"]]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True)
    ap.add_argument("--peer", required=True)
    ap.add_argument("--model", required=True, help="the model directory both servers serve")
    ap.add_argument("--plant", action="store_true")
    args = ap.parse_args()
    failed = 0
    cases = []
    for p in PROMPTS:
        chat = {"messages": [{"role": "user", "content": p}]}
        cases += [("chat", "/v1/chat/completions", chat, False),
                  ("chat", "/v1/chat/completions", chat, True),
                  ("text", "/v1/completions", {"prompt": p}, False),
                  ("text", "/v1/completions", {"prompt": p}, True)]
    for kind, path, extra, stream in cases:
        body = {"model": args.model, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": stream,
                **extra}
        ours_body = dict(body, max_tokens=4) if args.plant else body
        ours = summary(kind, post(args.ours, path, ours_body))
        peer = summary(kind, post(args.peer, path, body))
        same = ours == peer
        failed += not same
        label = f"{path} {'stream' if stream else 'plain'} {json.dumps(extra, ensure_ascii=False)[:48]}"
        print(f"{'ok  ' if same else 'FAIL'} {label}")
        if not same:
            print(f"     ours: {ours}\n     peer: {peer}")
    print(f"{len(cases) - failed}/{len(cases)} responses identical")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
