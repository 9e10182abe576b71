"""Speculative-decoding goldens: mlx-lm 0.32.2's `speculative_generate_step` with a small
trained drafter, per case: the emitted ids, the accept/reject trace (`from_draft`: the id
was a draft the target accepted) and the log-probabilities each id came with.

    oracles/.venv/bin/python oracles/gen_spec.py [TARGET] [--draft DRAFT] [--out DIR]

Cases: the L1 cases' raw1, raw2, chat0 and chat1 prompts plus an off-corpus prompt (flat
distributions: low acceptance, near-ties), each for γ = 1..4, greedy, 24 tokens; raw2 and
chat1 again with 4-token prefill chunks (γ = 3); and two seeded sampled cases (temp 0.7,
γ = 2 and 4). The generator is run directly (no EOS stop), so every case has its full length.

Output: goldens/spec/<target>/index.json + logprobs.bin (log-probabilities in the model's dtype).
"""

import argparse
import json
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import speculative_generate_step
from mlx_lm.sample_utils import make_sampler

from provenance import TensorFile, golden_dir, provenance, resolve, write_json

MAX_TOKENS = 24
OFF_CORPUS = "purple engines whisper quietly about"


def cases(l1, tokenizer):
    prompts = {c["name"]: c["prompt_ids"] for c in l1["cases"]}
    prompts["offcorpus"] = tokenizer.encode(OFF_CORPUS)
    out = []
    for name in ["raw1", "raw2", "chat0", "chat1", "offcorpus"]:
        for gamma in (1, 2, 3, 4):
            out.append({"name": f"{name}-g{gamma}", "prompt": name, "prompt_ids": prompts[name],
                        "num_draft": gamma, "prefill_step": 512, "temp": 0.0, "seed": 0})
    for name in ["raw2", "chat1"]:
        out.append({"name": f"{name}-g3-chunk4", "prompt": name, "prompt_ids": prompts[name],
                    "num_draft": 3, "prefill_step": 4, "temp": 0.0, "seed": 0})
    for gamma, seed in ((2, 11), (4, 12)):
        out.append({"name": f"chat0-g{gamma}-temp0.7", "prompt": "chat0", "prompt_ids": prompts["chat0"],
                    "num_draft": gamma, "prefill_step": 512, "temp": 0.7, "seed": seed})
    return out


def main(target, draft, out_root) -> None:
    mx.set_default_device(mx.cpu)
    model, tokenizer = load(str(resolve(f"models/{target}")))
    draft_model, _ = load(str(resolve(f"models/{draft}")))
    l1 = json.loads((resolve(f"l1/{target}") / "index.json").read_text())
    data = TensorFile()
    done = []
    for case in cases(l1, tokenizer):
        mx.random.seed(case["seed"])
        sampler = make_sampler(temp=case["temp"]) if case["temp"] > 0 else None
        ids, trace, logprobs = [], [], []
        for token, lp, from_draft in speculative_generate_step(
            mx.array(case["prompt_ids"]), model, draft_model,
            num_draft_tokens=case["num_draft"], max_tokens=MAX_TOKENS, sampler=sampler,
            prefill_step_size=case["prefill_step"],
        ):
            ids.append(int(token))
            trace.append(bool(from_draft))
            logprobs.append(lp)
        case = dict(case, ids=ids, from_draft=trace,
                    logprobs=[data.add(f"{case['name']}/{k}", lp) for k, lp in enumerate(logprobs)])
        done.append(case)
        print(f"{case['name']:22s} accepted {sum(trace):2d}/{len(trace)}  {ids[:10]}")
    dest = Path(out_root) / target if out_root else golden_dir(f"spec/{target}")
    data.write(dest / "logprobs.bin")
    write_json(dest / "index.json", {
        "provenance": provenance("mlx-lm", "mlx-lm"),
        "generator": "oracles/gen_spec.py",
        "model": f"models/{target}",
        "draft_model": f"models/{draft}",
        "data": "logprobs.bin",
        "settings": {"path": "mlx_lm.generate.speculative_generate_step", "max_tokens": MAX_TOKENS,
                     "eos": "not stopped (the generator is read to max_tokens)"},
        "cases": done,
    })
    print(f"spec/{target} -> {dest}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("target", nargs="?", default="tiny-llama-trained")
    ap.add_argument("--draft", default="tiny-llama-draft")
    ap.add_argument("--out", help="write <out>/<target>/ instead of the goldens (live diffs)")
    args = ap.parse_args()
    main(args.target, args.draft, args.out)
