"""The tiny models in MLX's floating-point quantization modes, made with mlx-lm's own quantizer.

    HARNESS_WRITE_REFERENCE=1 oracles/.venv/bin/python oracles/make_quant_modes.py [NAME ...]

- tiny-llama-mxfp4        tiny-llama-trained, mxfp4 everywhere (4-bit, group 32, uint8 scales,
                          no biases): the embedding, every linear, the untied head
- tiny-llama-nvfp4        the same in nvfp4 (4-bit, group 16, no global scale)
- tiny-llama-mxfp8        the same in mxfp8 (8-bit, group 32)
- tiny-llama-mixed-modes  per-module modes the way mlx-lm writes overrides: mxfp4 by default
                          (the MLP), attention affine 8-bit g64, lm_head mxfp8 with
                          `"group_size": null, "bits": null` (the mode's defaults), the
                          embedding `{"group_size": 32, "bits": 4}` with no `mode` (affine, as
                          mlx-lm's loader reads a per-module entry without one)
- tiny-qwen3-moe-mxfp4    tiny-qwen3-moe cast to bf16, mxfp4: the experts become
                          QuantizedSwitchLinear in mxfp4 (gather_qmm), the routers affine 8-bit
                          g64 (qwen3_moe's own quant_predicate, whose entries carry no mode)

Each is mlx_lm.utils.quantize_model(..., mode=...) on the committed model, saved with
mlx-lm's save_model/save_config next to copies of the tokenizer files.
"""

import shutil
import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.utils import quantize_model, save_config, save_model

from provenance import golden_dir, provenance, resolve, write_json

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]


def mixed_modes(path, module):
    if "self_attn" in path:
        return {"group_size": 64, "bits": 8, "mode": "affine"}
    if path == "lm_head":
        return {"group_size": None, "bits": None, "mode": "mxfp8"}
    if path == "model.embed_tokens":
        return {"group_size": 32, "bits": 4}
    return True


def make(src, dst, mode, notes, predicate=None, dtype=None):
    mx.set_default_device(mx.cpu)
    model, _, config = load(str(resolve(f"models/{src}")), return_config=True)
    if dtype is not None:
        model.set_dtype(dtype)
    model, qconfig = quantize_model(model, config, None, None, mode=mode, quant_predicate=predicate)
    dest = golden_dir(f"models/{dst}")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    save_model(dest, model)
    save_config(qconfig, dest / "config.json")
    for f in TOKENIZER_FILES:
        shutil.copy(resolve(f"models/{src}") / f, dest / f)
    write_json(dest / "provenance.json", {"provenance": provenance("mlx-lm", "mlx-lm"),
                                          "generator": "oracles/make_quant_modes.py", "notes": notes})
    size = sum(f.stat().st_size for f in dest.iterdir())
    print(f"{dest}: {size / 1e6:.2f} MB")


JOBS = {
    "tiny-llama-mxfp4": lambda: make("tiny-llama-trained", "tiny-llama-mxfp4", "mxfp4",
                                     "mxfp4 (4-bit g32) everywhere via mlx_lm.utils.quantize_model"),
    "tiny-llama-nvfp4": lambda: make("tiny-llama-trained", "tiny-llama-nvfp4", "nvfp4",
                                     "nvfp4 (4-bit g16, no global scale) everywhere via mlx_lm.utils.quantize_model"),
    "tiny-llama-mxfp8": lambda: make("tiny-llama-trained", "tiny-llama-mxfp8", "mxfp8",
                                     "mxfp8 (8-bit g32) everywhere via mlx_lm.utils.quantize_model"),
    "tiny-llama-mixed-modes": lambda: make(
        "tiny-llama-trained", "tiny-llama-mixed-modes", "mxfp4",
        "mxfp4 by default via mlx_lm.utils.quantize_model; attention affine 8-bit g64; lm_head mxfp8 with "
        "null group_size/bits; embedding {group_size 32, bits 4} without a mode (affine)", mixed_modes),
    "tiny-qwen3-moe-mxfp4": lambda: make(
        "tiny-qwen3-moe", "tiny-qwen3-moe-mxfp4", "mxfp4",
        "cast to bf16, mxfp4 via mlx_lm.utils.quantize_model (routers affine 8-bit g64 by qwen3_moe's "
        "quant_predicate); its L1 golden needs make_moe.patch_gather_qmm on MLX 0.32.2", dtype=mx.bfloat16),
}


def main(only=None):
    for name in only or JOBS:
        JOBS[name]()


if __name__ == "__main__":
    main(sys.argv[1:] or None)
