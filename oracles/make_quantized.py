"""Quantized variants of the tiny models, made with mlx-lm's own quantizer.

    oracles/.venv/bin/python oracles/make_quantized.py

- tiny-llama-trained-q4  affine 4-bit, group 64, with a mixed per-module scheme: lm_head at
                         8 bits, layer 0's down_proj left unquantized (explicit `false`)
- tiny-qwen3-q8          affine 8-bit, group 32 everywhere (tied, so the embedding doubles
                         as the quantized head)
- tiny-gemma3-q4         affine 4-bit, group 32 (tied quantized head, rotating caches)
- tiny-gemma4-q4         affine 4-bit, group 32 (quantized per-layer embedding; the 16-wide
                         per-layer projection stays unquantized because 16 % 32 != 0)

- tiny-gemma3-mm-q4      the gemma3 wrapper, 4-bit g32: oracles/make_wrappers.py

- tiny-qwen3-moe-q4  qwen3_moe cast to bf16, affine 4-bit g32, routers 8-bit g64:
                     oracles/make_moe.py

`make_quantized.py tiny-gemma4-q4` writes only that one.

Each is mlx_lm.utils.quantize_model on the committed f32/bf16 model, written with
mlx-lm's save_model/save_config next to copies of the tokenizer files.
"""

import shutil
import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.utils import quantize_model, save_config, save_model

from provenance import golden_dir, provenance, resolve, write_json

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]


def mixed_q4(path, module):
    if path == "lm_head":
        return {"group_size": 64, "bits": 8, "mode": "affine"}
    if path == "model.layers.0.mlp.down_proj":
        return False
    return True


def make(src: str, dst: str, bits: int, group_size: int, predicate, notes: str) -> None:
    mx.set_default_device(mx.cpu)
    model, _, config = load(str(resolve(f"models/{src}")), return_config=True)
    model, qconfig = quantize_model(model, config, group_size, bits, quant_predicate=predicate)
    if predicate is mixed_q4:
        # mlx-lm records `True` paths implicitly; record the skipped one explicitly so the
        # per-module `false` form is exercised too.
        qconfig["quantization"]["model.layers.0.mlp.down_proj"] = False
        qconfig["quantization_config"] = qconfig["quantization"]
    dest = golden_dir(f"models/{dst}")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    save_model(dest, model)
    save_config(qconfig, dest / "config.json")
    for f in TOKENIZER_FILES:
        shutil.copy(resolve(f"models/{src}") / f, dest / f)
    write_json(dest / "provenance.json", {"provenance": provenance("mlx-lm", "mlx-lm"),
                                          "generator": "oracles/make_quantized.py", "notes": notes})
    size = sum(f.stat().st_size for f in dest.iterdir())
    print(f"{dest}: {size / 1e6:.2f} MB")


def main(only=None) -> None:
    jobs = {
        "tiny-llama-trained-q4": lambda: make("tiny-llama-trained", "tiny-llama-trained-q4", 4, 64, mixed_q4,
         "affine 4-bit g64 via mlx_lm.utils.quantize_model; lm_head 8-bit; layer 0 down_proj unquantized"),
        "tiny-qwen3-q8": lambda: make("tiny-qwen3", "tiny-qwen3-q8", 8, 32, None,
                                      "affine 8-bit g32 via mlx_lm.utils.quantize_model"),
        "tiny-gemma3-q4": lambda: make("tiny-gemma3", "tiny-gemma3-q4", 4, 32, None,
                                       "affine 4-bit g32 via mlx_lm.utils.quantize_model"),
        "tiny-gemma4-q4": lambda: make("tiny-gemma4", "tiny-gemma4-q4", 4, 32, None,
                                       "affine 4-bit g32 via mlx_lm.utils.quantize_model"),
        # The quantized gemma3 wrapper: oracles/make_wrappers.py (imported when asked for).
        "tiny-gemma3-mm-q4": lambda: __import__("make_wrappers").make_gemma3_mm_q4(),
        # The quantized qwen3_moe: oracles/make_moe.py (imported when asked for).
        "tiny-qwen3-moe-q4": lambda: __import__("make_moe").make_qwen3_moe_q4(),
    }
    for name in only or jobs:
        jobs[name]()


if __name__ == "__main__":
    main(sys.argv[1:] or None)
