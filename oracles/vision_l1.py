"""What the vision L1 generators (oracles/gen_vision_gemma3.py, gen_vision_gemma4.py,
gen_vision_qwen3vl.py, gen_vision_qwen35.py) share: the pinned mlx-vlm / mlx / pillow versions
they refuse to run without, their provenance, writing a tiny model's dir (weights, configs,
the tokenizer files of its text sibling, provenance); gemma's seeded model and greedy ids
after a prompt; and the Qwen-VL half: the seeded model and its Hugging Face layout, the f32
tensors file, the test images through mlx-vlm's processor, the greedy decode steps and
mlx-vlm's own generate_step with its language-model calls recorded.

Imports go one way: provenance, gen_vision_preprocess <- vision_l1 <- gen_vision_<family>.py. mlx is imported inside
the functions that need it, as the gemma generators do (their manifest rows are read without
mlx-vlm).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata as md
import json
import shutil
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from provenance import provenance, write_atomic, write_json  # noqa: E402

PINS = (("mlx-vlm", "0.7.10"), ("mlx", "0.32.2"), ("pillow", "13.0.0"))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


# The tiny Qwen-VL models' special ids.
QWEN_IMAGE, QWEN_VSTART, QWEN_VEND, QWEN_VIDEO = 10, 11, 12, 13
# The Qwen goldens' test images: non-square (w != h: a swapped axis shows), square, and a large
# JPEG downscaled to the budget.
QWEN_IMAGES = ["rgb_97x61.png", "rgb_64x64.png", "jpeg_1100x700.jpg"]


def check_pins() -> None:
    """Exit unless the versions the goldens pin are the ones installed."""
    for pkg, want in PINS:
        if md.version(pkg) != want:
            sys.exit(f"{pkg} {md.version(pkg)} here, the goldens pin {want}: see oracles/requirements-vision.txt")


def vision_provenance(generator: str | None = None) -> dict:
    """mlx-vlm's provenance with the versions of what the goldens depend on (and `generator`,
    for a golden's)."""
    prov = provenance("mlx-vlm", "mlx-vlm")
    if generator is not None:
        prov["generator"] = generator
    prov["versions"].update({k: md.version(k) for k in ("mlx-vlm", "transformers", "pillow", "numpy")})
    return prov


def copy_tokenizer(src: str, model_dir: Path) -> None:
    """The tokenizer files of goldens/models/`src` into `model_dir`."""
    for f in TOKENIZER_FILES:
        shutil.copy(REPO / "goldens" / "models" / src / f, model_dir / f)


def write_tiny_model(model_dir: Path, weights: dict, fmt: str, files: dict[str, dict], tokenizer_src: str,
                     generator: str, notes: str) -> None:
    """A fresh `model_dir`: model.safetensors (metadata format `fmt`), the JSON `files`
    (config.json, the processor's), the tokenizer files of goldens/models/`tokenizer_src` and
    provenance.json (`generator`, `notes`)."""
    import mlx.core as mx

    shutil.rmtree(model_dir, ignore_errors=True)
    model_dir.mkdir(parents=True)
    mx.save_safetensors(str(model_dir / "model.safetensors"), weights, metadata={"format": fmt})
    for name, obj in files.items():
        write_json(model_dir / name, obj)
    copy_tokenizer(tokenizer_src, model_dir)
    write_json(model_dir / "provenance.json",
               {"provenance": vision_provenance(), "generator": generator, "notes": notes})


def write_golden(out: Path, json_name: str, generator: str, reference: str, fields: dict, tensors: bytes) -> None:
    """A golden: `out`/`json_name` (its provenance, naming `generator` and the `reference`
    computation, then `fields`, whose `tensors_bin` names tensors.bin) and `out`/tensors.bin
    (`tensors`)."""
    prov = vision_provenance(generator)
    prov["reference"] = reference
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "tensors.bin", tensors)
    write_json(out / json_name, {"provenance": prov, **fields})


