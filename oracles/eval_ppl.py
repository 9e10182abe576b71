"""Perplexity as `mlx_lm.perplexity` 0.32.2 computes it, on a local held-out text file.

    oracles/.venv/bin/python oracles/eval_ppl.py [--model DIR] [--data FILE]
        [--sequence-length N] [--num-samples N] [--batch-size N] [--seed N]
        [--json OUT] [--golden NAME]

mlx_lm.perplexity reads a Hugging Face dataset through `datasets` (not installed in the
oracle venv, and offline here). Everything else runs through mlx_lm.perplexity's own
functions: its `load_data` (seeded numpy permutation of the documents, each encoded by
mlx-lm's TextDataset with eos appended, concatenated, cut to whole sequences, the first
`num_samples` kept) and its `eval_ppl` (batches of `batch_size` rows, logits of row[:-1]
in float32, nn.losses.cross_entropy against row[1:], one concatenated loss vector, its
mean, exp). Only the dataset loader is replaced: `load_dataset` returns mlx-lm's own
TextDataset over the file's documents (paragraphs: the text split on blank lines, each
stripped, empty ones skipped; harness/src/eval/data.rs reads the file the same way).
Seeds as mlx_lm.perplexity's main: np.random.seed(seed) and mx.random.seed(seed).

The golden also carries each double's IEEE-754 bits (`ppl_bits`), compared exactly.
--json writes the numbers (and the token matrix) to OUT; --golden NAME writes
goldens/eval/NAME/index.json with provenance (the reference set with
HARNESS_WRITE_REFERENCE=1) for the model goldens/models/NAME unless --model says otherwise.
"""

import argparse
import json
import struct
import sys
import types
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlx_lm.perplexity as perplexity
from mlx_lm.tuner.datasets import TextDataset
from mlx_lm.utils import load

from provenance import golden_dir, provenance, write_json

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO / "goldens" / "eval" / "heldout.txt"


def bits(x: float) -> int:
    """The IEEE-754 bits of a double, so that a reader compares it exactly."""
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def documents(path: Path) -> list[str]:
    parts = (p.strip() for p in path.read_text(encoding="utf-8").split("\n\n"))
    return [p for p in parts if p]


def run(model_dir: str, data_path: Path, seq_len: int, num_samples: int, batch_size: int,
        seed: int) -> dict:
    np.random.seed(seed)
    mx.random.seed(seed)
    model, tokenizer = load(model_dir)
    records = [{"text": d} for d in documents(data_path)]

    def local_dataset(args, tok):
        return TextDataset(records, tok), [], []

    perplexity.load_dataset = local_dataset
    data = perplexity.load_data(tokenizer, str(data_path), num_samples=num_samples,
                                sequence_length=seq_len)
    ppl, se = perplexity.eval_ppl(model, data, batch_size=batch_size)
    return {
        "ppl": ppl,
        "ppl_standard_error": se,
        "rows": data.shape[0],
        "tokens_scored": data.shape[0] * (data.shape[1] - 1),
        "data": data.tolist(),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", help="model dir (default with --golden NAME: goldens/models/NAME)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--sequence-length", type=int, default=64)
    p.add_argument("--num-samples", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--json", type=Path)
    p.add_argument("--golden")
    a = p.parse_args()
    if a.model is None:
        if not a.golden:
            p.error("--model is required without --golden")
        a.model = str(REPO / "goldens" / "models" / a.golden)
    out = run(a.model, a.data, a.sequence_length, a.num_samples, a.batch_size, a.seed)
    print(f"mlx_lm.perplexity: ppl {out['ppl']!r} ± {out['ppl_standard_error']!r} "
          f"({out['rows']} rows, {out['tokens_scored']} tokens scored)")
    settings = {
        "data": str(a.data.resolve().relative_to(REPO)) if a.data.resolve().is_relative_to(REPO)
        else str(a.data),
        "sequence_length": a.sequence_length,
        "num_samples": a.num_samples,
        "batch_size": a.batch_size,
        "seed": a.seed,
    }
    if a.json:
        a.json.write_text(json.dumps({**out, "settings": settings, "ppl_bits": bits(out["ppl"]),
                                      "ppl_standard_error_bits": bits(out["ppl_standard_error"])}))
    if a.golden:
        dest = golden_dir(f"eval/{a.golden}")
        write_json(dest / "index.json", {
            "provenance": provenance("mlx-lm (mlx_lm.perplexity)", "mlx-lm"),
            "generator": "oracles/eval_ppl.py",
            "model": f"models/{a.golden}",
            "settings": settings,
            "ppl": out["ppl"],
            "ppl_standard_error": out["ppl_standard_error"],
            "ppl_bits": bits(out["ppl"]),
            "ppl_standard_error_bits": bits(out["ppl_standard_error"]),
            "rows": out["rows"],
            "tokens_scored": out["tokens_scored"],
            "data": out["data"],
        })
        print(f"wrote {dest / 'index.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
