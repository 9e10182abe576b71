"""Tiny multi-head latent attention (MLA) models, made with mlx-lm's own classes.

    HARNESS_WRITE_REFERENCE=1 oracles/.venv/bin/python oracles/make_models.py --only NAME
    (or oracles/make_mla.py [NAME ...]: its rows of goldens/models/manifest.json)

Each is saved as the Hugging Face checkpoints ship it, so that mlx-lm's sanitize (and ours) does
its work: `kv_b_proj` [heads·(nope + v), kv_lora_rank] in place of the absorbed `embed_q` /
`unembed_out`, per-expert `experts.{e}.{gate,up,down}_proj` in place of the stacked switch_mlp.

- tiny-deepseek-v3    deepseek_v3: 3 layers, layer 0 a dense SwiGLU (first_k_dense_replace 1), layers
                      1-2 the sparse block (8 experts in n_group 2 groups, topk_group 1, top 2 by
                      sigmoid + e_score_correction_bias, renormalized, routed_scaling_factor 2.5, one
                      shared expert); MLA with q_lora_rank 48, kv_lora_rank 32, 4 heads of nope 16 +
                      rope 8, v 16; yarn RoPE (factor 4, mscale_all_dim 1: the softmax scale grows);
                      a `rotary_emb.inv_freq` tensor sanitize drops; routers and bias drawn, f32
- tiny-glm4-moe-lite  glm4_moe_lite (GLM-4.7-Flash): deepseek_v3's model with GLM's defaults and its
                      differences (the latent norms at rms_norm_eps 1e-5, + 1e-20 in the
                      renormalization, every layer at or past num_hidden_layers dropped): 3 layers,
                      layer 0 dense, 8 experts top 4 in one group, routed_scaling_factor 1.8, plain
                      RoPE (theta 1e6), plus an MTP layer (`model.layers.3.…`) sanitize drops, f32
- tiny-kimi-k25       kimi_k25 (Kimi K2.5) for text: the wrapper's `text_config` is a deepseek_v3 config
                      (here without q_lora_rank: the plain `q_proj` query), its tensors under
                      `language_model.` beside vision / projector tensors sanitize drops; 8 experts in
                      4 groups (topk_group 2), top 3, yarn, f32
- tiny-minicpm3       minicpm3 (MiniCPM 3): 3 dense layers of MLA projections without absorption
                      (kv_b_proj expands the latent; a standard cache of per-head keys and values),
                      4 heads of nope 16 + rope 8, v 16, longrope factors (type `su`; a 4x context: the
                      input scale applies), scale_emb 12, scale_depth 1.4, dim_model_base 256, untied, bf16
- tiny-deepseek-v3-q4  tiny-deepseek-v3 cast to bf16 and through mlx_lm.utils.quantize_model, affine 4-bit
                      g32 (mlx-community's layout: embed_q / unembed_out already split, the experts
                      stacked; unembed_out (in 32) a QuantizedMultiLinear, embed_q (in 16, not a
                      multiple of 32) left dense; the routers, plain modules, unquantized)

tiny-deepseek-v3 and tiny-deepseek-v32 also have goldens of mlx-lm prefilling one token at a time
(MLA's absorbed path, whose rounding differs from the prefill's), checked by
tests/it/l1_models/mla.rs:
    oracles/.venv/bin/python oracles/gen_l1.py tiny-deepseek-v3 --prefill-step 1 --suffix=-prefill1
"""

import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import deepseek_v3, deepseek_v32, glm4_moe_lite, kimi_k25, minicpm3

import tinymodels
from tinymodels import VOCAB, Job, quantize, random_model, randomize_scales, weights_of, write_model

# Imported for its helper only (no maker of make_hybrids runs from here).
from make_hybrids import per_expert_layout


def deepseek_v3_config() -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_shared_experts": 1, "n_routed_experts": 8, "routed_scaling_factor": 2.5,
        "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "qk_nope_head_dim": 16, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
        "moe_layer_freq": 1, "first_k_dense_replace": 1, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "tie_word_embeddings": False,
    }


