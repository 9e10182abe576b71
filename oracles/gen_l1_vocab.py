"""L1 goldens at real vocabulary sizes: mlx-lm 0.32.2 greedy generation on tiny models whose
embedding (and unembedding) is resized to a real tokenizer's vocabulary.

    oracles/.venv/bin/python oracles/gen_l1_vocab.py [NAME ...] [--out DIR]

NAME is one of the harness's pairings (`vocab-qwen3`, `vocab-qwen3-5`, `vocab-qwen3-next`,
`vocab-gemma3`, `vocab-llama3.1`, `vocab-mistral-v3`, see harness/src/parity/vocab.rs). The model dirs are not committed: the
harness writes them into the cache dir (`harness goldens vocab-model NAME`, a seeded
generator over a tiny model of goldens/models plus a fetched tokenizer fixture), and this
script reads those bytes; the golden pins the weights file's sha256.

Per prompt (raw texts in several scripts, and a chat turn where the tokenizer has a
template): the prompt ids as mlx_lm.generate makes them (transformers tokenizer; raw with
special tokens, chat as the rendered template without), the rendered chat string, 24
greedy ids, and for the prefill and the first 3 decode steps the sha256 of the
full-vocabulary f32 logits (little-endian) with their 8 largest entries (full vectors at
262k entries would make multi-megabyte goldens).

Output: goldens/l1-vocab/<NAME>/index.json.
"""

import argparse
import hashlib
import os
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.generate import generate_step
from transformers import AutoTokenizer

from gen_l1 import prompt_cases
from provenance import REPO, golden_dir, provenance, write_json

NAMES = ["vocab-qwen3", "vocab-qwen3-5", "vocab-qwen3-next", "vocab-gemma3", "vocab-llama3.1",
         "vocab-mistral-v3"]
RAW_PROMPTS = [
    "The little robot",
    "Ünïcödé façade — naïve café. 日本語のテキスト، العربية, русский 🙂🚀",
    "def area(r):\n    return 3.14159 * r ** 2\n\nprint(area(2))",
]
CHAT = [{"role": "user", "content": "What color is the sky? Answer in one word."}]
LOGIT_STEPS = 4   # prefill + 3 decode steps
GREEDY_STEPS = 24
TOP = 8


def model_dir(name: str) -> Path:
    """The harness writes (once) and names the model dir; both sides read the same bytes."""
    harness = os.environ.get("HARNESS_BIN") or str(REPO / "target/debug/harness")
    cmd = [harness] if Path(harness).is_file() else ["cargo", "run", "-q", "-p", "harness", "--"]
    out = subprocess.run(cmd + ["goldens", "vocab-model", name], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def digest(logits):
    values = np.array(logits.astype(mx.float32).reshape(-1))
    top = np.argsort(-values, kind="stable")[:TOP]
    return {"sha256": hashlib.sha256(values.astype("<f4").tobytes()).hexdigest(),
            "top": [[int(i), float(values[i])] for i in top]}


def vocab_size(model):
    """The model's vocab_size: its args', or its text model's (qwen3_5 keeps a text_config)."""
    for m in (model, getattr(model, "language_model", None)):
        if hasattr(getattr(m, "args", None), "vocab_size"):
            return int(m.args.vocab_size)
    return None


def run(model, prompt_ids):
    captured = []

    def capture(tokens, logits):
        if len(captured) < LOGIT_STEPS:
            captured.append(digest(logits))
        return logits

    ids = [int(t) for t, _ in generate_step(mx.array(prompt_ids), model, max_tokens=GREEDY_STEPS,
                                            logits_processors=[capture])]
    return ids, captured


def main(names, out_root) -> None:
    mx.set_default_device(mx.cpu)
    for name in names:
        path = model_dir(name)
        model, _ = load(str(path))
        hf = AutoTokenizer.from_pretrained(str(path))
        cases = prompt_cases(hf, RAW_PROMPTS, [CHAT] if hf.chat_template else [])
        for case in cases:
            case["greedy_ids"], case["logits"] = run(model, case["prompt_ids"])
        weights = path / "model.safetensors"
        dest = Path(out_root) / name if out_root else golden_dir(f"l1-vocab/{name}")
        write_json(dest / "index.json", {
            "provenance": provenance("mlx-lm", "mlx-lm"),
            "generator": "oracles/gen_l1_vocab.py",
            "model": name,
            "vocab_size": vocab_size(model),
            "tokenizer_length": len(hf),
            "source": (path / "SOURCE").read_text().strip() if (path / "SOURCE").is_file() else None,
            "weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
            "settings": {"sampler": "greedy", "cache": "KVCache", "logit_steps": LOGIT_STEPS,
                         "greedy_steps": GREEDY_STEPS, "top": TOP},
            "cases": cases,
        })
        print(f"{name}: {len(cases)} cases -> {dest}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", default=NAMES)
    ap.add_argument("--out", help="write <out>/<NAME>/ instead of the goldens (live diffs)")
    args = ap.parse_args()
    main(args.names, args.out)
