"""Qwen3.5's language model with images, as mlx-vlm 0.7.10 computes it: a tiny model made with
mlx-vlm's own classes, and its goldens (engine::vision::qwen35_lm).

    /work/vision-venv/bin/python oracles/gen_vision_qwen35.py
    (the venv: oracles/requirements-vision.txt says how to make it; needs goldens/vision/images,
    written by oracles/gen_vision_preprocess.py, and goldens/models/tiny-qwen3-5-mm's tokenizer)

Writes:
  goldens/models/tiny-qwen3-5-vl/   mlx_vlm.models.qwen3_5.Model, random weights (seed 35), f32,
      in Hugging Face's layout (`model.visual.…`, `model.language_model.…`, `lm_head.weight`; the
      patch embedding's Conv3d as PyTorch's [out, in, t, kh, kw], the delta nets' conv kernels
      as [C, 1, K], the (1 + w) RMSNorms stored as w, which mlx-vlm's sanitize gives their 1);
      vision: tiny-qwen3-vl-vision's tower (depth 3, width 16, patch 16, merge 2) without
      deepstack (Qwen3.5 has none); text: 4 layers, full_attention_interval 2 (gated delta net,
      attention, gated delta net, attention), width 64, 4 query / 2 KV heads of 16,
      partial_rotary_factor 0.5 (8 rotated dims, 4 frequencies), mrope_section [2, 1, 1]
      (interleaved: frequencies t, h, w, t), delta nets of 2 key / 4 value heads of 16, conv 4;
      image / vision-start / vision-end / video ids 10 / 11 / 12 / 13; preprocessor_config.json
      as tiny-qwen3-vl-vision's; tokenizer files copied from tiny-qwen3-5-mm.
  goldens/vision/qwen35-l1/golden.json + tensors.bin   loaded back with mlx_vlm.utils.load_model
      (so mlx-vlm's sanitize runs on the HF layout), for three test images run through mlx-vlm's
      Qwen3VLImageProcessor: the patches' SHA-256 and grid_thw; the tower's output on the three
      images in one call; for a prompt with 1 image (23 tokens) and one with 2 images (72
      tokens: two of the delta net's 64-token prefill chunks): `Model.__call__`'s logits at
      every position (full vocab) with a fresh cache, then 4 greedy decode steps through
      `language_model(y, cache)` as mlx_vlm.generate's decode loop calls it, each step's logits
      and ids; the rope deltas and M-RoPE position ids; mlx_vlm.generate's own generate_step
      (greedy) on both prompts: its ids, each step's log-probabilities and the lengths its
      language-model calls took (the chunked prefill); then the same tensors cast to bf16 and
      loaded as a bf16 checkpoint: the tower's output and the 2-image prompt's logits, steps
      and ids (`bf16`).
Run on the CPU (as the goldens are): the delta nets' prefill is then mlx-vlm's
`gated_delta_chunked` (its Metal kernel is Apple-only), a decode step `gated_delta_ops`.
tensors.bin is little-endian f32, the offsets and shapes in golden.json.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from vision_l1 import (  # noqa: E402
    F32Blobs, qwen_config, qwen_hf_weights, qwen_model, qwen_prompt_run, qwen_prompts, qwen_reference,
    write_golden, write_tiny_model)

GENERATOR = "oracles/gen_vision_qwen35.py"
NAME = "tiny-qwen3-5-vl"
MODEL_DIR = REPO / "goldens" / "models" / NAME
OUT = REPO / "goldens" / "vision" / "qwen35-l1"
SEED = 35

TEXT = {"model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "vocab_size": 1024, "max_position_embeddings": 4096, "linear_num_value_heads": 4,
        "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 2, "tie_word_embeddings": False,
        "attention_bias": False,
        "rope_parameters": {"type": "default", "mrope_section": [2, 1, 1], "rope_theta": 100000,
                            "partial_rotary_factor": 0.5, "mrope_interleaved": True}}
CONFIG = qwen_config("Qwen3_5ForConditionalGeneration", "qwen3_5", TEXT, deepstack=[])
NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight")
PREPROCESSOR = json.loads((REPO / "goldens" / "models" / "tiny-qwen3-vl-vision" / "preprocessor_config.json")
                          .read_text())
STEPS = 4


def make_model(job=None) -> None:
    """The tiny model (`job`: the manifest row's, unused: its seed and place are fixed here)."""
    from mlx_vlm.models import qwen3_5

    model = qwen_model(qwen3_5, CONFIG, SEED)

    def text_layout(name, v):
        if name.endswith("conv1d.weight"):
            v = v.moveaxis(2, 1)  # MLX [C, K, 1] -> PyTorch [C, 1, K]
        if any(name.endswith(s) for s in NORM_SUFFIXES):
            v = v - 1.0  # Hugging Face stores these (1 + w) norms as w
        return v

    weights = qwen_hf_weights(model, text_layout)
    write_tiny_model(MODEL_DIR, weights, "pt", {"config.json": CONFIG, "preprocessor_config.json": PREPROCESSOR},
                     "tiny-qwen3-5-mm", GENERATOR,
                     f"mlx_vlm.models.qwen3_5.Model, random weights (seed {SEED}), f32, untied, Hugging Face "
                     "names and layouts (Conv3d, conv1d [C, 1, K], (1 + w) norms as w); norms and dt_bias "
                     "drawn away from one; tokenizer from tiny-qwen3-5-mm")


def main() -> None:
    from mlx_vlm.utils import load_model

    model, images, patches, grids, feats, deep = qwen_reference(make_model, MODEL_DIR, PREPROCESSOR)
    blobs = F32Blobs()
    put = blobs.put
    assert len(deep) == 0
    tower = {"images": [0, 1, 2], "merged": put(feats)}

    # A 1-image and a 2-image prompt, each with `n` text tokens first (the 2-image prompt runs
    # past one 64-token delta-net chunk), then mlx_vlm's own decode loop on each (generate_step,
    # greedy; the language model's calls are its prefill chunks).
    lead = {n: [7] + [300 + (i * 37) % 600 for i in range(n)] for n in (8, 40)}
    prompts = qwen_prompts(model, images, patches, grids, [([0], lead[8]), ([1, 2], lead[40])], blobs, STEPS)

    # bf16 (the dtype of the released checkpoints): the same tensors cast to bf16 and saved
    # as a checkpoint, loaded as mlx-vlm loads one (its sanitize's +1 on the norms then runs in
    # bf16); the tower on the three images and the 2-image prompt (two delta-net chunks; the
    # decode steps take mlx-vlm's bf16 depthwise decode conv).
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for f in MODEL_DIR.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, Path(tmp) / f.name)
        cast = {k: v.astype(mx.bfloat16) for k, v in mx.load(str(MODEL_DIR / "model.safetensors")).items()}
        mx.save_safetensors(str(Path(tmp) / "model.safetensors"), cast, metadata={"format": "pt"})
        model = load_model(Path(tmp))
    feats, _ = model.vision_tower(mx.array(np.concatenate(patches)).astype(mx.bfloat16), mx.array(grids))
    bf16 = {"tower": {"merged": put(feats)}}
    p = prompts[1]
    bf16["prompt"] = {"index": 1, **qwen_prompt_run(model, p["ids"], p["images"], patches, grids, blobs, STEPS)}

    reference = ("mlx_vlm.utils.load_model (qwen3_5.Model.sanitize, VisionModel.sanitize); "
                 "VisionModel.__call__; qwen3_5 Model.__call__ (get_input_embeddings, get_rope_index, "
                 "LanguageModel: Qwen3_5GatedDeltaNet, Qwen3_5Attention) with make_prompt_cache; "
                 "decode steps language_model(y[None], cache); generate.ar.generate_step")
    golden = {"model": f"models/{NAME}", "tensors_bin": "tensors.bin", "images": images, "tower": tower,
              "prompts": prompts, "bf16": bf16}
    write_golden(OUT, "golden.json", GENERATOR, reference, golden, blobs.data())
    print(f"{OUT}: {blobs.size() / 1e3:.0f} kB of tensors; greedy {[p['greedy'] for p in prompts]}; "
          f"lengths {[len(p['ids']) for p in prompts]}; calls {[p['generate']['calls'] for p in prompts]}; "
          f"generate {[p['generate']['ids'] for p in prompts]}")


if __name__ == "__main__":
    main()
