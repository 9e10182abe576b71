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

GENERATOR = "oracles/gen_vision_qwen35.py"
NAME = "tiny-qwen3-5-vl"
MODEL_DIR = REPO / "goldens" / "models" / NAME
OUT = REPO / "goldens" / "vision" / "qwen35-l1"
SEED = 35
IMAGE, VSTART, VEND, VIDEO = 10, 11, 12, 13

TEXT = {"model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "vocab_size": 1024, "max_position_embeddings": 4096, "linear_num_value_heads": 4,
        "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 2, "tie_word_embeddings": False,
        "attention_bias": False,
        "rope_parameters": {"type": "default", "mrope_section": [2, 1, 1], "rope_theta": 100000,
                            "partial_rotary_factor": 0.5, "mrope_interleaved": True}}
VISION = {"model_type": "qwen3_5", "depth": 3, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
          "out_hidden_size": 64, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
          "in_channels": 3, "num_position_embeddings": 36, "deepstack_visual_indexes": []}
CONFIG = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
          "text_config": TEXT, "vision_config": VISION, "image_token_id": IMAGE, "video_token_id": VIDEO,
          "vision_start_token_id": VSTART, "vision_end_token_id": VEND, "tie_word_embeddings": False}
NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight")
PREPROCESSOR = json.loads((REPO / "goldens" / "models" / "tiny-qwen3-vl-vision" / "preprocessor_config.json")
                          .read_text())
IMAGES = ["rgb_97x61.png", "rgb_64x64.png", "jpeg_1100x700.jpg"]
STEPS = 4


