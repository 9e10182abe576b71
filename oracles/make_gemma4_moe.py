"""Tiny Gemma 4 mixture-of-experts checkpoints (`enable_moe_block`, the 26B-A4B's layers), made
with mlx-lm 0.32.2's own gemma4_text / gemma4 classes.

    HARNESS_WRITE_REFERENCE=1 oracles/.venv/bin/python oracles/make_models.py tiny-gemma4-moe
    (or oracles/make_gemma4_moe.py [NAME ...]: its rows of goldens/models/manifest.json)

- tiny-gemma4-moe     gemma4_text like the 26B: every layer runs the dense GeGLU MLP and, beside
                      it, the router + 8 experts (top-3, SwitchGLU with the GeGLU activation),
                      each branch with its own norms; K = V on full-attention layers (own KV
                      head count), no per-layer inputs, no KV sharing, layers s f s f, sliding
                      window 8 (the rotating caches wrap), tied head, f32 (MLX's CPU gather_mm
                      runs float32 only). Stored in Hugging Face's layout: each layer's experts
                      as one fused `experts.gate_up_proj` [E, 2·I, D] and `experts.down_proj`
                      [E, D, I], which mlx-lm's sanitize splits into switch_glu.{gate,up,down}_proj
                      (checked here: the loaded model equals the one saved). The routers' projections
                      are scaled x8 so that expert choices are decisive; router.scale,
                      router.per_expert_scale, the norms and layer scalars are drawn away from one.
- tiny-gemma4-moe-q4  the same language model as the `gemma4` multimodal wrapper (how the 26B
                      ships) cast to bf16 and quantized by mlx_lm.utils.quantize_model, affine
                      4-bit g32: experts QuantizedSwitchLinear (gather_qmm), the routers' proj
                      8-bit g64 by gemma4's quant_predicate; saved by save_model / save_config in
                      mlx-lm's layout (`language_model.model.…`). Its L1 golden needs
                      make_moe.patch_gather_qmm on MLX 0.32.2 (gen_l1.py applies it).

The tokenizer and chat template are tiny-gemma4's (tinymodels' shared tokenizer, "llama" style).
Everything is seeded. SwitchGLU sorts by expert from 64 routing entries (22 tokens at top-3):
the longer L1 prompts take that path.
"""

import copy
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import gemma4, gemma4_text
from mlx_lm.utils import quantize_model

import tinymodels
from make_wrappers import gemma4_wrapper_config, text_of
from tinymodels import (GEMMA4_KEQV, Job, gemma4_config, load_source, loads_back, random_model, randomize_scales,
                        weights_of, write_model, write_quantized)


def moe_config() -> dict:
    return gemma4_config(**dict(GEMMA4_KEQV, tie_word_embeddings=True, intermediate_size=64, enable_moe_block=True,
                                num_experts=8, top_k_experts=3, moe_intermediate_size=32))


# The MoE branch's norms, which tinymodels.randomize_scales (names ending `norm.weight`) misses.
MOE_NORMS = ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2")


def spread_router(model, seed: int) -> None:
    """Routers: proj x8 (nn.Linear's init makes near-uniform scores), scale and
    per_expert_scale = 1 + noise, and the MoE branch's norms = 1 + noise, so that a dropped
    or misplaced scale or norm shows in the logits."""
    updates = []
    for i, layer in enumerate(model.model.layers):
        r = layer.router
        key = lambda j: mx.random.key(seed * 1000 + 10 * i + j)
        for j, norm in enumerate(MOE_NORMS):
            w = getattr(layer, norm).weight
            updates.append((f"model.layers.{i}.{norm}.weight", 1.0 + 0.3 * mx.random.normal(w.shape, key=key(2 + j))))
        updates += [
            (f"model.layers.{i}.router.proj.weight", r.proj.weight * 8),
            (f"model.layers.{i}.router.scale", 1.0 + 0.3 * mx.random.normal(r.scale.shape, key=key(0))),
            (f"model.layers.{i}.router.per_expert_scale",
             1.0 + 0.3 * mx.random.normal(r.per_expert_scale.shape, key=key(1))),
        ]
    model.load_weights(updates, strict=False)
    mx.eval(model.parameters())


def hf_layout(weights: dict) -> dict:
    """The experts as Hugging Face stores them: gate and up fused along the output axis."""
    out = {}
    for k, v in weights.items():
        if k.endswith(".experts.switch_glu.gate_proj.weight"):
            base = k.removesuffix(".switch_glu.gate_proj.weight")
            up = weights[f"{base}.switch_glu.up_proj.weight"]
            out[f"{base}.gate_up_proj"] = mx.concatenate([v, up], axis=-2)
        elif k.endswith(".experts.switch_glu.up_proj.weight"):
            continue
        elif k.endswith(".experts.switch_glu.down_proj.weight"):
            out[k.removesuffix(".switch_glu.down_proj.weight") + ".down_proj"] = v
        else:
            out[k] = v
    return out


def make_gemma4_moe(job: Job) -> Path:
    cfg = moe_config()
    model = random_model(gemma4_text, cfg, job.seed, mx.float32)
    randomize_scales(model, 35)
    spread_router(model, 45)
    weights = weights_of(model)
    return write_model(job, hf_layout(weights), cfg,
                       f"random weights (seed {job.seed}, norm/scalar noise seed 35, router noise seed 45), f32, "
                       "routers' proj x8, tied, K = V on full layers, experts fused as Hugging Face stores them",
                       check=loads_back(weights))


def make_gemma4_moe_q4(job: Job) -> Path:
    text_model, _ = load_source(job, "tiny-gemma4-moe")
    cfg = gemma4_wrapper_config(text_of(moe_config(), ("vocab_size",)))
    cfg["architectures"] = ["Gemma4ForConditionalGeneration"]
    model = gemma4.Model(gemma4.ModelArgs.from_dict(copy.deepcopy(cfg)))
    model.load_weights([("language_model." + k, v) for k, v in weights_of(text_model).items()])
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    model, qconfig = quantize_model(model, cfg, 32, 4)
    assert qconfig["quantization"]["language_model.model.layers.0.router.proj"]["bits"] == 8
    return write_quantized(
        job, "tiny-gemma4-moe", model, qconfig,
        "tiny-gemma4-moe's language model in the gemma4 wrapper (gemma4.Model), cast to bf16, affine "
        "4-bit g32 via mlx_lm.utils.quantize_model (routers' proj 8-bit g64 by gemma4's quant_predicate); "
        "its L1 golden needs make_moe.patch_gather_qmm on MLX 0.32.2", "oracles/make_gemma4_moe.py")


if __name__ == "__main__":
    tinymodels.main({"make_gemma4_moe": sys.modules[__name__]})
