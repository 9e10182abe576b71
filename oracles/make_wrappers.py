"""Tiny multimodal-wrapper checkpoints (`gemma3`, `gemma4`) for the L1 gate of the wrappers.

    HARNESS_WRITE_REFERENCE=1 oracles/.venv/bin/python oracles/make_models.py tiny-gemma3-mm
    (or oracles/make_wrappers.py [NAME ...]: its rows of goldens/models/manifest.json)

Each model is built with mlx-lm's own wrapper class (mlx_lm.models.gemma3.Model /
gemma4.Model) from a config whose language model lives in `text_config`, and saved as the
real checkpoints are laid out, with small random tensors for the vision / audio towers that
mlx-lm's sanitize drops:

- tiny-gemma3-mm      gemma3 as google/gemma-3-*-it and mlx-community's conversions name it:
                      `language_model.model.…`, `vision_tower.vision_model.…`,
                      `multi_modal_projector.…`; tied head (no lm_head). text_config is
                      tiny-gemma3's without the head counts and vocab size (the wrapper's
                      defaults, 8 q / 4 kv heads, and its top-level vocab_size apply, as in
                      the real Gemma 3 configs) and with linear RoPE scaling (factor 8, as
                      Gemma 3 4B+), bf16
- tiny-gemma4-mm      gemma4 in Hugging Face's layout (transformers 5): `model.language_model.…`,
                      `model.vision_tower.…`, `model.embed_vision.…`, `model.audio_tower.…`,
                      `model.embed_audio.…`, plus the K/V projections of the KV-shared layers
                      (which mlx-lm drops); text_config is tiny-gemma4's (per-layer inputs, KV
                      sharing) without its head count (the wrapper's default 8 applies), bf16
- tiny-gemma4-mm-mlx  gemma4 in mlx-community's layout: `language_model.model.…`,
                      `language_model.lm_head.weight` (untied), `vision_tower.…`,
                      `embed_vision.…`, `audio_tower.…`, `embed_audio.…`; text_config is
                      tiny-gemma4-keqv's (K = V on full layers, like the 12B), bf16

Their quantized form, tiny-gemma3-mm-q4, is oracles/make_quantized.py's.
"""

import copy
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import gemma3, gemma4

import tinymodels
from tinymodels import (GEMMA4_KEQV, VOCAB, Job, gemma3_config, gemma4_config, random_model, randomize_scales,
                        weights_of, write_model)


def tower(prefix: str, names: dict, seed: int) -> dict:
    """Small random tensors named `prefix + name` (the towers mlx-lm drops)."""
    out = {}
    for i, (name, shape) in enumerate(names.items()):
        out[prefix + name] = (mx.random.normal(shape, key=mx.random.key(seed * 100 + i)) * 0.02).astype(mx.bfloat16)
    return out


# SigLIP's names, as google/gemma-3-*-it stores them (conv weights channels-last, as
# mlx-community's conversions store them).
SIGLIP = {
    "embeddings.patch_embedding.weight": (8, 2, 2, 3),
    "embeddings.patch_embedding.bias": (8,),
    "embeddings.position_embedding.weight": (16, 8),
    "encoder.layers.0.self_attn.q_proj.weight": (8, 8),
    "encoder.layers.0.self_attn.q_proj.bias": (8,),
    "encoder.layers.0.self_attn.k_proj.weight": (8, 8),
    "encoder.layers.0.self_attn.v_proj.weight": (8, 8),
    "encoder.layers.0.self_attn.out_proj.weight": (8, 8),
    "encoder.layers.0.layer_norm1.weight": (8,),
    "encoder.layers.0.layer_norm2.weight": (8,),
    "encoder.layers.0.mlp.fc1.weight": (16, 8),
    "encoder.layers.0.mlp.fc2.weight": (8, 16),
    "post_layernorm.weight": (8,),
}

# Gemma 4's towers (vision encoder, audio conformer) and their embedders, a few tensors each.
GEMMA4_VISION = {
    "patch_embedder.input_proj.weight": (8, 12),
    "encoder.layers.0.self_attn.q_proj.linear.weight": (8, 8),
    "encoder.layers.0.mlp.gate_proj.linear.weight": (16, 8),
    "encoder.layers.0.input_layernorm.weight": (8,),
}
GEMMA4_AUDIO = {
    "subsample_conv_projection.layer0.conv.weight": (8, 3, 3, 1),
    "layers.0.self_attn.q_proj.linear.weight": (8, 8),
    "layers.0.feed_forward1.ffw_layer_1.linear.weight": (16, 8),
    "output_proj.weight": (8, 8),
}
EMBEDDER = {"embedding_projection.weight": (64, 8)}


