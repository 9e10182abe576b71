"""Fuse golden: what `mlx_lm fuse` 0.32.2 writes, as sha256 per file and per tensor.

    oracles/.venv/bin/python oracles/gen_fuse.py [--out DIR]

Each case runs `python -m mlx_lm fuse --model MODEL --adapter-path ADAPTERS --save-path OUT
[--dequantize]` in a subprocess on a committed tiny model and committed adapters (the
training goldens' `adapters/`, written by mlx-lm's trainer: oracles/gen_train.py), and
records the output dir as gen_convert.py records a converted one (`record`: every file's
sha256 and size, each safetensors tensor's dtype, shape and sha256, the config object).
The outputs themselves are not stored.

- llama-lora: tiny-llama-trained (bf16) + LoRA (`LoRALinear.fuse`: W + (scale·Bᵀ)·Aᵀ cast
  to W's dtype) on all 21 linears;
- llama-dora: the same model + DoRA (`DoRALinear.fuse`: the adapted W rescaled per row by
  m / ‖W‖, float32 out of a bf16 W);
- llama-q4-lora: tiny-llama-trained-q4 + LoRA: the quantized layers dequantized, fused and
  quantized again with their own group size / bits (layer 0's dense down_proj stays dense);
- llama-q4-dora-dequantize: tiny-llama-trained-q4 + DoRA with --dequantize: fused layers
  dense, then `dequantize_model` (the 8-bit lm_head, the embedding) and no quantization in
  the config;
- qwen3-q8-lora-dequantize: tiny-qwen3-q8 (tied, its quantized embedding the head) + LoRA
  with --dequantize;
- llama-full: tiny-llama-trained + fully fine-tuned last block (no `fuse()`: the saved
  weights replace the base's, as `load_adapters` loads them).

Output: goldens/fuse/index.json
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from gen_convert import record
from provenance import golden_dir, provenance, resolve, write_json

CASES = [
    ("llama-lora", "models/tiny-llama-trained", "train/tiny-llama-trained/adapters", []),
    ("llama-dora", "models/tiny-llama-trained", "train/tiny-llama-trained-dora/adapters", []),
    ("llama-q4-lora", "models/tiny-llama-trained-q4", "train/tiny-llama-trained-q4/adapters", []),
    ("llama-q4-dora-dequantize", "models/tiny-llama-trained-q4",
     "train/tiny-llama-trained-q4-dora/adapters", ["--dequantize"]),
    ("qwen3-q8-lora-dequantize", "models/tiny-qwen3-q8", "train/tiny-qwen3-q8/adapters", ["--dequantize"]),
    ("llama-full", "models/tiny-llama-trained", "train/tiny-llama-trained-full/adapters", []),
]


def run(name: str, model: str, adapters: str, args: list[str], tmp: Path) -> dict:
    out = tmp / name
    cmd = [sys.executable, "-m", "mlx_lm", "fuse", "--model", str(resolve(model)),
           "--adapter-path", str(resolve(adapters)), "--save-path", str(out), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return {"name": name, "model": model, "adapters": adapters, "args": args, **record(out)}


def main(out_root: Path | None, keep: Path | None) -> None:
    out = out_root or golden_dir("fuse")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = keep or Path(tmp)
        for name, model, adapters, args in CASES:
            r = run(name, model, adapters, args, work)
            results.append(r)
            print(f"{name}: {len(r['files'])} files, "
                  f"{sum(len(t) for t in r['tensors'].values())} tensors")
    write_json(out / "index.json", {
        "provenance": provenance("mlx_lm.fuse", "mlx-lm"),
        "generator": "oracles/gen_fuse.py",
        "cases": results,
    })


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--keep", type=Path, help="write the fused dirs here (for inspection)")
    a = parser.parse_args()
    main(a.out, a.keep)
