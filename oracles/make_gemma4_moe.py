"""Tiny Gemma 4 mixture-of-experts checkpoints (`enable_moe_block`, the 26B-A4B's layers), made
with mlx-lm 0.32.2's own gemma4_text / gemma4 classes.

    HARNESS_WRITE_REFERENCE=1 oracles/.venv/bin/python oracles/make_models.py tiny-gemma4-moe
    (make_models.py dispatches these names here)

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

The tokenizer and chat template are tiny-gemma4's (make_models.train_tokenizer, "llama" style).
Everything is seeded. SwitchGLU sorts by expert from 64 routing entries (22 tokens at top-3):
the longer L1 prompts take that path.
"""

import copy
import shutil

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models import gemma4, gemma4_text
from mlx_lm.utils import quantize_model, save_config, save_model

from provenance import golden_dir, provenance, resolve, write_json


def moe_config() -> dict:
    import make_models as mm
    return mm.gemma4_config(
        num_hidden_layers=4, sliding_window_pattern=2, intermediate_size=64, num_key_value_heads=2,
        num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=0,
        hidden_size_per_layer_input=0, use_double_wide_mlp=False, final_logit_softcapping=30.0,
        enable_moe_block=True, num_experts=8, top_k_experts=3, moe_intermediate_size=32)


# The MoE branch's norms, which make_models.randomize_scales (names ending `norm.weight`) misses.
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


def make_gemma4_moe(tok) -> None:
    import make_models as mm
    dest = golden_dir("models/tiny-gemma4-moe")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    cfg = moe_config()
    model = mm.random_model(gemma4_text, cfg, 25, mx.float32)
    mm.randomize_scales(model, 35)
    spread_router(model, 45)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(dest / "model.safetensors"), hf_layout(weights), metadata={"format": "mlx"})
    write_json(dest / "config.json", cfg)
    mm.finish_dir(dest, cfg, mm.write_tokenizer(tok, dest, "llama"),
                  "random weights (seed 25, norm/scalar noise seed 35, router noise seed 45), f32, routers' "
                  "proj x8, tied, K = V on full layers, experts fused as Hugging Face stores them")
    loaded, _ = load(str(dest))
    for k, v in tree_flatten(loaded.parameters()):
        assert mx.array_equal(v, weights[k]).item(), k
    size = sum(f.stat().st_size for f in dest.iterdir())
    print(f"{dest}: {size / 1e6:.2f} MB")


TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]


def make_gemma4_moe_q4(_tok=None) -> None:
    from make_wrappers import gemma4_wrapper_config, text_of
    src = resolve("models/tiny-gemma4-moe")
    text_model, _ = load(str(src))
    cfg = gemma4_wrapper_config(text_of(moe_config(), ("vocab_size",)))
    cfg["architectures"] = ["Gemma4ForConditionalGeneration"]
    model = gemma4.Model(gemma4.ModelArgs.from_dict(copy.deepcopy(cfg)))
    model.load_weights([("language_model." + k, v) for k, v in tree_flatten(text_model.parameters())])
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    model, qconfig = quantize_model(model, cfg, 32, 4)
    assert qconfig["quantization"]["language_model.model.layers.0.router.proj"]["bits"] == 8
    dest = golden_dir("models/tiny-gemma4-moe-q4")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    save_model(dest, model)
    save_config(qconfig, dest / "config.json")
    for f in TOKENIZER_FILES:
        shutil.copy(src / f, dest / f)
    write_json(dest / "provenance.json", {
        "provenance": provenance("mlx-lm", "mlx-lm"), "generator": "oracles/make_gemma4_moe.py",
        "notes": "tiny-gemma4-moe's language model in the gemma4 wrapper (gemma4.Model), cast to bf16, affine "
                 "4-bit g32 via mlx_lm.utils.quantize_model (routers' proj 8-bit g64 by gemma4's quant_predicate); "
                 "its L1 golden needs make_moe.patch_gather_qmm on MLX 0.32.2"})
    size = sum(f.stat().st_size for f in dest.iterdir())
    print(f"{dest}: {size / 1e6:.2f} MB")


ONLY = {"tiny-gemma4-moe": make_gemma4_moe, "tiny-gemma4-moe-q4": make_gemma4_moe_q4}
