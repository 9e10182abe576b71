"""One benchmark leg for mlx-lm: load a model dir, run one discarded warm-up generation,
then one measured generation of the given prompt ids; print one JSON line.

    python oracles/bench_leg.py --model DIR --prompt-ids FILE --max-tokens N

The engine's `engine bench` leg measures the same things the same way: TTFT from the start
of the prompt to the first token id on the host; decode tok/s = (n - 1) / (last - first
token time); peak memory after a reset before the measured run.
"""

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model


def run(model, ids, max_tokens):
    times = []
    t0 = time.perf_counter()
    for _token, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens):
        times.append(time.perf_counter())
    ttft = times[0] - t0
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    return ttft, decode, len(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-ids", required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    args = ap.parse_args()
    model, _ = load_model(Path(args.model))
    mx.eval(model.parameters())
    ids = json.loads(Path(args.prompt_ids).read_text())
    run(model, ids, args.max_tokens)  # warm-up, discarded
    mx.clear_cache()
    mx.reset_peak_memory()
    ttft, decode, n = run(model, ids, args.max_tokens)
    print(json.dumps({
        "stack": "mlx-lm",
        "prompt_tokens": len(ids),
        "generated_tokens": n,
        "ttft_s": ttft,
        "prefill_tps": len(ids) / ttft,
        "decode_tps": decode,
        "peak_memory_bytes": mx.get_peak_memory(),
    }))


if __name__ == "__main__":
    main()