def glm4_moe_lite_config() -> dict:
    cfg = deepseek_v3_config()
    for k in ("rope_scaling", "topk_method", "scoring_func"):
        del cfg[k]
    return dict(cfg, architectures=["Glm4MoeLiteForCausalLM"], model_type="glm4_moe_lite", n_group=1,
                topk_group=1, num_experts_per_tok=4, routed_scaling_factor=1.8, rms_norm_eps=1e-5,
                rope_theta=1000000.0, partial_rotary_factor=1.0, num_nextn_predict_layers=1)


def kimi_k25_text_config() -> dict:
    return dict(deepseek_v3_config(), q_lora_rank=None, n_group=4, topk_group=2, num_experts_per_tok=3,
                routed_scaling_factor=2.827)


def draw_routers(model, seed: int, dtype) -> None:
    """MoEGate starts at zeros: draw its weight (in `dtype`) and its e_score_correction_bias
    (float32, as DeepSeek keeps it), so that routing and the grouped choice are decisive."""
    for i, layer in enumerate(model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None:
            continue
        k1, k2 = mx.random.split(mx.random.key(seed * 100 + 50 + i))
        gate.weight = (mx.random.normal(gate.weight.shape, key=k1) * 0.5).astype(dtype)
        gate.e_score_correction_bias = mx.random.normal(gate.e_score_correction_bias.shape, key=k2) * 0.1
    mx.eval(model.parameters())


def hf_kv_b_proj(weights: dict) -> dict:
    """`embed_q` [H, kv_lora, nope] and `unembed_out` [H, v, kv_lora] folded back into Hugging
    Face's `kv_b_proj` [H·(nope + v), kv_lora] (the inverse of mlx-lm's sanitize split)."""
    out = {}
    for name, v in weights.items():
        if name.endswith(".embed_q.weight"):
            prefix = name[: -len(".embed_q.weight")]
            wk = v.swapaxes(-1, -2)
            wv = weights[f"{prefix}.unembed_out.weight"]
            heads, _, rank = wk.shape
            out[f"{prefix}.kv_b_proj.weight"] = mx.concatenate([wk, wv], axis=1).reshape(-1, rank)
        elif not name.endswith(".unembed_out.weight"):
            out[name] = v
    return out


def hf_mla_weights(model) -> dict:
    return per_expert_layout(hf_kv_b_proj(weights_of(model)))


def random_mla(module, cfg: dict, seed: int, dtype):
    model = random_model(module, cfg, seed, dtype)
    randomize_scales(model, seed)
    draw_routers(model.model, seed, dtype)
    return model


def make_deepseek_v3(job: Job) -> Path:
    cfg = deepseek_v3_config()
    model = random_mla(deepseek_v3, cfg, job.seed, mx.float32)
    weights = hf_mla_weights(model)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = mx.arange(4, dtype=mx.float32)
    return write_model(job, weights, cfg,
                       f"random weights (seed {job.seed}; norms, routers and e_score_correction_bias drawn), "
                       "f32, Hugging Face layout (kv_b_proj, per-expert tensors, a rotary_emb.inv_freq "
                       "sanitize drops); layer 0 dense, layers 1-2 8 experts in 2 groups (topk_group 1), "
                       "top 2, a shared expert; yarn RoPE with mscale_all_dim")


def make_glm4_moe_lite(job: Job) -> Path:
    cfg = glm4_moe_lite_config()
    model = random_mla(glm4_moe_lite, cfg, job.seed, mx.float32)
    weights = hf_mla_weights(model)
    # The multi-token-prediction layer (index num_hidden_layers) that GLM checkpoints carry.
    weights["model.layers.3.eh_proj.weight"] = mx.zeros((64, 128), dtype=mx.float32)
    weights["model.layers.3.enorm.weight"] = mx.ones((64,), dtype=mx.float32)
    return write_model(job, weights, cfg,
                       f"random weights (seed {job.seed}; norms, routers and e_score_correction_bias drawn), "
                       "f32, Hugging Face layout (kv_b_proj, per-expert tensors, an MTP layer sanitize drops); "
                       "layer 0 dense, layers 1-2 8 experts top 4 (one group), a shared expert")


def make_kimi_k25(job: Job) -> Path:
    text = kimi_k25_text_config()
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
           "text_config": text, "vision_config": {"hidden_size": 8}}
    mx.random.seed(job.seed)
    model = kimi_k25.Model(kimi_k25.ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    randomize_scales(model, job.seed)
    draw_routers(model.language_model.model, job.seed, mx.float32)
    weights = hf_mla_weights(model)
    weights["vision_tower.patch_embed.proj.weight"] = mx.zeros((8, 3, 2, 2), dtype=mx.float32)
    weights["mm_projector.proj.0.weight"] = mx.zeros((64, 8), dtype=mx.float32)
    return write_model(job, weights, cfg,
                       f"random weights (seed {job.seed}; norms, routers and e_score_correction_bias drawn), "
                       "f32, the text model under language_model. in Hugging Face layout (kv_b_proj, "
                       "per-expert tensors), vision / projector tensors sanitize drops; plain q_proj, "
                       "8 experts in 4 groups (topk_group 2), top 3, yarn")


def minicpm3_config() -> dict:
    return {
        "architectures": ["MiniCPM3ForCausalLM"], "model_type": "minicpm3",
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "rms_norm_eps": 1e-5,
        "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "kv_lora_rank": 32,
        "scale_depth": 1.4, "scale_emb": 12, "dim_model_base": 256, "max_position_embeddings": 4096,
        "rope_theta": 10000.0, "attention_bias": False, "tie_word_embeddings": False,
        # minicpm3 reads rope_scaling's factors whatever its type; "su" (longrope's older name), since
        # transformers' generic config (which mlx-lm's tokenizer load builds for a model type it does
        # not know) fails on a "longrope" dict.
        "rope_scaling": {"type": "su", "long_factor": [1.0, 1.5, 2.25, 3.5],
                         "short_factor": [1.0, 1.1, 1.2, 1.3], "original_max_position_embeddings": 1024},
    }


def make_minicpm3(job: Job) -> Path:
    cfg = minicpm3_config()
    model = random_model(minicpm3, cfg, job.seed, mx.bfloat16)
    randomize_scales(model, job.seed)
    return write_model(job, weights_of(model), cfg,
                       f"random weights (seed {job.seed}; norms drawn), bf16, untied; longrope with a 4x "
                       "context (the input scale applies)")


def deepseek_v32_config() -> dict:
    cfg = dict(deepseek_v3_config(), architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
               index_head_dim=16, index_n_heads=2, index_topk=3)
    del cfg["rope_scaling"]
    return cfg


def draw_indexer_norms(model, seed: int) -> None:
    """The indexers' k_norm (a LayerNorm, weight 1 and bias 0 at init) drawn away from its init."""
    for i, layer in enumerate(model.model.layers):
        norm = layer.self_attn.indexer.k_norm
        k1, k2 = mx.random.split(mx.random.key(seed * 100 + 80 + i))
        norm.weight = 1.0 + mx.random.normal(norm.weight.shape, key=k1) * 0.3
        norm.bias = mx.random.normal(norm.bias.shape, key=k2) * 0.1
    mx.eval(model.parameters())


def make_deepseek_v32(job: Job) -> Path:
    cfg = deepseek_v32_config()
    model = random_mla(deepseek_v32, cfg, job.seed, mx.float32)
    draw_indexer_norms(model, job.seed)
    weights = hf_mla_weights(model)
    weights["model.layers.3.eh_proj.weight"] = mx.zeros((64, 128), dtype=mx.float32)
    return write_model(job, weights, cfg,
                       f"random weights (seed {job.seed}; norms, indexer k_norms, routers and "
                       "e_score_correction_bias drawn), f32, Hugging Face layout (kv_b_proj, per-expert "
                       "tensors, an MTP layer sanitize drops); the indexer keeps 3 positions per query")


def make_deepseek_v3_q4(job: Job) -> Path:
    return quantize(job, "tiny-deepseek-v3",
                    "cast to bf16, affine 4-bit g32 via mlx_lm.utils.quantize_model (unembed_out a "
                    "QuantizedMultiLinear; embed_q, 16 inputs wide, left dense); its L1 golden needs "
                    "make_moe.patch_gather_qmm on MLX 0.32.2",
                    "oracles/make_mla.py", 32, 4, dtype=mx.bfloat16)


if __name__ == "__main__":
    tinymodels.main({"make_mla": sys.modules[__name__]})
