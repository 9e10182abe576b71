"""Profile of mlx-lm 0.32.2's single-stream decode loop (the peer of the engine's
ENGINE_DECODE_PROFILE): where the host thread spends each step and how busy MLX's stream
thread is. Run with the oracle venv:

    oracles/.venv/bin/python benches/decode_profile.py --model DIR --prompt-tokens 256 \
        --steps 256 [--dot step.dot]

The loop is generate_step's (generation_stream, the prompt minus its last token prefilled,
step n+1 built and async_eval'd before step n's id is read, clear_cache every 256 steps);
each phase is timed around the same calls generate_step makes. Per-thread CPU time comes
from /proc/self/task/*/schedstat (ns on a CPU), taken before and after the decode steps, so
it does not depend on what else the machine runs. Prints one JSON line.
"""

import argparse
import json
import os
import random
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model


def thread_cpu_ns():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[0])
        except OSError:
            pass
    return out


def dot_nodes(path):
    text = Path(path).read_text()
    # export_to_dot writes one `{ rank=source; ... }` line per input and one node line per
    # primitive (a `[label ="Name"` record of shape rectangle); count the primitives.
    return sum(1 for line in text.splitlines() if "shape=rectangle" in line)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--dot", help="write one decode step's graph here (mx.export_to_dot)")
    args = ap.parse_args()
    model, _ = load_model(Path(args.model))
    mx.eval(model.parameters())
    vocab = model.args.vocab_size
    rng = random.Random(1)
    prompt = mx.array([rng.randrange(vocab) for _ in range(args.prompt_tokens)])

    def step(tokens, cache):
        with mx.stream(generation_stream):
            logits = model(tokens[None], cache=cache)[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            return mx.argmax(logprobs, axis=-1), logprobs.squeeze(0)

    result = {}
    for rep in range(2):  # the first run warms up (compiles the shapeless kernels)
        cache = make_prompt_cache(model)
        with mx.stream(generation_stream):
            model(prompt[None, :-1], cache=cache)
            mx.eval([c.state for c in cache])
            mx.clear_cache()
        y, logprobs = step(prompt[-1:], cache)
        mx.async_eval(y, logprobs)
        mx.eval(y)
        build = enqueue = wait = 0.0
        marks = []
        cpu0 = thread_cpu_ns()
        t0 = time.perf_counter()
        for n in range(args.steps):
            a = time.perf_counter()
            marks.append(a)
            next_y, next_logprobs = step(y, cache)
            b = time.perf_counter()
            if rep == 1 and n == 8 and args.dot:
                mx.export_to_dot(args.dot, next_y, next_logprobs)
                b = time.perf_counter()
            mx.async_eval(next_y, next_logprobs)
            c = time.perf_counter()
            y.item()
            d = time.perf_counter()
            if n % 256 == 0:
                mx.clear_cache()
            build += b - a
            enqueue += c - b
            wait += d - c
            y, logprobs = next_y, next_logprobs
        y.item()
        wall = time.perf_counter() - t0
        cpu1 = thread_cpu_ns()
        per = {t: (cpu1[t] - cpu0.get(t, 0)) / args.steps / 1e3 for t in cpu1}
        main_tid = str(os.getpid())
        gaps = sorted((b - a) * 1e6 for a, b in zip(marks, marks[1:]))
        others = sorted((v for t, v in per.items() if t != main_tid), reverse=True)
        result = {
            "stack": "mlx-lm",
            "steps": args.steps,
            "prompt_tokens": args.prompt_tokens,
            "tok_s": args.steps / wall,
            "step_us": wall / args.steps * 1e6,
            "step_p10_us": gaps[len(gaps) * 10 // 100],
            "step_p25_us": gaps[len(gaps) * 25 // 100],
            "step_p50_us": gaps[len(gaps) * 50 // 100],
            "host_build_us": build / args.steps * 1e6,
            "host_async_eval_us": enqueue / args.steps * 1e6,
            "host_wait_us": wait / args.steps * 1e6,
            "host_cpu_us": per.get(main_tid, 0.0),
            "busiest_other_thread_cpu_us": others[0] if others else 0.0,
            "other_threads_cpu_us": sum(others),
        }
    if args.dot:
        result["step_graph_primitives"] = dot_nodes(args.dot)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
