"""Qwen3-VL's vision tower and image path, as mlx-vlm 0.7.10 computes them: a tiny model made
with mlx-vlm's own classes, and its goldens (engine::vision::qwen_vit, engine::vision::qwen3vl_lm).

    /work/vision-venv/bin/python oracles/gen_vision_qwen3vl.py
    (the venv: oracles/requirements-vision.txt says how to make it; needs goldens/vision/images,
    written by oracles/gen_vision_preprocess.py, and goldens/models/tiny-qwen3-vl's tokenizer)

Writes:
  goldens/models/tiny-qwen3-vl-vision/   mlx_vlm.models.qwen3_vl.Model, random weights (seed 41),
      f32, in Hugging Face's layout (`model.visual.…`, `model.language_model.…`, `lm_head.weight`,
      the patch embedding's Conv3d in PyTorch's [out, in, t, kh, kw]); vision: depth 3, width 16,
      2 heads (head_dim 8: the tower's fused SDPA pads it to 64), MLP 32, patch 16 (the real one),
      temporal patch 2, merge 2, a 6 x 6 learned position table (interpolated to every grid),
      deepstack after blocks 0 and 1; text: tiny-qwen3-vl's (qwen3 with M-RoPE, mrope_section
      [2, 3, 3] interleaved); image / vision-start / vision-end / video ids 10 / 11 / 12 / 13;
      preprocessor_config.json Qwen3-VL's own values but for min / max pixels 1024 / 16384;
      tokenizer files copied from tiny-qwen3-vl.
  goldens/vision/qwen3vl-l1/golden.json + tensors.bin   loaded back with mlx_vlm.utils.load_model
      (so mlx-vlm's sanitize runs on the HF layout), for three test images run through mlx-vlm's
      Qwen3VLImageProcessor: the patches' SHA-256 and grid_thw; the tower's output on the three
      images in one call (merged features, both deepstack features); for a prompt with 1 image
      and one with 2 images: `Model.__call__`'s logits at every position (full vocab) with a
      fresh cache, then 4 greedy decode steps through `language_model(y, cache)` as
      mlx_vlm.generate's decode loop calls it (rope deltas from the prompt), each step's logits
      and ids; the rope deltas and the M-RoPE position ids of each prompt;
      mlx_vlm.generate's own generate_step (greedy) on both prompts: its ids, each step's
      log-probabilities and the lengths its language-model calls took (the chunked prefill);
      then the same model cast to bf16 (`set_dtype`, as a bf16 checkpoint of these weights loads): the
      tower's outputs and the 1-image prompt's logits, steps and ids (`bf16`).
tensors.bin is little-endian f32, the offsets and shapes in golden.json.
"""

from __future__ import annotations

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

GENERATOR = "oracles/gen_vision_qwen3vl.py"
NAME = "tiny-qwen3-vl-vision"
MODEL_DIR = REPO / "goldens" / "models" / NAME
OUT = REPO / "goldens" / "vision" / "qwen3vl-l1"
SEED = 41

TEXT = {"model_type": "qwen3_vl_text", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 160,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "vocab_size": 1024, "max_position_embeddings": 4096, "rope_theta": 5000000.0,
        "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        "tie_word_embeddings": False}
CONFIG = qwen_config("Qwen3VLForConditionalGeneration", "qwen3_vl", TEXT, deepstack=[0, 1])
# Qwen3-VL's preprocessor_config.json (as oracles/gen_vision_preprocess.py's QWEN_REAL) with
# small pixel bounds, so a test image is a few patches.
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "merge_size": 2, "patch_size": 16,
    "rescale_factor": 0.00392156862745098, "size": {"longest_edge": 16384, "shortest_edge": 1024},
    "temporal_patch_size": 2,
}
STEPS = 4


def make_model(job=None) -> None:
    """The tiny model (`job`: the manifest row's, unused: its seed and place are fixed here)."""
    from mlx_vlm.models import qwen3_vl

    model = qwen_model(qwen3_vl, CONFIG, SEED)
    weights = qwen_hf_weights(model)
    write_tiny_model(MODEL_DIR, weights, "pt", {"config.json": CONFIG, "preprocessor_config.json": PREPROCESSOR},
                     "tiny-qwen3-vl", GENERATOR,
                     f"mlx_vlm.models.qwen3_vl.Model, random weights (seed {SEED}), f32, untied, Hugging Face "
                     "names and Conv3d layout; norms drawn away from one; tokenizer from tiny-qwen3-vl")


def main() -> None:
    model, images, patches, grids, feats, deep = qwen_reference(make_model, MODEL_DIR, PREPROCESSOR)
    blobs = F32Blobs()
    put = blobs.put
    tower = {"images": [0, 1, 2], "merged": put(feats), "deepstack": [put(d) for d in deep]}

    # A 1-image and a 2-image prompt, then mlx_vlm's own decode loop on each (generate_step,
    # greedy): its prefill runs the prompt but its last token in chunks (prefill_step_size
    # 2048), then the last token, then the steps.
    lead = [7, 300, 301, 302]
    prompts = qwen_prompts(model, images, patches, grids, [([0], lead), ([1, 2], lead)], blobs, STEPS)

    # bf16 (the dtype of the released checkpoints): the same weights cast, as a bf16
    # checkpoint of them loads; the tower on the three images and the 1-image prompt.
    model.set_dtype(mx.bfloat16)
    feats, deep = model.vision_tower(mx.array(np.concatenate(patches)).astype(mx.bfloat16), mx.array(grids))
    bf16 = {"tower": {"merged": put(feats), "deepstack": [put(d) for d in deep]}}
    p = prompts[0]
    bf16["prompt"] = {"index": 0, **qwen_prompt_run(model, p["ids"], p["images"], patches, grids, blobs, STEPS)}

    reference = ("mlx_vlm.utils.load_model (qwen3_vl.Model.sanitize, VisionModel.sanitize); "
                 "VisionModel.__call__; Model.__call__ (get_input_embeddings, get_rope_index, "
                 "LanguageModel) with make_prompt_cache; decode steps language_model(y[None], cache)")
    golden = {"model": f"models/{NAME}", "tensors_bin": "tensors.bin", "images": images, "tower": tower,
              "prompts": prompts, "bf16": bf16}
    write_golden(OUT, "golden.json", GENERATOR, reference, golden, blobs.data())
    print(f"{OUT}: {blobs.size() / 1e3:.0f} kB of tensors; greedy {[p['greedy'] for p in prompts]}")


if __name__ == "__main__":
    main()
