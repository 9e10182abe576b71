"""`engine serve`'s /metrics scraped as Prometheus would and parsed by the Prometheus
org's Python parser (prometheus_client.parser.text_string_to_metric_families), before and
after two known chat requests (one whole, one streamed): each counted under its route and
status, tokens in and out equal to their usage, the latency histograms' counts equal to
the requests, and the gauges present.

    oracles/.venv/bin/python oracles/prometheus_check.py --base-url http://127.0.0.1:PORT [--api-key KEY] [--plant]

With `--plant` the second scrape's text loses one sample's value (a malformed exposition
line), which the parser must refuse. Prints one line per check and exits non-zero if any
fails.
"""

import argparse
import json
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

FAILED = []


def check(name, cond, detail=""):
    print(f"{'ok  ' if cond else 'FAIL'} {name}{': ' + str(detail) if detail else ''}")
    if not cond:
        FAILED.append(name)


def request(base, path, key, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    return urllib.request.urlopen(req, timeout=60)


def scrape(base, key, plant=False):
    """The samples of one scrape: {(name, sorted labels): value}, and the content type."""
    with request(base, "/metrics", key) as r:
        ctype = r.headers.get("Content-Type", "")
        text = r.read().decode()
    if plant:
        lines = text.split("\n")
        i = next(i for i, l in enumerate(lines) if l and not l.startswith("#"))
        lines[i] = lines[i].rsplit(" ", 1)[0]
        text = "\n".join(lines)
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, ctype


def value(samples, name, **labels):
    """The sum over samples `name` whose labels include `labels` (0 if none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True, help="the server's root, without /v1")
    ap.add_argument("--api-key")
    ap.add_argument("--plant", action="store_true", help="break a line of the second scrape")
    args = ap.parse_args()
    base = args.base_url.rstrip("/")

    try:
        before, ctype = scrape(base, args.api_key)
    except ValueError as e:
        check("the exposition parses", False, e)
        sys.exit(1)
    check("content type", ctype.startswith("text/plain; version=0.0.4"), ctype)
    ask = {"messages": [{"role": "user", "content": "What color is the sky?"}], "max_tokens": 8}
    with request(base, "/v1/chat/completions", args.api_key, ask) as r:
        usages = [json.load(r)["usage"]]
    streamed = dict(ask, stream=True, stream_options={"include_usage": True})
    with request(base, "/v1/chat/completions", args.api_key, streamed) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usages.append(chunk["usage"])
    check("usage of both answers", len(usages) == 2, usages)

    try:
        after, _ = scrape(base, args.api_key, plant=args.plant)
    except ValueError as e:
        check("the exposition parses", False, e)
        sys.exit(1)
    check("the exposition parses", True)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    chat = dict(method="POST", route="/v1/chat/completions", code="200")
    check("chat 200s counted", delta("engine_http_requests_total", **chat) == 2)
    check("the first scrape counted", delta("engine_http_requests_total", route="/metrics") == 1)
    prompt = sum(u["prompt_tokens"] for u in usages)
    out = sum(u["completion_tokens"] for u in usages)
    check("prompt tokens = usage", delta("engine_prompt_tokens_total") == prompt,
          (delta("engine_prompt_tokens_total"), prompt))
    check("generated tokens = usage", delta("engine_generation_tokens_total") == out,
          (delta("engine_generation_tokens_total"), out))
    check("first-token latencies = requests",
          delta("engine_time_to_first_token_seconds_count") == 2)
    check("durations = requests", delta("engine_request_duration_seconds_count") == 2)
    many = sum(1 for u in usages if u["completion_tokens"] >= 2)
    check("per-token latencies = answers of 2+ tokens",
          delta("engine_time_per_output_token_seconds_count") == many)
    ttft_inf = value(after, "engine_time_to_first_token_seconds_bucket", le="+Inf")
    check("+Inf bucket = count", ttft_inf == value(after, "engine_time_to_first_token_seconds_count"))
    for name in ["engine_queue_depth", "engine_running_requests", "engine_batch_slots",
                 "engine_prompt_cache_hits_total", "engine_kv_cache_bytes"]:
        check(f"{name} present", any(n == name for n, _ in after))
    check("queue empty", value(after, "engine_queue_depth") == 0)
    if FAILED:
        print(f"{len(FAILED)} check(s) failed: {', '.join(FAILED)}")
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
