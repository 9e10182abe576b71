"""Tiny gpt-oss models, made with mlx-lm's own gpt_oss class.

    HARNESS_WRITE_REFERENCE=1 oracles/.venv/bin/python oracles/make_gpt_oss.py [NAME ...]   (its manifest rows)
    (or through make_models.py: `make_models.py tiny-gpt-oss`)

- tiny-gpt-oss        gpt_oss: 4 layers (sliding, full, sliding, full from layer_types), sliding
                      window 8 (the rotating caches wrap in every L1 prompt longer than 8
                      tokens), 8 experts top-4 (mlx-lm's top-k then softmax), yarn RoPE as the
                      real checkpoints configure it (factor 32, theta 150000), untied head, f32
                      (MLX's CPU gather_mm runs float32 only). mlx-lm initialises the attention
                      sinks and the experts' biases to zero: both are drawn here so that a
                      dropped sink or bias shows; the routers are scaled up (decisive expert
                      choices) and the experts' gate/up weights too, so that the clamped SwiGLU
                      (limit 7) clips; norms drawn away from one
- tiny-gpt-oss-mxfp4  tiny-gpt-oss cast to bf16 and quantized as mlx-community's gpt-oss
                      MXFP4-Q8 checkpoints are: the experts mxfp4 (group 32, as OpenAI ships
                      them), every other linear and the embedding affine 8-bit g64 by
                      mlx_lm.utils.quantize_model (per-module entries) — written by mlx-lm's
                      own save_model/save_config

The tokenizer and chat template are tiny-qwen3's (tinymodels' shared tokenizer, "qwen" style).
Everything is seeded. mlx-lm's SwitchGLU sorts the tokens by expert once the routing
indices have >= 64 entries (16 tokens at top-4): the longer L1 prompts take that path.
"""

import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gpt_oss
from mlx_lm.utils import quantize_model

import tinymodels
from tinymodels import VOCAB, Job, load_source, random_model, randomize_scales, weights_of, write_model, write_quantized


def gpt_oss_config(vocab: int) -> dict:
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 32,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_local_experts": 8, "num_experts_per_tok": 4, "experts_per_token": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "sliding_window": 8, "rms_norm_eps": 1e-5, "vocab_size": vocab,
        "max_position_embeddings": 131072, "rope_theta": 150000,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "truncate": False},
        "swiglu_limit": 7.0, "attention_bias": True, "tie_word_embeddings": False,
    }


def draw(shape, seed: int, scale: float):
    return mx.random.normal(shape, key=mx.random.key(seed)) * scale


def make_gpt_oss(job: Job) -> Path:
    cfg = gpt_oss_config(VOCAB)
    model = random_model(gpt_oss, cfg, job.seed, mx.float32)
    randomize_scales(model, 34)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        attn.sinks = draw(attn.sinks.shape, 3400 + i, 1.0)
        mlp.router.weight = mlp.router.weight * 8
        experts = mlp.experts
        experts.gate_proj.weight = experts.gate_proj.weight * 6
        experts.up_proj.weight = experts.up_proj.weight * 6
        for j, proj in enumerate([experts.gate_proj, experts.up_proj, experts.down_proj]):
            proj.bias = draw(proj.bias.shape, 3500 + 10 * i + j, 0.3)
    mx.eval(model.parameters())
    return write_model(job, weights_of(model), cfg,
                       f"random weights (seed {job.seed}, norm noise seed 34), f32, sinks and expert biases drawn "
                       "(seeds 3400+/3500+), routers x8, expert gate/up x6, untied", style="qwen")


def make_gpt_oss_mxfp4(job: Job) -> Path:
    """As mlx_lm.convert makes mlx-community's gpt-oss-*-MXFP4-Q8 from OpenAI's checkpoint:
    loading it leaves the experts mxfp4 (`quantization_config` mxfp4 → `quantization`
    {32, 4, mxfp4}); `-q --q-bits 8` then quantizes every other linear and the embedding
    affine 8-bit g64, each recorded per module (the checkpoint was partly quantized
    already), the routers by gpt_oss's quant_predicate."""
    model, config = load_source(job, "tiny-gpt-oss")
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, 32, 4, mode="mxfp4", class_predicate=lambda p, m: p.endswith(
        (".experts.gate_proj", ".experts.up_proj", ".experts.down_proj")))
    config["quantization"] = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    model, qconfig = quantize_model(model, config, 64, 8)
    return write_quantized(
        job, "tiny-gpt-oss", model, qconfig,
        "tiny-gpt-oss cast to bf16, experts mxfp4 g32 (as loading OpenAI's mxfp4 checkpoint leaves "
        "them), then mlx_lm.utils.quantize_model 8-bit g64 affine for the rest (mlx-community's "
        "MXFP4-Q8 layout)", "oracles/make_gpt_oss.py")


if __name__ == "__main__":
    tinymodels.main({"make_gpt_oss": sys.modules[__name__]})
