"""B=N goldens: mlx-lm 0.32.2's batched generation (`BatchGenerator`, the code path of
`batch_generate` and of mlx_lm.server's batching) on a tiny model, per row: the prompt ids,
every step's full-vocabulary logits (as f32) and the greedy ids.

    oracles/.venv/bin/python oracles/gen_batch.py [MODEL] [--out DIR]

Scenarios (prompts are the L1 cases' prompt ids, so lengths differ and rows are left-padded):
- b2:        raw1 + chat1 inserted together, 16 tokens each
- b4:        raw0 + raw1 + raw2 + chat0 inserted together, 16 tokens each
- joinleave: A = raw0 (3 tokens: it leaves early) and B = raw2 (16) start together;
             C = chat1 (16) is inserted before the 4th `next()` call, while A and B decode.
- ring:      A = raw2 (6) alone; B = raw0 (16) joins before call 2, C = raw1 (10) before
             call 4, A leaves after 6. On a sliding-window model (tiny-gemma3: window 8)
             A's ring wraps at its first step (25 prompt tokens cached), B's group does not
             (3), so B joins a wrapped batch from an unwrapped one; C's group wraps (10).

With --kv-bits (mlx-lm 0.32.2's BatchGenerator has no quantized batch cache), each row is
instead its own single-sequence run, `generate_step(kv_bits=…, quantized_kv_start=0)`
(QuantizedKVCache, mlx-lm's quantized SDPA), with the same scenarios: the B=N reference
for quantized KV is every row's single-sequence numbers (golden `<model><suffix>`).

Logits are captured by a per-row logits processor that returns its input unchanged (the
sampler sees exactly these logits; recording them does not change the path). EOS does not
stop rows (stop_tokens=None), so every row runs its full length.

Output: goldens/batch/<model>/index.json + logits.bin.
"""

import argparse
import json
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, generate_step

from provenance import TensorFile, golden_dir, provenance, resolve, write_json
from make_moe import patch_gather_qmm

# Quantized experts (tiny-nemotron-h-moe-q4's QuantizedSwitchLinear) on MLX 0.32.2: mlx-lm
# passes gather_qmm a `global_scale` keyword this MLX lacks (see make_moe.py).
patch_gather_qmm()

SCENARIOS = {
    "b2": [(0, "raw1", 16), (0, "chat1", 16)],
    "b4": [(0, "raw0", 16), (0, "raw1", 16), (0, "raw2", 16), (0, "chat0", 16)],
    "joinleave": [(0, "raw0", 3), (0, "raw2", 16), (3, "chat1", 16)],
    "ring": [(0, "raw2", 6), (2, "raw0", 16), (4, "raw1", 10)],
}


def run(model, rows):
    """rows: (insert before next() call k, name, prompt ids, max tokens)."""
    gen = BatchGenerator(model, stop_tokens=None)
    seen, ids, uid_name = {}, {}, {}

    def recorder(name):
        def record(tokens, logits):
            seen[name].append(logits)
            return logits
        return record

    pending = list(rows)
    call = 0
    while True:
        for row in [r for r in pending if r[0] == call]:
            _, name, prompt, max_tokens = row
            seen[name], ids[name] = [], []
            (uid,) = gen.insert([prompt], max_tokens=[max_tokens], logits_processors=[[recorder(name)]])
            uid_name[uid] = name
        pending = [r for r in pending if r[0] != call]
        prompt_responses, gen_responses = gen.next()
        call += 1
        for r in gen_responses:
            ids[uid_name[r.uid]].append(int(r.token))
        if not prompt_responses and not gen_responses and not pending and not gen._unprocessed_sequences:
            break
    gen.close()
    # The hook also sees one pipelined step past a row's end; keep one vector per id.
    return {n: (ids[n], [l.astype(mx.float32).reshape(-1) for l in seen[n][:len(ids[n])]]) for n in ids}


def run_single(model, rows, kv):
    """Each row alone through generate_step with mlx-lm's KV quantization."""
    result = {}
    for _, name, prompt, max_tokens in rows:
        seen, ids = [], []

        def record(tokens, logits):
            seen.append(logits)
            return logits
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                      logits_processors=[record], **kv):
            ids.append(int(token))
        result[name] = (ids, [l.astype(mx.float32).reshape(-1) for l in seen[:len(ids)]])
    return result


def main(name, out_root, kv=None, suffix="") -> None:
    mx.set_default_device(mx.cpu)
    model, _ = load(str(resolve(f"models/{name}")))
    l1 = json.loads((resolve(f"l1/{name}") / "index.json").read_text())
    prompts = {c["name"]: c["prompt_ids"] for c in l1["cases"]}
    out = TensorFile()
    scenarios = []
    for scenario, rows in SCENARIOS.items():
        plan = [(at, case, prompts[case], m) for at, case, m in rows]
        result = run_single(model, plan, kv) if kv else run(model, plan)
        scenarios.append({"name": scenario, "rows": [{
            "name": case, "join_at": at, "max_tokens": m, "prompt_ids": prompts[case],
            "ids": result[case][0],
            "logits": [out.add(f"{scenario}/{case}/{k}", l) for k, l in enumerate(result[case][1])],
        } for at, case, m in rows]})
        print(scenario, {case: result[case][0][:8] for _, case, _ in rows})
    golden = name + suffix
    dest = Path(out_root) / golden if out_root else golden_dir(f"batch/{golden}")
    out.write(dest / "logits.bin")
    write_json(dest / "index.json", {
        "provenance": provenance("mlx-lm", "mlx-lm"),
        "generator": "oracles/gen_batch.py",
        "model": f"models/{name}",
        "data": "logits.bin",
        "settings": {"sampler": "greedy", "path": "mlx_lm.generate.BatchGenerator(stop_tokens=None)",
                     "prefill_batch_size": 8, "prefill_step_size": 2048} if not kv else
                    {"sampler": "greedy", "path": "mlx_lm.generate.generate_step per row",
                     "cache": "QuantizedKVCache", "prefill_step_size": 2048, **kv},
        "scenarios": scenarios,
    })
    print(f"batch/{golden} -> {dest}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="tiny-llama-trained")
    ap.add_argument("--out", help="write <out>/<model>/ instead of the goldens (live diffs)")
    ap.add_argument("--kv-bits", type=int, help="per-row generate_step with mlx-lm's KV quantization")
    ap.add_argument("--kv-group-size", type=int, default=64)
    ap.add_argument("--suffix", default="", help="golden name = model name + suffix")
    args = ap.parse_args()
    kv = None
    if args.kv_bits:
        kv = {"kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size, "quantized_kv_start": 0}
    main(args.model, args.out, kv, args.suffix)