def gemma_model(config_module, model_module, config: dict, seed: int, drawn, **overrides):
    """`model_module.Model` built from `config` (its text and vision configs through
    `config_module`'s classes, then `overrides` set on the ModelConfig) with seeded random
    values: each parameter `drawn(name, p, noise)` (noise: a standard normal of its shape,
    keyed by the seed and its index), in bf16."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    mx.random.seed(seed)
    cfg = copy.deepcopy(config)
    mc = config_module.ModelConfig.from_dict(cfg)
    mc.text_config = config_module.TextConfig.from_dict(cfg["text_config"])
    mc.vision_config = config_module.VisionConfig.from_dict(cfg["vision_config"])
    for k, v in overrides.items():
        setattr(mc, k, v)
    model = model_module.Model(mc)
    new = []
    for i, (name, p) in enumerate(tree_flatten(model.parameters())):
        noise = mx.random.normal(p.shape, key=mx.random.key(seed * 1000 + i))
        new.append((name, drawn(name, p, noise).astype(mx.bfloat16)))
    model.update(tree_unflatten(new))
    return model


def gemma_greedy_ids(model, logits, cache, n: int, name: str, *generate_args, **generate_kw) -> list[int]:
    """`n` greedy ids after prompt `name` as mlx-vlm's own generate_step(*generate_args,
    max_tokens=n, temperature=0, **generate_kw) gives them, checked against the same greedy
    steps run by hand after the prompt's `logits`, one token at a time through its `cache`:
    generate_step's greedy, the argmax of the logprobs (logits - logsumexp, in the logits'
    bf16, where near logits can tie; the first index wins a tie)."""
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step

    def greedy(lg):
        return int(mx.argmax(lg - mx.logsumexp(lg, axis=-1, keepdims=True)).item())

    own = [greedy(logits[0, -1])]
    for _ in range(n - 1):
        step = model.language_model(mx.array([[own[-1]]]), cache=cache).logits
        own.append(greedy(step[0, -1]))
    gen = [int(tok) for tok, _ in generate_step(*generate_args, max_tokens=n, temperature=0.0, **generate_kw)]
    assert gen == own, (name, gen, own)
    return gen


def qwen_config(architecture: str, model_type: str, text: dict, deepstack: list[int]) -> dict:
    """A tiny Qwen-VL config.json: the `text` config beside the tiny tower (depth 3, width 16,
    2 heads, MLP 32, patch 16, temporal patch 2, merge 2, a 6 x 6 learned position table,
    deepstack after the blocks `deepstack`), the special ids, untied."""
    vision = {"model_type": model_type, "depth": 3, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
              "out_hidden_size": 64, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
              "in_channels": 3, "num_position_embeddings": 36, "deepstack_visual_indexes": deepstack}
    return {"architectures": [architecture], "model_type": model_type,
            "text_config": text, "vision_config": vision, "image_token_id": QWEN_IMAGE, "video_token_id": QWEN_VIDEO,
            "vision_start_token_id": QWEN_VSTART, "vision_end_token_id": QWEN_VEND, "tie_word_embeddings": False}


def qwen_model(module, config: dict, seed: int):
    """`module.Model` from `config` with random weights (`seed`). Norm weights start at one,
    biases at zero, dt_bias at one: they are drawn away (as are the learned positions), so a
    dropped or misplaced one changes the outputs."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    mx.random.seed(seed)
    model = module.Model(module.ModelConfig.from_dict(json.loads(json.dumps(config))))
    mx.eval(model.parameters())
    updates = []
    for i, (name, v) in enumerate(tree_flatten(model.parameters())):
        key = mx.random.key(seed * 1000 + i)
        if "norm" in name and name.endswith(".weight"):
            updates.append((name, 1.0 + 0.3 * mx.random.normal(v.shape, key=key)))
        elif "norm" in name and name.endswith(".bias"):
            updates.append((name, 0.1 * mx.random.normal(v.shape, key=key)))
        elif name.endswith(("pos_embed.weight", "dt_bias")):
            updates.append((name, 0.5 * mx.random.normal(v.shape, key=key)))
    model.load_weights(updates, strict=False)
    mx.eval(model.parameters())
    return model


