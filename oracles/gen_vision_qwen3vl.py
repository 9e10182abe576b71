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

import hashlib
import importlib.metadata as md
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from provenance import provenance, write_json  # noqa: E402

GENERATOR = "oracles/gen_vision_qwen3vl.py"
NAME = "tiny-qwen3-vl-vision"
MODEL_DIR = REPO / "goldens" / "models" / NAME
OUT = REPO / "goldens" / "vision" / "qwen3vl-l1"
SEED = 41
IMAGE, VSTART, VEND, VIDEO = 10, 11, 12, 13

TEXT = {"model_type": "qwen3_vl_text", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 160,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "vocab_size": 1024, "max_position_embeddings": 4096, "rope_theta": 5000000.0,
        "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        "tie_word_embeddings": False}
VISION = {"model_type": "qwen3_vl", "depth": 3, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
          "out_hidden_size": 64, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
          "in_channels": 3, "num_position_embeddings": 36, "deepstack_visual_indexes": [0, 1]}
CONFIG = {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
          "text_config": TEXT, "vision_config": VISION, "image_token_id": IMAGE, "video_token_id": VIDEO,
          "vision_start_token_id": VSTART, "vision_end_token_id": VEND, "tie_word_embeddings": False}
# Qwen3-VL's preprocessor_config.json (as oracles/gen_vision_preprocess.py's QWEN_REAL) with
# small pixel bounds, so a test image is a few patches.
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "merge_size": 2, "patch_size": 16,
    "rescale_factor": 0.00392156862745098, "size": {"longest_edge": 16384, "shortest_edge": 1024},
    "temporal_patch_size": 2,
}
# Non-square (w != h: a swapped axis shows), square, and a large JPEG downscaled to the budget.
IMAGES = ["rgb_97x61.png", "rgb_64x64.png", "jpeg_1100x700.jpg"]
STEPS = 4


def make_model(job=None) -> None:
    """The tiny model (`job`: the manifest row's, unused: its seed and place are fixed here)."""
    from mlx_vlm.models import qwen3_vl

    mx.random.seed(SEED)
    model = qwen3_vl.Model(qwen3_vl.ModelConfig.from_dict(json.loads(json.dumps(CONFIG))))
    mx.eval(model.parameters())
    # Norm weights start at one and LayerNorm biases at zero: draw them away, so a dropped or
    # misplaced norm changes the outputs.
    updates = []
    for i, (name, v) in enumerate(tree_flatten(model.parameters())):
        key = mx.random.key(SEED * 1000 + i)
        if "norm" in name and name.endswith(".weight"):
            updates.append((name, 1.0 + 0.3 * mx.random.normal(v.shape, key=key)))
        elif "norm" in name and name.endswith(".bias"):
            updates.append((name, 0.1 * mx.random.normal(v.shape, key=key)))
        elif name.endswith("pos_embed.weight"):
            updates.append((name, 0.5 * mx.random.normal(v.shape, key=key)))
    model.load_weights(updates, strict=False)
    mx.eval(model.parameters())
    weights = {}
    for k, v in tree_flatten(model.parameters()):
        if k.startswith("vision_tower."):
            name = "model.visual." + k.removeprefix("vision_tower.")
            if name.endswith("patch_embed.proj.weight"):
                v = v.transpose(0, 4, 1, 2, 3)  # MLX [out, t, kh, kw, in] -> PyTorch [out, in, t, kh, kw]
        elif k.startswith("language_model.model."):
            name = "model.language_model." + k.removeprefix("language_model.model.")
        else:
            assert k == "language_model.lm_head.weight", k
            name = "lm_head.weight"
        weights[name] = v.astype(mx.float32)
    shutil.rmtree(MODEL_DIR, ignore_errors=True)
    MODEL_DIR.mkdir(parents=True)
    mx.save_safetensors(str(MODEL_DIR / "model.safetensors"), weights, metadata={"format": "pt"})
    write_json(MODEL_DIR / "config.json", CONFIG)
    write_json(MODEL_DIR / "preprocessor_config.json", PREPROCESSOR)
    src = REPO / "goldens" / "models" / "tiny-qwen3-vl"
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        shutil.copy(src / f, MODEL_DIR / f)
    prov = provenance("mlx-vlm", "mlx-vlm")
    prov["versions"].update({k: md.version(k) for k in ("mlx-vlm", "transformers", "pillow", "numpy")})
    write_json(MODEL_DIR / "provenance.json", {
        "provenance": prov, "generator": GENERATOR,
        "notes": f"mlx_vlm.models.qwen3_vl.Model, random weights (seed {SEED}), f32, untied, Hugging Face "
                 "names and Conv3d layout; norms drawn away from one; tokenizer from tiny-qwen3-vl"})


