"""A tiny gemma4 vision-language model and its goldens, as mlx-vlm computes them (issue 41, L1).

    /work/vision-venv/bin/python oracles/gen_vision_gemma4.py
    (the venv: oracles/requirements-vision.txt says how to make it)

Writes:
  goldens/models/tiny-gemma4-vl/   the model, made with mlx-vlm 0.7.10's own classes
      (mlx_vlm.models.gemma4: Model = VisionModel + MultimodalEmbedder (embed_vision) +
      LanguageModel; no audio), seeded random weights, bf16, saved as Hugging Face's
      google/gemma-4-* lays it out: `model.vision_tower.…`, `model.embed_vision.…`,
      `model.language_model.…` (mlx-vlm's Model.sanitize strips `model.` and puts the
      language model under `language_model.model.`), tied head. The vision tower uses
      clipped linears (finite random bounds, so the clamps bite) and standardization, both
      off by default, so that the gate sees them. processor_config.json is mlx-vlm's
      Gemma4ImageProcessor with a small budget (patch 4, 4 soft tokens, pooling 2: the
      preprocessing gate's "small" config). The tokenizer files are tiny-gemma4-mm's (the
      goldens hold token ids; the tokenizer is not exercised here).
  goldens/vision/gemma4-l1/gemma4-l1.json + tensors.bin
      per test image (goldens/vision/images, through mlx_vlm.utils.load_image and mlx-vlm's
      Gemma4ImageProcessor): the pixel tensor [1,3,h,w] f32, the tower's output
      ([1,n,32] bf16, pooled, scaled, standardized) and the embedded features
      (embed_vision, [1,n,64] bf16); per prompt (one image; two images of different sizes,
      which the processor hands on as a list and the tower runs one by one; the same image
      twice, which it stacks and runs as a batch): the ids, the merged input embeddings and
      per-layer inputs (as get_input_embeddings returns them), the logits of every prompt
      position over the full vocabulary (bf16), and 6 greedy ids from mlx-vlm's own
      generate_step.

Its row in goldens/models/manifest.json names this script (`gen_vision_gemma4:main`).

The logits are the language model run from get_input_embeddings' outputs with a fresh prompt
cache, no mask, and the processor's mm_token_type_ids (1 at image tokens), as generate_step runs
it for this config: text_config.use_bidirectional_attention is "vision" (as in Google's gemma-4
configs), so _make_masks builds boolean masks (causal, windowed on the sliding layers) OR'd
with "same image block" (each run of image tokens attends to all of itself), and
chunked_prefill_policy turns chunked prefill off for a prompt with images (one prefill call).
Decode steps (one token) take the caches' plain masks. The greedy ids of mlx-vlm's own
generate_step (given the same mm_token_type_ids) must equal the ones from these logits and
cache. The ids are built by hand in Gemma4Processor's shape (`boi`, n image tokens, `eoi` per
image) with this model's small ids.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODEL = REPO / "goldens" / "models" / "tiny-gemma4-vl"
OUT = REPO / "goldens" / "vision" / "gemma4-l1"
GENERATOR = "oracles/gen_vision_gemma4.py"
SEED = 78

IMAGE_TOKEN, BOI, EOI, AUDIO_TOKEN, PAD = 3, 1, 2, 4, 0
TEXT = {
    "model_type": "gemma4_text",
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "global_head_dim": 32,
    "rms_norm_eps": 1e-06,
    "vocab_size": 1024,
    "vocab_size_per_layer_input": 1024,
    "hidden_size_per_layer_input": 16,
    "num_kv_shared_layers": 3,
    "use_double_wide_mlp": True,
    "sliding_window": 8,
    "sliding_window_pattern": 3,
    "max_position_embeddings": 4096,
    "rope_parameters": {
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                           "rope_type": "proportional"},
        "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0,
                              "rope_type": "default"},
    },
    "final_logit_softcapping": 10.0,
    "attention_k_eq_v": False,
    "enable_moe_block": False,
    "tie_word_embeddings": True,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    # As Google's gemma-4 configs set it: image tokens attend to their whole image block.
    "use_bidirectional_attention": "vision",
}
VISION = {
    "model_type": "gemma4_vision",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-06,
    "patch_size": 4,
    "position_embedding_size": 16,
    "pooling_kernel_size": 2,
    "default_output_length": 4,
    "use_clipped_linears": True,
    "standardize": True,
    "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
}
CONFIG = {
    "architectures": ["Gemma4ForConditionalGeneration"],
    "model_type": "gemma4",
    "vocab_size": 1024,
    "image_token_id": IMAGE_TOKEN,
    "boi_token_id": BOI,
    "eoi_token_id": EOI,
    "audio_token_id": AUDIO_TOKEN,
    "vision_soft_tokens_per_image": 4,
    "text_config": TEXT,
    "vision_config": VISION,
    "audio_config": None,
}
# mlx-vlm's Gemma4ImageProcessor fields: the preprocessing gate's small budget.
IMAGE_PROCESSOR = {"patch_size": 4, "max_soft_tokens": 4, "pooling_kernel_size": 2}
PROCESSOR = {"processor_class": "Gemma4Processor", "image_seq_length": 4,
             "image_processor": {"image_processor_type": "Gemma4ImageProcessor", **IMAGE_PROCESSOR}}
IMAGES = ["rgb_64x64.png", "jpeg_orient6_48x32.jpg", "webp_rgba_33x25.webp"]


def image_run(n):
    return [BOI, *([IMAGE_TOKEN] * n), EOI]


GREEDY = 6


def drawn(name: str, p, noise):
    """A parameter's seeded random value from `noise` (a standard normal of its shape; the
    constructors leave norms at 1, the position table at ones, the clip bounds at ±inf):
    matrices keep mlx's init scale, norm weights and standardization get noise around their
    identity, clip bounds are finite."""
    import mlx.core as mx

    if name.endswith("position_embedding_table"):
        v = 0.5 * noise
    elif name.endswith(("input_min", "output_min")):
        v = mx.array(-1.5 + 0.1 * noise.item())
    elif name.endswith(("input_max", "output_max")):
        v = mx.array(1.5 + 0.1 * noise.item())
    elif name.endswith("std_bias"):
        v = 0.1 * noise
    elif p.ndim == 1:
        v = 1.0 + 0.1 * noise  # gemma4's norms use their weight directly; std_scale
    else:
        v = p
    return v


def main() -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import cache as vcache
    from mlx_vlm.models.gemma4 import config as g4config, gemma4
    from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4ImageProcessor
    from mlx_vlm.utils import load_image, load_model

    from provenance import TensorFile
    from vision_l1 import check_pins, gemma_greedy_ids, gemma_model, write_golden, write_tiny_model

    check_pins()

    # ---- the model, with mlx-vlm's classes, saved in Hugging Face's layout
    model = gemma_model(g4config, gemma4, CONFIG, SEED, drawn, audio_config=None)
    weights = {}
    for k, v in tree_flatten(model.parameters()):
        if k.startswith("language_model.model."):
            k = "model.language_model." + k[len("language_model.model."):]
        else:
            k = "model." + k
        weights[k] = v
    assert not any("lm_head" in k for k in weights), "gemma4's head is tied"
    write_tiny_model(MODEL, weights, "pt", {"config.json": CONFIG, "processor_config.json": PROCESSOR},
                     "tiny-gemma4-mm", GENERATOR,
                     f"mlx_vlm.models.gemma4.Model (no audio), random weights (seed {SEED}), bf16, tied; "
                     "Hugging Face's layout (model.vision_tower / model.embed_vision / "
                     "model.language_model); tokenizer files copied from tiny-gemma4-mm")

    # ---- the reference: the saved model as mlx-vlm loads it (sanitize included)
    model = load_model(MODEL)
    proc = Gemma4ImageProcessor(**IMAGE_PROCESSOR)
    tf = TensorFile()
    images, pixels, counts = [], [], []
    for name in IMAGES:
        img = load_image(str(REPO / "goldens" / "vision" / "images" / name))
        data, n_soft = proc([img])
        px = mx.array(np.asarray(data["pixel_values"]).astype(np.float32))
        tower = model.vision_tower(px)
        feats = model.embed_vision(tower)
        assert tower.shape[1] == n_soft[0], (name, tower.shape, n_soft)
        images.append({"file": f"images/{name}", "tokens": n_soft[0], "pixels": tf.add("pixels", px),
                       "tower": tf.add("tower", tower), "features": tf.add("features", feats)})
        pixels.append(px)
        counts.append(n_soft[0])

    prompt_specs = [
        ("one-image", [0], lambda r: [5, 108, 109, 110, *r[0], 111, 112, 113, 114, 115, 116, 117]),
        ("two-images", [1, 2], lambda r: [5, 120, *r[0], 121, 122, *r[1], 123, 124, 125, 126]),
        ("same-image-twice", [0, 0], lambda r: [5, 130, *r[0], 131, *r[1], 132, 133]),
    ]
    prompts = []
    for name, which, build in prompt_specs:
        ids = build([image_run(counts[i]) for i in which])
        input_ids = mx.array([ids])
        shapes = {pixels[i].shape for i in which}
        # As the processor hands them on: one stacked array when the shapes agree, else a list.
        if len(shapes) == 1:
            px = mx.concatenate([pixels[i] for i in which], axis=0)
        else:
            px = [pixels[i][0] for i in which]
        feats = model.get_input_embeddings(input_ids, px)
        emb, pli = feats.inputs_embeds, feats.per_layer_inputs
        mx.eval(emb, pli)
        lc = vcache.make_prompt_cache(model.language_model)
        types = mx.array([[1 if t == IMAGE_TOKEN else 0 for t in ids]])
        logits = model.language_model(input_ids, inputs_embeds=mx.array(emb), per_layer_inputs=pli,
                                      cache=lc, mm_token_type_ids=types).logits
        # The overlay is real here: without the types the logits differ.
        plain = model.language_model(input_ids, inputs_embeds=mx.array(emb), per_layer_inputs=pli,
                                     cache=vcache.make_prompt_cache(model.language_model)).logits
        assert bool(mx.any(plain != logits).item()), name

        gen = gemma_greedy_ids(model, logits, lc, GREEDY, name, input_ids, model, px, None,
                               mm_token_type_ids=types)
        prompts.append({"name": name, "ids": ids, "images": which, "embeddings": tf.add("embeddings", emb),
                        "per_layer_inputs": tf.add("per_layer_inputs", pli),
                        "logits": tf.add("logits", logits), "greedy": gen})

    reference = ("mlx_vlm.utils.load_model(goldens/models/tiny-gemma4-vl); Gemma4ImageProcessor -> "
                 "vision_tower(pixels NCHW f32) -> embed_vision -> get_input_embeddings -> "
                 "language_model(ids, inputs_embeds, per_layer_inputs, fresh prompt cache, mm_token_type_ids); greedy "
                 "ids from mlx_vlm.generate.ar.generate_step(temperature=0, mm_token_type_ids)")
    golden = {"model": "models/tiny-gemma4-vl", "image_processor": IMAGE_PROCESSOR,
              "tensors_bin": "tensors.bin", "images": images, "prompts": prompts}
    write_golden(OUT, "gemma4-l1.json", GENERATOR, reference, golden, b"".join(tf.chunks))
    print(f"{len(images)} images ({counts} soft tokens), {len(prompts)} prompts, tensors {tf.offset} bytes; "
          "greedy " + "; ".join(f"{p['name']}: {p['greedy']}" for p in prompts))


if __name__ == "__main__":
    main()
