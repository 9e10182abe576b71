"""The same greedy requests to two OpenAI-compatible servers — `engine serve` and
`mlx_lm.server` on the same model — compared field by field.

    oracles/.venv/bin/python oracles/serve_diff.py --ours URL --peer URL --model DIR \
        [--suite basic|tools|dist] [--plant]

`--suite basic` (the default): plain chat and completion requests; the text, every streamed
chunk of text, finish_reason, token counts and log-probabilities are compared.
`--suite tools` (models/tiny-qwen3-tools, oracles/serve_diff_tools.py): tool calling and
reasoning; whole responses and whole streamed chunk sequences are compared, all fields but
the ones that differ by design (see serve_diff_tools.normalize).
`--suite dist` (both servers as ranks of a tensor-parallel group, `harness serve-diff --ranks
N`): the basic suite plus seeded sampled requests (temperature, top_p, seed), which every rank
must sample alike, and five greedy requests sent at once, which both servers decode together.
`--plant` perturbs our side (basic: at most 4 tokens; tools: the request loses its `tools`
and `chat_template_kwargs`): the check must then fail.
Prints one line per request and exits non-zero on any difference.
"""

import argparse
import json
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

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


def logprob_entries(c, peer):
    """A chat answer's log-probabilities as comparable rows: (id, logprob) per token, and,
    with top_logprobs, each position's alternatives as an unordered set of (id, logprob).
    Two mlx_lm.server 0.32.2 quirks are allowed for, not mirrored: it also lists the EOS token
    that ended the answer (its last row is dropped when it stopped there), and with
    top_logprobs it reports each position's first argpartition entry instead of the chosen
    token (so only the alternative sets are compared then)."""
    lp = c.get("logprobs")
    if not lp:
        return None
    content = lp["content"]
    if peer and c["finish_reason"] == "stop" and content:
        content = content[:-1]
    rows = []
    for e in content:
        if e.get("top_logprobs"):
            rows.append(sorted((t["id"], t["logprob"]) for t in e["top_logprobs"]))
        else:
            rows.append((e["id"], e["logprob"]))
    return rows


def sampled_cases():
    """Seeded sampling: each rank samples on its own, so the ranks agree only if they draw the
    same ids from the same logits and key."""
    cases = []
    for i, p in enumerate(PROMPTS[:3]):
        sampling = {"temperature": 0.8, "top_p": 0.95, "seed": 11 + i}
        chat = {"messages": [{"role": "user", "content": p}], **sampling}
        cases += [("chat", "/v1/chat/completions", chat, False),
                  ("chat", "/v1/chat/completions", chat, True),
                  ("text", "/v1/completions", {"prompt": p, **sampling}, True)]
    return cases


def concurrent_cases():
    """Greedy requests sent at once, which both servers decode together (mlx_lm.server's
    BatchGenerator on every rank; our batch lane, `--batch`, whose followers mirror rank 0's
    rows): rows of different lengths, streamed and not, one with log-probabilities."""
    cases = []
    for i, (p, n) in enumerate(zip(PROMPTS, [12, 32, 20, 28])):
        chat = {"messages": [{"role": "user", "content": p + " Tell me more."}], "max_tokens": n}
        if i == 2:
            chat["logprobs"] = True
        cases.append(("chat", "/v1/chat/completions", chat, i % 2 == 1))
    cases.append(("text", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 24},
                  False))
    return cases


def tokenless_ids(model):
    """Ids the model can emit that its tokenizer has no token for (tiny random models:
    vocab_size past the tokenizer's vocabulary). The two servers decode those differently
    (that holds on one process too), so the dist suite bans them with logit_bias to keep
    the texts comparable; the ids and log-probabilities are compared either way."""
    from pathlib import Path

    tok = json.loads((Path(model) / "tokenizer.json").read_text())
    known = set(tok["model"]["vocab"].values()) | {a["id"] for a in tok.get("added_tokens", [])}
    config = json.loads((Path(model) / "config.json").read_text())
    size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", 0)
    return [i for i in range(size) if i not in known]