def greedy_steps(model, logits, cache):
    """STEPS greedy decode steps after a prompt's `logits`: the ids (STEPS + 1) and each
    step's last-position logits."""
    steps, step_logits = [], []
    y = mx.argmax(logits[:, -1, :], axis=-1)
    for _ in range(STEPS):
        steps.append(int(y.item()))
        out = model.language_model(y[None], cache=cache).logits
        step_logits.append(out[0, -1])
        y = mx.argmax(out[:, -1, :], axis=-1)
    steps.append(int(y.item()))
    return steps, step_logits


def main() -> None:
    for pkg, want in (("mlx-vlm", "0.7.10"), ("mlx", "0.32.2"), ("pillow", "13.0.0")):
        if md.version(pkg) != want:
            sys.exit(f"{pkg} {md.version(pkg)} here, the goldens pin {want}: see oracles/requirements-vision.txt")
    mx.set_default_device(mx.cpu)
    make_model()

    from gen_vision_preprocess import qwen_processor
    from mlx_vlm.models.cache import make_prompt_cache
    from mlx_vlm.utils import load_image, load_model

    model = load_model(MODEL_DIR)
    proc = qwen_processor(PREPROCESSOR)
    blobs: list[bytes] = []

    def put(a: mx.array) -> dict:
        t = np.asarray(a.astype(mx.float32))
        raw = t.astype("<f4").tobytes()
        entry = {"shape": list(t.shape), "offset": sum(map(len, blobs)), "len": len(raw)}
        blobs.append(raw)
        return entry

    images, patches, grids = [], [], []
    for name in IMAGES:
        out = proc(images=[load_image(str(REPO / "goldens" / "vision" / "images" / name))])
        pv = np.asarray(out["pixel_values"], dtype=np.float32)
        grid = [int(v) for v in out["image_grid_thw"][0]]
        images.append({"file": f"images/{name}", "grid_thw": grid, "patches_shape": list(pv.shape),
                       "patches_sha256": hashlib.sha256(pv.astype("<f4").tobytes()).hexdigest(),
                       "tokens": grid[0] * grid[1] * grid[2] // 4})
        patches.append(pv)
        grids.append(grid)

    dtype = model.vision_tower.patch_embed.proj.weight.dtype
    feats, deep = model.vision_tower(mx.array(np.concatenate(patches)).astype(dtype), mx.array(grids))
    tower = {"images": [0, 1, 2], "merged": put(feats), "deepstack": [put(d) for d in deep]}

    prompts = []
    for chosen in ([0], [1, 2]):
        ids = [7, 300, 301, 302]
        for j, i in enumerate(chosen):
            ids += [VSTART] + [IMAGE] * images[i]["tokens"] + [VEND] + [400 + j, 401 + j]
        ids += [8, 7, 500, 501]
        pv = mx.array(np.concatenate([patches[i] for i in chosen]))
        grid = mx.array([grids[i] for i in chosen])
        x = mx.array([ids])
        positions, deltas = model.language_model.get_rope_index(x, grid, None, None)
        cache = make_prompt_cache(model.language_model)
        logits = model(x, pixel_values=pv, cache=cache, image_grid_thw=grid).logits
        mx.eval(logits)
        steps, step_logits = greedy_steps(model, logits, cache)
        prompts.append({"images": chosen, "ids": ids, "rope_delta": int(deltas.reshape(-1)[0].item()),
                        "position_ids": np.asarray(positions).reshape(3, -1).tolist(),
                        "logits": put(logits[0]), "greedy": steps,
                        "step_logits": put(mx.stack(step_logits))})

    # mlx_vlm's own decode loop (generate_step, greedy): its prefill runs the prompt but its
    # last token in chunks (prefill_step_size 2048), then the last token, then the steps; each
    # step's log-probabilities and the ids, and the lengths the language model was called on.
    from mlx_vlm.generate.ar import generate_step

    lm_cls = type(model.language_model)
    real_call = lm_cls.__call__
    for p in prompts:
        seen: list[int] = []

        def spy(self, inputs, *a, **kw):
            seen.append(int(inputs.shape[-1]))
            return real_call(self, inputs, *a, **kw)

        lm_cls.__call__ = spy
        try:
            pv = mx.array(np.concatenate([patches[i] for i in p["images"]]))
            gen = generate_step(mx.array([p["ids"]]), model, pv, None, max_tokens=STEPS + 1,
                                sampler=lambda lp: mx.argmax(lp, axis=-1),
                                image_grid_thw=mx.array([grids[i] for i in p["images"]]))
            ids, lps = [], []
            for tok, lp in gen:
                ids.append(int(tok))
                lps.append(lp)
        finally:
            lm_cls.__call__ = real_call
        p["generate"] = {"ids": ids, "logprobs": put(mx.stack(lps)), "calls": seen}

    # bf16 (the dtype of the released checkpoints): the same weights cast, as a bf16
    # checkpoint of them loads; the tower on the three images and the 1-image prompt.
    model.set_dtype(mx.bfloat16)
    feats, deep = model.vision_tower(mx.array(np.concatenate(patches)).astype(mx.bfloat16), mx.array(grids))
    bf16 = {"tower": {"merged": put(feats), "deepstack": [put(d) for d in deep]}}
    p = prompts[0]
    cache = make_prompt_cache(model.language_model)
    pv = mx.array(np.concatenate([patches[i] for i in p["images"]]))
    logits = model(mx.array([p["ids"]]), pixel_values=pv, cache=cache,
                   image_grid_thw=mx.array([grids[i] for i in p["images"]])).logits
    steps, step_logits = greedy_steps(model, logits, cache)
    bf16["prompt"] = {"index": 0, "logits": put(logits[0]), "greedy": steps,
                      "step_logits": put(mx.stack(step_logits))}

    prov = provenance("mlx-vlm", "mlx-vlm")
    prov["generator"] = GENERATOR
    prov["versions"].update({k: md.version(k) for k in ("mlx-vlm", "transformers", "pillow", "numpy")})
    prov["reference"] = ("mlx_vlm.utils.load_model (qwen3_vl.Model.sanitize, VisionModel.sanitize); "
                         "VisionModel.__call__; Model.__call__ (get_input_embeddings, get_rope_index, "
                         "LanguageModel) with make_prompt_cache; decode steps language_model(y[None], cache)")
    OUT.mkdir(parents=True, exist_ok=True)
    write_json(OUT / "golden.json", {"provenance": prov, "model": f"models/{NAME}",
                                     "tensors_bin": "tensors.bin", "images": images, "tower": tower,
                                     "prompts": prompts, "bf16": bf16})
    (OUT / "tensors.bin").write_bytes(b"".join(blobs))
    print(f"{OUT}: {sum(map(len, blobs)) / 1e3:.0f} kB of tensors; greedy {[p['greedy'] for p in prompts]}")


if __name__ == "__main__":
    main()