def text_of(cfg: dict, drop: tuple) -> dict:
    return {k: v for k, v in cfg.items() if k not in drop and k != "architectures"}


# (Each model is built from a copy of its config: the wrappers' ModelArgs fill in the
# text_config they are given, and config.json must stay as a real checkpoint writes it.)
def make_gemma3_mm(job: Job) -> Path:
    text = text_of(gemma3_config(), ("num_attention_heads", "num_key_value_heads", "vocab_size"))
    text["rope_scaling"] = {"factor": 8.0, "rope_type": "linear"}
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "vocab_size": VOCAB, "text_config": text,
           "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8,
                             "intermediate_size": 16, "num_hidden_layers": 1,
                             "num_attention_heads": 2, "patch_size": 2, "image_size": 8},
           "mm_tokens_per_image": 4, "boi_token_index": 1, "eoi_token_index": 2,
           "image_token_index": 3}
    model = random_model(gemma3, copy.deepcopy(cfg), job.seed, mx.bfloat16)
    randomize_scales(model, 31)
    weights = weights_of(model, drop=("language_model.lm_head.weight",))
    weights.update(tower("vision_tower.vision_model.", SIGLIP, 41))
    weights.update(tower("multi_modal_projector.", {"mm_input_projection_weight": (8, 64),
                                                    "mm_soft_emb_norm.weight": (8,)}, 42))
    return write_model(job, weights, cfg, f"gemma3.Model, random weights (seed {job.seed}, norm noise 31), bf16, "
                       "tied; random vision tower and projector (seeds 41, 42)")


def gemma4_wrapper_config(text: dict) -> dict:
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
            "vocab_size": VOCAB, "text_config": text,
            "vision_config": {"model_type": "gemma4_vision", "hidden_size": 8},
            "audio_config": {"model_type": "gemma4_audio", "hidden_size": 8}}


def make_gemma4_mm(job: Job) -> Path:
    text = text_of(gemma4_config(), ("num_attention_heads", "vocab_size"))
    cfg = gemma4_wrapper_config(text)
    model = random_model(gemma4, copy.deepcopy(cfg), job.seed, mx.bfloat16)
    randomize_scales(model, 32)
    weights = {}
    for k, v in weights_of(model).items():
        assert k.startswith("language_model.model."), k
        weights["model.language_model." + k.removeprefix("language_model.model.")] = v
    # Hugging Face stores the KV-shared layers' K/V projections; mlx-lm's sanitize drops them.
    n, shared = text["num_hidden_layers"], text["num_kv_shared_layers"]
    for i in range(n - shared, n):
        hd = text["global_head_dim"] if text["layer_types"][i] == "full_attention" else text["head_dim"]
        weights.update(tower(f"model.language_model.layers.{i}.self_attn.",
                             {"k_proj.weight": (hd, 64), "v_proj.weight": (hd, 64),
                              "k_norm.weight": (hd,)}, 50 + i))
    weights.update(tower("model.vision_tower.", GEMMA4_VISION, 43))
    weights.update(tower("model.embed_vision.", EMBEDDER, 44))
    weights.update(tower("model.audio_tower.", GEMMA4_AUDIO, 45))
    weights.update(tower("model.embed_audio.", EMBEDDER, 46))
    return write_model(job, weights, cfg, f"gemma4.Model, random weights (seed {job.seed}, norm noise 32), bf16, "
                       "tied, Hugging Face names; random shared-layer K/V, vision and audio towers (seeds 43-46, "
                       "53-55)")


def make_gemma4_mm_mlx(job: Job) -> Path:
    text = text_of(gemma4_config(**GEMMA4_KEQV), ("vocab_size",))
    cfg = gemma4_wrapper_config(text)
    model = random_model(gemma4, copy.deepcopy(cfg), job.seed, mx.bfloat16)
    randomize_scales(model, 33)
    weights = weights_of(model)
    assert "language_model.lm_head.weight" in weights
    weights.update(tower("vision_tower.", GEMMA4_VISION, 47))
    weights.update(tower("embed_vision.", EMBEDDER, 48))
    weights.update(tower("audio_tower.", GEMMA4_AUDIO, 49))
    weights.update(tower("embed_audio.", EMBEDDER, 40))
    return write_model(job, weights, cfg, f"gemma4.Model, random weights (seed {job.seed}, norm noise 33), bf16, "
                       "untied, K = V, mlx-community names; random vision and audio towers (seeds 47-49, 40)")


if __name__ == "__main__":
    tinymodels.main({"make_wrappers": sys.modules[__name__]})
