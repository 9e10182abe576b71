"""A tiny gemma3 vision-language model and its goldens, as mlx-vlm computes them (issue 41, L1).

    /work/vision-venv/bin/python oracles/gen_vision_gemma3.py
    (the venv: oracles/requirements-vision.txt says how to make it)

Writes:
  goldens/models/tiny-gemma3-vl/   the model, made with mlx-vlm 0.7.10's own classes
      (mlx_vlm.models.gemma3: Model = VisionModel (SigLIP) + Gemma3MultiModalProjector +
      LanguageModel), seeded random weights, bf16, saved as google/gemma-3-*-it lays it out:
      `vision_tower.vision_model.…` (the patch conv in PyTorch's [out, in, kh, kw], which
      mlx-vlm's VisionModel.sanitize transposes), `multi_modal_projector.…`,
      `language_model.model.…`, tied head (no lm_head). preprocessor_config.json is the real
      checkpoint's but for its size (32x32, the tower's image_size). The tokenizer files are
      tiny-gemma3-mm's (the goldens hold token ids; the tokenizer is not exercised here).
  goldens/vision/gemma3-l1/gemma3-l1.json + tensors.bin
      per test image (goldens/vision/images, through mlx_vlm.utils.load_image and the real
      Gemma3ImageProcessorPil): the pixel tensor [1,3,32,32] f32, the tower's output
      (post_layernorm, [1,16,32] bf16) and the projected image features ([1,4,64] bf16);
      per prompt (one image, two images): the ids, the merged input embeddings (bf16, as
      get_input_embeddings returns them), the logits of every prompt position over the full
      vocabulary (bf16), and 6 greedy ids from mlx-vlm's own generate_step.

Its row in goldens/models/manifest.json names this script (`gen_vision_gemma3:main`): it needs
mlx-vlm, so oracles/make_models.py (the mlx-lm venv) does not make it; run this script instead.

The logits are the language model run from the merged embeddings with a fresh prompt cache
and no mask argument, as mlx-vlm's generate_step runs it (get_input_embeddings' 4-D mask is
handed on as `attention_mask_4d`, which gemma3's LanguageModel ignores: attention is causal,
windowed on the sliding layers). The ids are built by hand in Gemma3Processor's shape
(`<start_of_image>`, mm_tokens_per_image image tokens, `<end_of_image>`) with this model's
small ids; the two-image prompt holds a pad id (0), which mlx-vlm's merge zeroes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODEL = REPO / "goldens" / "models" / "tiny-gemma3-vl"
OUT = REPO / "goldens" / "vision" / "gemma3-l1"
GENERATOR = "oracles/gen_vision_gemma3.py"
SEED = 77

IMAGE_TOKEN, BOI, EOI, PAD = 3, 1, 2, 0
CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "vocab_size": 1024,
    # No top-level hidden_size, as in google/gemma-3-*-it: mlx-vlm's ModelConfig then keeps its
    # default 2048, and the image features are divided by sqrt(2048) before the merge.
    "image_token_index": IMAGE_TOKEN,
    "boi_token_index": BOI,
    "eoi_token_index": EOI,
    "mm_tokens_per_image": 4,
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-06,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 16,
        "sliding_window": 8,
        "sliding_window_pattern": 2,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "mm_tokens_per_image": 4,
    },
    "vision_config": {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "patch_size": 8,
        "image_size": 32,
        "layer_norm_eps": 1e-06,
        "vision_use_head": False,
    },
}
# google/gemma-3's preprocessor_config.json values, but for the size (the tower's 32x32).
sys.path.insert(0, str(HERE))
from gen_vision_preprocess import REAL  # noqa: E402

PREPROCESSOR = {**REAL, "size": {"height": 32, "width": 32}, "image_seq_length": 4}
IMAGES = ["rgb_64x64.png", "jpeg_orient6_48x32.jpg", "webp_rgba_33x25.webp"]


def image_run():
    return [BOI, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, EOI]


# (name, ids, images): 108 and up are ordinary text ids of the tiny vocabulary.
PROMPTS = [
    ("one-image", [5, 108, 109, 110, 111, *image_run(), 112, 113, 114, 115, 116, 117], [0]),
    ("two-images", [5, 120, *image_run(), 121, PAD, 122, *image_run(), 123, 124, 125, 126], [1, 2]),
]
GREEDY = 6


def drawn(name: str, p, noise):
    """A parameter's seeded random value from `noise` (a standard normal of its shape; the
    constructors leave norms at 1/0 and the projection at ones): matrices keep mlx's init
    scale, norms and biases get noise."""
    if name.endswith("mm_input_projection_weight"):
        v = noise * (p.shape[0] ** -0.5)
    elif p.ndim == 1 and ("layer_norm" in name or "post_layernorm" in name) and name.endswith("weight"):
        v = 1.0 + 0.1 * noise
    elif p.ndim == 1:
        v = 0.1 * noise  # biases, and gemma's (1 + w) RMSNorm weights
    else:
        v = p
    return v


def main() -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import cache as vcache
    from mlx_vlm.models.gemma3 import config as g3config, gemma3
    from mlx_vlm.utils import load_image, load_model

    from gen_vision_preprocess import reference_processor
    from provenance import TensorFile
    from vision_l1 import check_pins, gemma_greedy_ids, gemma_model, write_golden, write_tiny_model

    check_pins()

    # ---- the model, with mlx-vlm's classes, saved in Google's layout
    model = gemma_model(g3config, gemma3, CONFIG, SEED, drawn)
    weights = dict(tree_flatten(model.parameters()))
    weights.pop("language_model.lm_head.weight")  # tied, as the real checkpoints are
    conv = "vision_tower.vision_model.embeddings.patch_embedding.weight"
    weights[conv] = weights[conv].transpose(0, 3, 1, 2)  # PyTorch's [out, in, kh, kw]
    write_tiny_model(MODEL, weights, "mlx", {"config.json": CONFIG, "preprocessor_config.json": PREPROCESSOR},
                     "tiny-gemma3-mm", GENERATOR,
                     f"mlx_vlm.models.gemma3.Model, random weights (seed {SEED}), bf16, tied; Google's layout "
                     "(patch conv [out, in, kh, kw]); tokenizer files copied from tiny-gemma3-mm")

    # ---- the reference: the saved model as mlx-vlm loads it (sanitize included)
    model = load_model(MODEL)
    proc = reference_processor(PREPROCESSOR)
    tf = TensorFile()
    images = []
    pixels = []
    for name in IMAGES:
        img = load_image(str(REPO / "goldens" / "vision" / "images" / name))
        out = proc(images=[img])["pixel_values"]
        t = np.stack(out)[None] if isinstance(out, list) else np.asarray(out)
        px = mx.array(t.reshape(1, *t.shape[-3:]).astype(np.float32))
        dtype = model.language_model.model.embed_tokens.weight.dtype
        hidden, _, _ = model.vision_tower(px.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True)
        feats = model.multi_modal_projector(hidden)
        images.append({"file": f"images/{name}", "pixels": tf.add("pixels", px),
                       "tower": tf.add("tower", hidden), "features": tf.add("features", feats)})
        pixels.append(px)

    prompts = []
    for name, ids, which in PROMPTS:
        input_ids = mx.array([ids])
        px = mx.concatenate([pixels[i] for i in which], axis=0)
        mask = mx.ones_like(input_ids)
        emb = model.get_input_embeddings(input_ids, px, mask=mask).inputs_embeds
        mx.eval(emb)
        lc = vcache.make_prompt_cache(model.language_model)
        # A copy: Gemma3Model scales its inputs_embeds in place (`h *= ...`).
        logits = model.language_model(input_ids, inputs_embeds=mx.array(emb), cache=lc).logits

        gen = gemma_greedy_ids(model, logits, lc, GREEDY, name, input_ids, model, px, mask)
        prompts.append({"name": name, "ids": ids, "images": which, "embeddings": tf.add("embeddings", emb),
                        "logits": tf.add("logits", logits), "greedy": gen})

    reference = ("mlx_vlm.utils.load_model(goldens/models/tiny-gemma3-vl); vision_tower(pixels "
                 "NHWC, bf16) -> multi_modal_projector -> get_input_embeddings -> "
                 "language_model(ids, inputs_embeds, fresh prompt cache); greedy ids from "
                 "mlx_vlm.generate.ar.generate_step(temperature=0)")
    golden = {"model": "models/tiny-gemma3-vl", "preprocessor": PREPROCESSOR,
              "tensors_bin": "tensors.bin", "images": images, "prompts": prompts}
    write_golden(OUT, "gemma3-l1.json", GENERATOR, reference, golden, b"".join(tf.chunks))
    print(f"{len(images)} images, {len(prompts)} prompts, tensors {tf.offset} bytes; greedy "
          + "; ".join(f"{p['name']}: {p['greedy']}" for p in prompts))


if __name__ == "__main__":
    main()
