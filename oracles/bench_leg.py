"""One benchmark leg for mlx-lm: load a model dir, run one discarded warm-up generation,
then one measured generation of the given prompt ids; print one JSON line.

    python oracles/bench_leg.py --model DIR --prompt-ids FILE --max-tokens N [--optiq-kv-config F]

With --optiq-kv-config the leg is mlx-optiq 0.7.7's quantized-KV path (stack "mlx-optiq"),
installed as oracles/gen_l2.py installs it: mixed per-layer KV from F, streaming conversion,
the fused KV-tiled kernel, quantized_kv_start 0.

The engine's `engine bench` leg measures the same things the same way: TTFT from the start
of the prompt to the first token id on the host; decode tok/s = (n - 1) / (last - first
token time); peak memory after a reset before the measured run.
"""

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

KV_KWARGS = {}


def install_optiq(kv_config: str) -> None:
    import optiq  # noqa: F401
    from optiq.runtime.fused_quant_sdpa import install as install_fused_sdpa
    from optiq.runtime.streaming_kv_quant import install as install_streaming_kv
    from optiq.serve import _load_kv_config, install_mixed_kv
    install_streaming_kv()
    install_fused_sdpa()
    install_mixed_kv(kv_configs=_load_kv_config(kv_config), quantized_kv_start=0)
    KV_KWARGS.update(kv_bits=8, kv_group_size=64, quantized_kv_start=0)


def run(model, ids, max_tokens):
    import sys
    import mlx_lm.generate  # noqa: F401  (the module, not the function it re-exports)
    generate_step = sys.modules["mlx_lm.generate"].generate_step
    cache = make_prompt_cache(model)
    times = []
    t0 = time.perf_counter()
    for _token, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens,
                                   prompt_cache=cache, **KV_KWARGS):
        times.append(time.perf_counter())
    ttft = times[0] - t0
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    return ttft, decode, len(times), sum(c.nbytes for c in cache)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-ids", required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--optiq-kv-config", help="run mlx-optiq's quantized-KV path with this kv_config.json")
    args = ap.parse_args()
    if args.optiq_kv_config:
        install_optiq(args.optiq_kv_config)
    model, _ = load_model(Path(args.model))
    if args.optiq_kv_config:
        from mlx_lm.models import base
        from optiq.runtime.kv.rotating import _reassert_sdpa
        _reassert_sdpa(base, model)
    mx.eval(model.parameters())
    ids = json.loads(Path(args.prompt_ids).read_text())
    run(model, ids, args.max_tokens)  # warm-up, discarded
    mx.clear_cache()
    mx.reset_peak_memory()
    ttft, decode, n, kv_bytes = run(model, ids, args.max_tokens)
    print(json.dumps({
        "stack": "mlx-optiq" if args.optiq_kv_config else "mlx-lm",
        "prompt_tokens": len(ids),
        "generated_tokens": n,
        "ttft_s": ttft,
        "prefill_tps": len(ids) / ttft,
        "decode_tps": decode,
        "peak_memory_bytes": mx.get_peak_memory(),
        "kv_bytes": kv_bytes,
    }))


if __name__ == "__main__":
    main()
