"""One rank of a distributed benchmark leg for mlx-lm (`harness bench --suite distributed`).

    python oracles/bench_dist_leg.py --model DIR --prompt-ids FILE --max-tokens N --mode single|tensor|pipeline

Started once per rank with MLX_RANK and MLX_HOSTFILE in the environment, exactly as
`mlx.launch --backend ring` starts a script on one machine (the harness starts the ranks
itself so that each rank's exit status and output are its own, and each is bounded and
killed by pid). `single` runs without a group, as oracles/bench_leg.py does.

The model is loaded by mlx-lm's own `sharded_load` (tensor_group or pipeline_group), the
path `mlx_lm.generate` takes under mlx.launch. The bench models carry no tokenizer and the
leg feeds token ids, so the tokenizer load inside `sharded_load` is replaced by a stub
(nothing else of the load changes). Timing is oracles/bench_leg.py's `run` (one discarded
warm-up generation, then one measured one; TTFT to the first token id on the host; decode
= (n - 1) / (last - first token time); peak memory reset before the measured run).

Every rank prints one JSON line with its rank and its own peak memory.
"""

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_leg import run  # noqa: E402


def load(model_dir: Path, mode: str):
    if mode == "single":
        from mlx_lm.utils import load_model
        model, _ = load_model(model_dir)
        return model, 0, 1
    import mlx_lm.utils as utils
    utils.load_tokenizer = lambda *args, **kwargs: None  # the bench models have no tokenizer
    group = mx.distributed.init(strict=True, backend="ring")
    if mode == "tensor":
        model, _ = utils.sharded_load(str(model_dir), tensor_group=group)
    else:
        model, _ = utils.sharded_load(str(model_dir), pipeline_group=group)
    return model, group.rank(), group.size()


def barrier(size: int) -> None:
    """Waits for every rank (and for this rank's queued steps: generate_step evaluates one
    step ahead), so that no rank exits while a peer still needs it."""
    mx.synchronize()
    if size > 1:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-ids", required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--mode", choices=["single", "tensor", "pipeline"], required=True)
    args = ap.parse_args()
    model, rank, size = load(Path(args.model), args.mode)
    mx.eval(model.parameters())
    ids = json.loads(Path(args.prompt_ids).read_text())
    run(model, ids, args.max_tokens)  # warm-up, discarded
    barrier(size)
    mx.clear_cache()
    mx.reset_peak_memory()
    ttft, decode, n, kv_bytes = run(model, ids, args.max_tokens)
    peak = mx.get_peak_memory()
    barrier(size)
    print(json.dumps({
        "stack": "mlx-lm",
        "rank": rank,
        "size": size,
        "prompt_tokens": len(ids),
        "generated_tokens": n,
        "ttft_s": ttft,
        "prefill_tps": len(ids) / ttft,
        "decode_tps": decode,
        "peak_memory_bytes": peak,
        "kv_bytes": kv_bytes,
    }), flush=True)


if __name__ == "__main__":
    main()
