"""Tiny dense models of Mistral 3 / Ministral 3 and Qwen3-VL (text), made with mlx-lm's own classes.

    HARNESS_WRITE_REFERENCE=1 oracles/.venv/bin/python oracles/make_models.py --only tiny-ministral3
    (or oracles/make_dense2.py [NAME ...]: its rows of goldens/models/manifest.json)

- tiny-ministral3     ministral3: Llama's layers with Llama 4's query scale
                      1 + beta * log(1 + floor(pos / original_max_position_embeddings)) (beta 0.5,
                      original max 3, so the scale steps every 3 positions, within the shortest prompt too),
                      yarn RoPE from rope_parameters, layers sliding (window 8), full, sliding,
                      full; GQA 4/2, tied, norms drawn away from one, bf16
- tiny-mistral3       the mistral3 wrapper (Mistral Small 3.1 / Ministral 3's multimodal
                      checkpoint) in Hugging Face's layout: `model.language_model.…`,
                      `model.vision_tower.…`, `model.multi_modal_projector.…`, `lm_head.weight`;
                      text_config a ministral3 (every layer full attention) without
                      tie_word_embeddings (the wrapper's default: untied), bf16
- tiny-qwen3-vl       qwen3_vl in Hugging Face's layout: `model.language_model.…`, `model.visual.…`,
                      `lm_head.weight`; text_config a qwen3 with Qwen3-VL's rope_scaling
                      (mrope_section, mrope_interleaved; mlx-lm rotates text as plain RoPE),
                      untied, f32
- tiny-gemma3n        gemma3n's text model (Hugging Face's `model.language_model.` names, a vision and
                      an audio tensor dropped): 4 layers sliding (window 8), full, sliding, full, the
                      last 2 sharing the K/V of layers 0 and 1; AltUp over 4 streams (coefficients
                      clipped at 0.3 (drawn within ±0.5, so the clip fires)), Laurel rank 8, per-layer inputs of 16 from
                      a per-layer vocabulary of 512 (ids above it read row 0), activation sparsity
                      0.95 on layer 0, per-layer MLP widths, softcap 30, f32; AltUp's
                      correct_output_scale drawn (it initialises to zeros)
"""

import copy
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import gemma3n, ministral3, mistral3, qwen3_vl

import tinymodels
from tinymodels import VOCAB, Job, random_model, randomize_scales, weights_of, write_model


def ministral3_text(layer_types: list[str], tie: bool | None) -> dict:
    cfg = {
        "model_type": "ministral3", "hidden_size": 64, "num_hidden_layers": len(layer_types),
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 3, "llama_4_scaling_beta": 0.5,
                            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "layer_types": layer_types, "sliding_window": 8,
    }
    if tie is not None:
        cfg["tie_word_embeddings"] = tie
    return cfg


def tower(prefix: str, names: dict, seed: int) -> dict:
    """Small random tensors named `prefix + name` (the towers mlx-lm drops)."""
    return {prefix + n: (mx.random.normal(s, key=mx.random.key(seed * 100 + i)) * 0.02).astype(mx.bfloat16)
            for i, (n, s) in enumerate(names.items())}


def make_ministral3(job: Job) -> Path:
    cfg = ministral3_text(["sliding_attention", "full_attention", "sliding_attention", "full_attention"], True)
    cfg["architectures"] = ["Ministral3ForCausalLM"]
    model = random_model(ministral3, copy.deepcopy(cfg), job.seed, mx.bfloat16)
    randomize_scales(model, job.seed)
    return write_model(job, weights_of(model, drop=("lm_head.weight",)), cfg,
                       f"ministral3.Model, random weights (seed {job.seed}), bf16, tied, window 8 on layers 0 and 2")


