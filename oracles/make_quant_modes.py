"""The tiny models in MLX's floating-point quantization modes, made with mlx-lm's own quantizer.

    HARNESS_WRITE_REFERENCE=1 oracles/.venv/bin/python oracles/make_quant_modes.py [NAME ...]   (its manifest rows)

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

import sys
from pathlib import Path

import mlx.core as mx

import tinymodels
from tinymodels import Job, quantize

GENERATOR = "oracles/make_quant_modes.py"


def mixed_modes(path, module):
    if "self_attn" in path:
        return {"group_size": 64, "bits": 8, "mode": "affine"}
    if path == "lm_head":
        return {"group_size": None, "bits": None, "mode": "mxfp8"}
    if path == "model.embed_tokens":
        return {"group_size": 32, "bits": 4}
    return True


def make_llama_mxfp4(job: Job) -> Path:
    return quantize(job, "tiny-llama-trained", "mxfp4 (4-bit g32) everywhere via mlx_lm.utils.quantize_model",
                    GENERATOR, mode="mxfp4")


def make_llama_nvfp4(job: Job) -> Path:
    return quantize(job, "tiny-llama-trained",
                    "nvfp4 (4-bit g16, no global scale) everywhere via mlx_lm.utils.quantize_model", GENERATOR,
                    mode="nvfp4")


def make_llama_mxfp8(job: Job) -> Path:
    return quantize(job, "tiny-llama-trained", "mxfp8 (8-bit g32) everywhere via mlx_lm.utils.quantize_model",
                    GENERATOR, mode="mxfp8")


def make_llama_mixed_modes(job: Job) -> Path:
    return quantize(job, "tiny-llama-trained",
                    "mxfp4 by default via mlx_lm.utils.quantize_model; attention affine 8-bit g64; lm_head mxfp8 "
                    "with null group_size/bits; embedding {group_size 32, bits 4} without a mode (affine)",
                    GENERATOR, mode="mxfp4", predicate=mixed_modes)


def make_qwen3_moe_mxfp4(job: Job) -> Path:
    return quantize(job, "tiny-qwen3-moe",
                    "cast to bf16, mxfp4 via mlx_lm.utils.quantize_model (routers affine 8-bit g64 by qwen3_moe's "
                    "quant_predicate); its L1 golden needs make_moe.patch_gather_qmm on MLX 0.32.2", GENERATOR,
                    mode="mxfp4", dtype=mx.bfloat16)


if __name__ == "__main__":
    tinymodels.main({"make_quant_modes": sys.modules[__name__]})