def make_model(job=None) -> None:
    """The tiny model (`job`: the manifest row's, unused: its seed and place are fixed here)."""
    from mlx_vlm.models import qwen3_5

    mx.random.seed(SEED)
    model = qwen3_5.Model(qwen3_5.ModelConfig.from_dict(json.loads(json.dumps(CONFIG))))
    mx.eval(model.parameters())
    # Norm weights start at one, biases at zero, dt_bias at one: draw them away, so a dropped or
    # misplaced one changes the outputs.
    updates = []
    for i, (name, v) in enumerate(tree_flatten(model.parameters())):
        key = mx.random.key(SEED * 1000 + i)
        if "norm" in name and name.endswith(".weight"):
            updates.append((name, 1.0 + 0.3 * mx.random.normal(v.shape, key=key)))
        elif "norm" in name and name.endswith(".bias"):
            updates.append((name, 0.1 * mx.random.normal(v.shape, key=key)))
        elif name.endswith("pos_embed.weight"):
            updates.append((name, 0.5 * mx.random.normal(v.shape, key=key)))
        elif name.endswith("dt_bias"):
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
            if name.endswith("conv1d.weight"):
                v = v.moveaxis(2, 1)  # MLX [C, K, 1] -> PyTorch [C, 1, K]
            if any(name.endswith(s) for s in NORM_SUFFIXES):
                v = v - 1.0  # Hugging Face stores these (1 + w) norms as w
        else:
            assert k == "language_model.lm_head.weight", k
            name = "lm_head.weight"
        weights[name] = v.astype(mx.float32)
    shutil.rmtree(MODEL_DIR, ignore_errors=True)
    MODEL_DIR.mkdir(parents=True)
    mx.save_safetensors(str(MODEL_DIR / "model.safetensors"), weights, metadata={"format": "pt"})
    write_json(MODEL_DIR / "config.json", CONFIG)
    write_json(MODEL_DIR / "preprocessor_config.json", PREPROCESSOR)
    src = REPO / "goldens" / "models" / "tiny-qwen3-5-mm"
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        shutil.copy(src / f, MODEL_DIR / f)
    prov = provenance("mlx-vlm", "mlx-vlm")
    prov["versions"].update({k: md.version(k) for k in ("mlx-vlm", "transformers", "pillow", "numpy")})
    write_json(MODEL_DIR / "provenance.json", {
        "provenance": prov, "generator": GENERATOR,
        "notes": f"mlx_vlm.models.qwen3_5.Model, random weights (seed {SEED}), f32, untied, Hugging Face "
                 "names and layouts (Conv3d, conv1d [C, 1, K], (1 + w) norms as w); norms and dt_bias "
                 "drawn away from one; tokenizer from tiny-qwen3-5-mm"})


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
    assert len(deep) == 0
    tower = {"images": [0, 1, 2], "merged": put(feats)}

    prompts = []
    for chosen, lead in (([0], 8), ([1, 2], 40)):
        # `lead` text tokens first: the 2-image prompt runs past one 64-token delta-net chunk.
        ids = [7] + [300 + (i * 37) % 600 for i in range(lead)]
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
        steps, step_logits = [], []
        y = mx.argmax(logits[:, -1, :], axis=-1)
        for _ in range(STEPS):
            steps.append(int(y.item()))
            out = model.language_model(y[None], cache=cache).logits
            step_logits.append(out[0, -1])
            y = mx.argmax(out[:, -1, :], axis=-1)
        steps.append(int(y.item()))
        prompts.append({"images": chosen, "ids": ids, "rope_delta": int(deltas.reshape(-1)[0].item()),
                        "position_ids": np.asarray(positions).reshape(3, -1).tolist(),
                        "logits": put(logits[0]), "greedy": steps,
                        "step_logits": put(mx.stack(step_logits))})

    # mlx_vlm's own decode loop (generate_step, greedy): each step's log-probabilities and the
    # ids, and the lengths the language model was called on (its prefill chunks).
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
    cache = make_prompt_cache(model.language_model)
    pv = mx.array(np.concatenate([patches[i] for i in p["images"]]))
    logits = model(mx.array([p["ids"]]), pixel_values=pv, cache=cache,
                   image_grid_thw=mx.array([grids[i] for i in p["images"]])).logits
    steps, step_logits = [], []
    y = mx.argmax(logits[:, -1, :], axis=-1)
    for _ in range(STEPS):
        steps.append(int(y.item()))
        out = model.language_model(y[None], cache=cache).logits
        step_logits.append(out[0, -1])
        y = mx.argmax(out[:, -1, :], axis=-1)
    steps.append(int(y.item()))
    bf16["prompt"] = {"index": 1, "logits": put(logits[0]), "greedy": steps,
                      "step_logits": put(mx.stack(step_logits))}

    prov = provenance("mlx-vlm", "mlx-vlm")
    prov["generator"] = GENERATOR
    prov["versions"].update({k: md.version(k) for k in ("mlx-vlm", "transformers", "pillow", "numpy")})
    prov["reference"] = ("mlx_vlm.utils.load_model (qwen3_5.Model.sanitize, VisionModel.sanitize); "
                         "VisionModel.__call__; qwen3_5 Model.__call__ (get_input_embeddings, get_rope_index, "
                         "LanguageModel: Qwen3_5GatedDeltaNet, Qwen3_5Attention) with make_prompt_cache; "
                         "decode steps language_model(y[None], cache); generate.ar.generate_step")
    OUT.mkdir(parents=True, exist_ok=True)
    write_json(OUT / "golden.json", {"provenance": prov, "model": f"models/{NAME}",
                                     "tensors_bin": "tensors.bin", "images": images, "tower": tower,
                                     "prompts": prompts, "bf16": bf16})
    (OUT / "tensors.bin").write_bytes(b"".join(blobs))
    print(f"{OUT}: {sum(map(len, blobs)) / 1e3:.0f} kB of tensors; greedy {[p['greedy'] for p in prompts]}; "
          f"lengths {[len(p['ids']) for p in prompts]}; calls {[p['generate']['calls'] for p in prompts]}; "
          f"generate {[p['generate']['ids'] for p in prompts]}")


if __name__ == "__main__":
    main()