def qwen_hf_weights(model, text_layout=lambda name, v: v) -> dict:
    """`model`'s parameters in Hugging Face's names and layout, f32: `model.visual.…` (the
    patch embedding's Conv3d as PyTorch's [out, in, t, kh, kw]), `model.language_model.…`
    (each through `text_layout(name, v)`), `lm_head.weight`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    weights = {}
    for k, v in tree_flatten(model.parameters()):
        if k.startswith("vision_tower."):
            name = "model.visual." + k.removeprefix("vision_tower.")
            if name.endswith("patch_embed.proj.weight"):
                v = v.transpose(0, 4, 1, 2, 3)  # MLX [out, t, kh, kw, in] -> PyTorch [out, in, t, kh, kw]
        elif k.startswith("language_model.model."):
            name = "model.language_model." + k.removeprefix("language_model.model.")
            v = text_layout(name, v)
        else:
            assert k == "language_model.lm_head.weight", k
            name = "lm_head.weight"
        weights[name] = v.astype(mx.float32)
    return weights


class F32Blobs:
    """The Qwen goldens' tensors file: arrays as little-endian f32, one after another."""

    def __init__(self) -> None:
        self.blobs: list[bytes] = []

    def put(self, a) -> dict:
        """Append `a` (as f32); its entry (shape, offset, len) for the golden's JSON."""
        import mlx.core as mx

        t = np.asarray(a.astype(mx.float32))
        raw = t.astype("<f4").tobytes()
        entry = {"shape": list(t.shape), "offset": self.size(), "len": len(raw)}
        self.blobs.append(raw)
        return entry

    def size(self) -> int:
        return sum(map(len, self.blobs))

    def data(self) -> bytes:
        return b"".join(self.blobs)


