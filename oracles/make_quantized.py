"""Quantized variants of the tiny models, made with mlx-lm's own quantizer.

    oracles/.venv/bin/python oracles/make_quantized.py [NAME ...]   (its rows of goldens/models/manifest.json)
    (or through make_models.py: `make_models.py tiny-gemma4-q4`)

- tiny-llama-trained-q4  affine 4-bit, group 64, with a mixed per-module scheme: lm_head at
                         8 bits, layer 0's down_proj left unquantized (explicit `false`)
- tiny-qwen3-q8          affine 8-bit, group 32 everywhere (tied, so the embedding doubles
                         as the quantized head)
- tiny-gemma3-q4         affine 4-bit, group 32 (tied quantized head, rotating caches)
- tiny-gemma4-q4         affine 4-bit, group 32 (quantized per-layer embedding; the 16-wide
                         per-layer projection stays unquantized because 16 % 32 != 0)
- tiny-gemma3-mm-q4      tiny-gemma3-mm (the gemma3 wrapper, oracles/make_wrappers.py) as
                         mlx_lm.convert -q writes it: affine 4-bit g32, layer 0's down_proj
                         kept dense by a per-module `false` entry named as mlx-lm names the
                         module (`language_model.model.layers.0.mlp.down_proj`); save_model /
                         save_config, so the towers are gone (mlx-lm's sanitize dropped them)
                         and text_config carries the wrapper's filled-in defaults

Quantized elsewhere: tiny-qwen3-moe-q4 (oracles/make_moe.py), tiny-gemma4-moe-q4
(oracles/make_gemma4_moe.py), tiny-gpt-oss-mxfp4 (oracles/make_gpt_oss.py), and MLX's
floating-point modes (oracles/make_quant_modes.py).

Each is mlx_lm.utils.quantize_model on the committed f32/bf16 model, written with
mlx-lm's save_model/save_config next to copies of the tokenizer files.
"""

import sys
from pathlib import Path

import tinymodels
from tinymodels import Job, quantize

GENERATOR = "oracles/make_quantized.py"


def mixed_q4(path, module):
    if path == "lm_head":
        return {"group_size": 64, "bits": 8, "mode": "affine"}
    if path == "model.layers.0.mlp.down_proj":
        return False
    return True


def make_llama_trained_q4(job: Job) -> Path:
    return quantize(job, "tiny-llama-trained",
                    "affine 4-bit g64 via mlx_lm.utils.quantize_model; lm_head 8-bit; layer 0 down_proj unquantized",
                    GENERATOR, 64, 4, predicate=mixed_q4, dense="model.layers.0.mlp.down_proj")


def make_qwen3_q8(job: Job) -> Path:
    return quantize(job, "tiny-qwen3", "affine 8-bit g32 via mlx_lm.utils.quantize_model", GENERATOR, 32, 8)


def make_gemma3_q4(job: Job) -> Path:
    return quantize(job, "tiny-gemma3", "affine 4-bit g32 via mlx_lm.utils.quantize_model", GENERATOR, 32, 4)


def make_gemma4_q4(job: Job) -> Path:
    return quantize(job, "tiny-gemma4", "affine 4-bit g32 via mlx_lm.utils.quantize_model", GENERATOR, 32, 4)


def make_gemma3_mm_q4(job: Job) -> Path:
    dense = "language_model.model.layers.0.mlp.down_proj"
    return quantize(job, "tiny-gemma3-mm",
                    f"tiny-gemma3-mm, affine 4-bit g32 via mlx_lm.utils.quantize_model; {dense} unquantized "
                    "(explicit false)", GENERATOR, 32, 4, predicate=lambda path, _: path != dense, dense=dense)


if __name__ == "__main__":
    tinymodels.main({"make_quantized": sys.modules[__name__]})