def summary(kind, r, peer):
    if "chunks" in r:
        return {"chunks": r["chunks"], "finish_reason": r["finish_reason"]}
    c = r["choices"][0]
    text = c["message"]["content"] if kind == "chat" else c["text"]
    u = r["usage"]
    return {"text": text, "finish_reason": c["finish_reason"],
            "tokens": [u["prompt_tokens"], u["completion_tokens"]],
            "logprobs": logprob_entries(c, peer)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True)
    ap.add_argument("--peer", required=True)
    ap.add_argument("--model", required=True, help="the model directory both servers serve")
    ap.add_argument("--suite", choices=["basic", "tools", "dist"], default="basic")
    ap.add_argument("--plant", action="store_true")
    ap.add_argument("--ours-model", help="the `model` our requests name (an adapter's name, as "
                    "`engine serve --adapter NAME=DIR` serves it); default: --model")
    ap.add_argument("--peer-adapters", help="the adapter directory the peer's requests name "
                    "(mlx_lm.server's per-request `adapters`: its --adapter-path applies only "
                    "to the model named `default_model`)")
    args = ap.parse_args()
    if args.suite == "tools":
        import serve_diff_tools

        return serve_diff_tools.run(args.ours, args.peer, args.model, args.plant)
    failed = 0
    cases = []
    for p in PROMPTS:
        chat = {"messages": [{"role": "user", "content": p}]}
        cases += [("chat", "/v1/chat/completions", chat, False),
                  ("chat", "/v1/chat/completions", chat, True),
                  ("text", "/v1/completions", {"prompt": p}, False),
                  ("text", "/v1/completions", {"prompt": p}, True)]
    # Log-probabilities on non-streamed chat answers: per token, and the top alternatives.
    for p in PROMPTS[:2]:
        chat = [{"role": "user", "content": p}]
        cases += [("chat", "/v1/chat/completions", {"messages": chat, "logprobs": True}, False),
                  ("chat", "/v1/chat/completions",
                   {"messages": chat, "logprobs": True, "top_logprobs": 3}, False)]
    ban = {}
    if args.suite == "dist":
        cases += sampled_cases()
        ban = {str(i): -100 for i in tokenless_ids(args.model)}
        if ban:
            print(f"({len(ban)} ids without a token banned by logit_bias)")
    def bodies(extra, stream):
        body = {"model": args.model, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": stream,
                **extra}
        if ban:
            body["logit_bias"] = ban
        ours_body = dict(body, max_tokens=4) if args.plant else body
        if args.ours_model:
            ours_body = dict(ours_body, model=args.ours_model)
        peer_body = dict(body, adapters=args.peer_adapters) if args.peer_adapters else body
        return ours_body, peer_body

    def answer(base, kind, path, body, peer):
        return summary(kind, post(base, path, body), peer)

    def answers_at_once(base, group, peer):
        """The group's requests sent at once (each from its own thread): their answers, in the
        group's order."""
        with ThreadPoolExecutor(len(group)) as pool:
            sent = [pool.submit(answer, base, kind, path, body, peer)
                    for kind, path, body in group]
            return [f.result() for f in sent]

    results = []
    for kind, path, extra, stream in cases:
        ours_body, peer_body = bodies(extra, stream)
        results.append(("", path, extra, stream, answer(args.ours, kind, path, ours_body, False),
                        answer(args.peer, kind, path, peer_body, True)))
    if args.suite == "dist":
        group = concurrent_cases()
        cases += group
        ours_group, peer_group = [], []
        for kind, path, extra, stream in group:
            ours_body, peer_body = bodies(extra, stream)
            ours_group.append((kind, path, ours_body))
            peer_group.append((kind, path, peer_body))
        ours = answers_at_once(args.ours, ours_group, False)
        peer = answers_at_once(args.peer, peer_group, True)
        for (kind, path, extra, stream), o, p in zip(group, ours, peer):
            results.append((f"[{len(group)} at once] ", path, extra, stream, o, p))
    chunks = 0
    for tag, path, extra, stream, ours, peer in results:
        same = ours == peer
        failed += not same
        chunks += len(ours.get("chunks", []))
        count = f" ({len(ours['chunks'])} chunks)" if stream else ""
        label = f"{tag}{path} {'stream' if stream else 'plain'}{count} {json.dumps(extra, ensure_ascii=False)[:48]}"
        print(f"{'ok  ' if same else 'FAIL'} {label}")
        if not same:
            print(f"     ours: {ours}\n     peer: {peer}")
    print(f"{len(cases) - failed}/{len(cases)} responses identical ({chunks} streamed text chunks)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