def qwen_images(proc, names: list[str]) -> tuple[list[dict], list[np.ndarray], list[list[int]]]:
    """goldens/vision/images/`names` through the Qwen-VL processor `proc`: each image's golden
    entry (file, grid, the patches' shape and SHA-256, its merged token count), patches and
    grid."""
    from mlx_vlm.utils import load_image

    images, patches, grids = [], [], []
    for name in names:
        out = proc(images=[load_image(str(REPO / "goldens" / "vision" / "images" / name))])
        pv = np.asarray(out["pixel_values"], dtype=np.float32)
        grid = [int(v) for v in out["image_grid_thw"][0]]
        images.append({"file": f"images/{name}", "grid_thw": grid, "patches_shape": list(pv.shape),
                       "patches_sha256": hashlib.sha256(pv.astype("<f4").tobytes()).hexdigest(),
                       "tokens": grid[0] * grid[1] * grid[2] // 4})
        patches.append(pv)
        grids.append(grid)
    return images, patches, grids


def qwen_reference(make_model, model_dir: Path, preprocessor: dict):
    """The Qwen goldens' start, on the CPU (as the goldens are): `make_model()` writes the
    tiny model to `model_dir`, loaded back with mlx_vlm.utils.load_model (so mlx-vlm's
    sanitize runs on its Hugging Face layout); the test images through mlx-vlm's processor of
    `preprocessor` ([`qwen_images`]) and the tower on all of them in one call. Returns the
    model, the images' entries, patches and grids, and the tower's merged and deepstack
    features."""
    import mlx.core as mx
    from mlx_vlm.utils import load_model

    from gen_vision_preprocess import qwen_processor

    check_pins()
    mx.set_default_device(mx.cpu)
    make_model()
    model = load_model(model_dir)
    images, patches, grids = qwen_images(qwen_processor(preprocessor), QWEN_IMAGES)
    dtype = model.vision_tower.patch_embed.proj.weight.dtype
    feats, deep = model.vision_tower(mx.array(np.concatenate(patches)).astype(dtype), mx.array(grids))
    return model, images, patches, grids, feats, deep


def qwen_greedy_steps(model, logits, cache, steps: int):
    """`steps` greedy decode steps after a prompt's `logits` through `language_model(y, cache)`
    as mlx_vlm.generate's decode loop calls it: the ids (steps + 1) and each step's
    last-position logits."""
    import mlx.core as mx

    ids, step_logits = [], []
    y = mx.argmax(logits[:, -1, :], axis=-1)
    for _ in range(steps):
        ids.append(int(y.item()))
        out = model.language_model(y[None], cache=cache).logits
        step_logits.append(out[0, -1])
        y = mx.argmax(out[:, -1, :], axis=-1)
    ids.append(int(y.item()))
    return ids, step_logits


def qwen_prompt_run(model, ids: list[int], chosen: list[int], patches, grids, blobs: F32Blobs, steps: int) -> dict:
    """Prompt `ids` with the images `chosen` through `Model.__call__` with a fresh cache, then
    `steps` greedy decode steps ([`qwen_greedy_steps`]): the logits at every position (full
    vocab), the greedy ids and each step's logits, as golden entries."""
    import mlx.core as mx
    from mlx_vlm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model.language_model)
    pv = mx.array(np.concatenate([patches[i] for i in chosen]))
    logits = model(mx.array([ids]), pixel_values=pv, cache=cache,
                   image_grid_thw=mx.array([grids[i] for i in chosen])).logits
    mx.eval(logits)
    greedy, step_logits = qwen_greedy_steps(model, logits, cache, steps)
    return {"logits": blobs.put(logits[0]), "greedy": greedy, "step_logits": blobs.put(mx.stack(step_logits))}


def qwen_prompts(model, images: list[dict], patches, grids, leads, blobs: F32Blobs, steps: int) -> list[dict]:
    """The Qwen goldens' prompts, one per (chosen images, leading ids) of `leads`: the lead,
    then per image vision-start, its image tokens, vision-end and two text ids, then
    [8, 7, 500, 501]. Each one's ids, get_rope_index's M-RoPE positions and rope delta, its
    run ([`qwen_prompt_run`]) and mlx-vlm's own generate_step on it ([`qwen_generate_steps`])."""
    import mlx.core as mx

    prompts = []
    for chosen, lead in leads:
        ids = list(lead)
        for j, i in enumerate(chosen):
            ids += [QWEN_VSTART] + [QWEN_IMAGE] * images[i]["tokens"] + [QWEN_VEND] + [400 + j, 401 + j]
        ids += [8, 7, 500, 501]
        grid = mx.array([grids[i] for i in chosen])
        positions, deltas = model.language_model.get_rope_index(mx.array([ids]), grid, None, None)
        prompts.append({"images": chosen, "ids": ids, "rope_delta": int(deltas.reshape(-1)[0].item()),
                        "position_ids": np.asarray(positions).reshape(3, -1).tolist(),
                        **qwen_prompt_run(model, ids, chosen, patches, grids, blobs, steps)})
    qwen_generate_steps(model, prompts, patches, grids, blobs, steps)
    return prompts


def qwen_generate_steps(model, prompts: list[dict], patches, grids, blobs: F32Blobs, steps: int) -> None:
    """mlx_vlm's own decode loop (generate_step, greedy) on each prompt, recorded in its
    `generate`: the ids, each step's log-probabilities and the lengths the language model was
    called on (its prefill chunks)."""
    import mlx.core as mx
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
            gen = generate_step(mx.array([p["ids"]]), model, pv, None, max_tokens=steps + 1,
                                sampler=lambda lp: mx.argmax(lp, axis=-1),
                                image_grid_thw=mx.array([grids[i] for i in p["images"]]))
            ids, lps = [], []
            for tok, lp in gen:
                ids.append(int(tok))
                lps.append(lp)
        finally:
            lm_cls.__call__ = real_call
        p["generate"] = {"ids": ids, "logprobs": blobs.put(mx.stack(lps)), "calls": seen}
