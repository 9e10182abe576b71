"""Sampling goldens: mlx-lm 0.32.2's sampler chain and logits processors, seeded.

    oracles/.venv/bin/python oracles/gen_sampling.py [MODEL ...] [--out DIR]

For each model and each setting, `mx.random.seed(seed)` then mlx_lm's generate_step with
make_sampler(...) and make_logits_processors(...) on a raw and a chat prompt; the sampled
ids (48 per prompt) are stored with the settings in goldens/sampling/<model>/index.json.
"""

import argparse
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from transformers import AutoTokenizer

from provenance import golden_dir, provenance, resolve, write_json

MODELS = ["tiny-llama-trained", "tiny-qwen3", "tiny-llama-trained-q4"]
STEPS = 48
SETTINGS = [
    {"name": "temp0.8-top_p0.9", "seed": 1, "temp": 0.8, "top_p": 0.9},
    {"name": "temp0.7-top_k20-min_p0.05", "seed": 2, "temp": 0.7, "top_k": 20, "min_p": 0.05},
    {"name": "temp1.0-min_p0.1-keep3", "seed": 3, "temp": 1.0, "min_p": 0.1, "min_tokens_to_keep": 3},
    {"name": "temp0.9-penalties-bias", "seed": 4, "temp": 0.9, "repetition_penalty": 1.3,
     "presence_penalty": 0.5, "frequency_penalty": 0.3, "logit_bias": {"50": 2.0, "100": -5.0}},
    {"name": "greedy-repetition1.5", "seed": 5, "temp": 0.0, "repetition_penalty": 1.5,
     "repetition_context_size": 8},
    {"name": "temp1.5-plain", "seed": 6, "temp": 1.5},
]
PROMPTS = [("raw", "The little robot"), ("chat", "What does the robot like?")]


def sample(model, ids, s):
    mx.random.seed(s["seed"])
    sampler = make_sampler(temp=s["temp"], top_p=s.get("top_p", 0.0), min_p=s.get("min_p", 0.0),
                           min_tokens_to_keep=s.get("min_tokens_to_keep", 1), top_k=s.get("top_k", 0))
    bias = {int(k): v for k, v in s.get("logit_bias", {}).items()} or None
    processors = make_logits_processors(
        logit_bias=bias,
        repetition_penalty=s.get("repetition_penalty"),
        repetition_context_size=s.get("repetition_context_size", 20),
        presence_penalty=s.get("presence_penalty"),
        frequency_penalty=s.get("frequency_penalty"),
    )
    return [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=STEPS, sampler=sampler,
                                             logits_processors=processors)]


def main(names, out_root=None) -> None:
    mx.set_default_device(mx.cpu)
    for name in names:
        path = resolve(f"models/{name}")
        model, _ = load(str(path))
        hf = AutoTokenizer.from_pretrained(str(path))
        cases = []
        for s in SETTINGS:
            for kind, text in PROMPTS:
                if kind == "chat":
                    rendered = hf.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
                    ids = hf.encode(rendered, add_special_tokens=False)
                else:
                    ids = hf.encode(text, add_special_tokens=True)
                cases.append({"name": f"{s['name']}/{kind}", "settings": s, "prompt_ids": ids,
                              "sampled_ids": sample(model, ids, s)})
        dest = Path(out_root) / name if out_root else golden_dir(f"sampling/{name}")
        write_json(dest / "index.json", {"provenance": provenance("mlx-lm", "mlx-lm"),
                                         "generator": "oracles/gen_sampling.py", "model": f"models/{name}",
                                         "steps": STEPS, "cases": cases})
        print(f"{name}: {len(cases)} cases -> {dest}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=MODELS)
    ap.add_argument("--out", help="write <out>/<model>/ instead of the goldens (live diffs)")
    args = ap.parse_args()
    main(args.models, args.out)
