"""Tiny hybrid models (attention beside recurrent layers), made with mlx-lm's own classes.

    oracles/.venv/bin/python oracles/make_hybrids.py [NAME ...]   (its rows of goldens/models/manifest.json)
    (or through make_models.py: `make_models.py tiny-lfm2`)

- tiny-lfm2          lfm2: 4 layers, short convolutions (kernel 3, an ArraysCache state of the last
                     2 inputs) on layers 0, 1 and 3, full attention with q/k layernorms (GQA 4/2) on
                     layer 2; the SwiGLU width auto-adjusted (128 -> 96); conv weights saved in
                     Hugging Face's [hidden, 1, kernel] layout (mlx-lm's sanitize transposes them);
                     tied head, norms drawn away from one, bf16

The tokenizer and chat template are tinymodels' shared ones ("llama" style). Everything is seeded.
"""

import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import lfm2

import tinymodels
from tinymodels import VOCAB, Job, random_model, randomize_scales, weights_of, write_model


def lfm2_config() -> dict:
    return {
        "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2",
        "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3,
        "block_dim": 64, "block_ff_dim": 128, "block_multiple_of": 32,
        "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True,
        "rope_theta": 1000000.0,
        "layer_types": ["conv", "conv", "full_attention", "conv"],
        "tie_word_embeddings": True,
    }


def make_lfm2(job: Job) -> Path:
    cfg = lfm2_config()
    model = random_model(lfm2, cfg, job.seed, mx.bfloat16)
    randomize_scales(model, job.seed)
    weights = weights_of(model)
    # Hugging Face's layout of a depthwise conv: [channels, 1, kernel].
    for name in list(weights):
        if name.endswith("conv.conv.weight"):
            weights[name] = weights[name].transpose(0, 2, 1)
    return write_model(job, weights, cfg,
                       f"random weights (seed {job.seed}), bf16, conv weights in HF layout, tied")


if __name__ == "__main__":
    tinymodels.main({"make_hybrids": sys.modules[__name__]})