def make_mistral3(job: Job) -> Path:
    text = ministral3_text(["full_attention"] * 2, None)
    del text["layer_types"], text["sliding_window"]
    cfg = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
           "text_config": text, "vision_config": {"model_type": "pixtral", "hidden_size": 8},
           "image_token_index": 10, "spatial_merge_size": 2}
    model = random_model(mistral3, copy.deepcopy(cfg), job.seed, mx.bfloat16)
    randomize_scales(model, job.seed)
    weights = {}
    for k, v in weights_of(model).items():
        if k.startswith("language_model.model."):
            weights["model.language_model." + k.removeprefix("language_model.model.")] = v
        else:
            assert k == "language_model.lm_head.weight", k
            weights["lm_head.weight"] = v
    weights.update(tower("model.vision_tower.", {"patch_conv.weight": (8, 2, 2, 3),
                                                 "transformer.layers.0.attention.q_proj.weight": (8, 8)}, 73))
    weights.update(tower("model.multi_modal_projector.", {"linear_1.weight": (64, 8), "norm.weight": (8,)}, 74))
    return write_model(job, weights, cfg, f"mistral3.Model, random weights (seed {job.seed}), bf16, untied, "
                       "Hugging Face names; random vision tower and projector (seeds 73, 74)")


def make_qwen3_vl(job: Job) -> Path:
    text = {"model_type": "qwen3_vl_text", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 160,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "vocab_size": VOCAB, "max_position_embeddings": 4096, "rope_theta": 5000000.0,
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
            "tie_word_embeddings": False}
    cfg = {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
           "text_config": text, "vision_config": {"model_type": "qwen3_vl", "hidden_size": 8},
           "image_token_id": 10, "tie_word_embeddings": False}
    model = random_model(qwen3_vl, copy.deepcopy(cfg), job.seed, mx.float32)
    randomize_scales(model, job.seed)
    weights = {}
    for k, v in weights_of(model).items():
        if k.startswith("language_model.model."):
            weights["model.language_model." + k.removeprefix("language_model.model.")] = v
        else:
            assert k == "language_model.lm_head.weight", k
            weights["lm_head.weight"] = v
    weights.update({k: v.astype(mx.float32) for k, v in tower(
        "model.visual.", {"patch_embed.proj.weight": (8, 3, 2, 2, 2), "blocks.0.attn.qkv.weight": (24, 8)}, 75).items()})
    return write_model(job, weights, cfg, f"qwen3_vl.Model, random weights (seed {job.seed}), f32, untied, "
                       "Hugging Face names; random vision tower (seed 75)", style="qwen")


def make_gemma3n(job: Job) -> Path:
    text = {"model_type": "gemma3n_text", "hidden_size": 64, "num_hidden_layers": 4,
            "intermediate_size": [128, 128, 96, 96], "num_attention_heads": 4, "head_dim": 16,
            "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "num_key_value_heads": 2, "num_kv_shared_layers": 2,
            "vocab_size_per_layer_input": 512, "sliding_window": 8, "max_position_embeddings": 4096,
            "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0, "final_logit_softcapping": 30.0,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0], "hidden_size_per_layer_input": 16,
            "altup_num_inputs": 4, "altup_coef_clip": 0.3, "altup_correct_scale": True, "altup_active_idx": 0,
            "laurel_rank": 8}
    cfg = {"architectures": ["Gemma3nForConditionalGeneration"], "model_type": "gemma3n", "text_config": text,
           "vision_config": {"model_type": "gemma3n_vision"}, "audio_config": {"model_type": "gemma3n_audio"}}
    model = random_model(gemma3n, copy.deepcopy(cfg), job.seed, mx.float32)
    randomize_scales(model, job.seed)
    updates = []
    for i, layer in enumerate(model.model.language_model.layers):
        scale = layer.altup.correct_output_scale
        updates.append((f"model.language_model.layers.{i}.altup.correct_output_scale",
                        1.0 + 0.3 * mx.random.normal(scale.shape, key=mx.random.key(job.seed * 10 + i))))
    model.load_weights(updates, strict=False)
    weights = weights_of(model)
    weights.update({k: v.astype(mx.float32) for k, v in tower("model.vision_tower.", {"timm_model.stem.weight": (8, 3)}, 76).items()})
    weights.update({k: v.astype(mx.float32) for k, v in tower("model.audio_tower.", {"conformer.0.weight": (8, 8)}, 77).items()})
    return write_model(job, weights, cfg, f"gemma3n.Model, random weights (seed {job.seed}), f32, tied; "
                       "correct_output_scale drawn; random vision and audio tensors (seeds 76, 77)")


if __name__ == "__main__":
    tinymodels.main({"make_dense2": sys.modules[__name__]})
