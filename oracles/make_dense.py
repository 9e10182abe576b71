"""Tiny dense decoders of the families added in batch one, made with mlx-lm's own classes.

    oracles/.venv/bin/python oracles/make_dense.py [NAME ...]   (its rows of goldens/models/manifest.json)
    (or through make_models.py: `make_models.py --only tiny-gemma2`)

- tiny-gemma2   gemma2: 4 layers, GQA 4/2, head 16, query_pre_attn_scalar 24 (not the head
                width), attention logits capped at 4 and final logits at 6 (tight enough that
                tanh bends them), (1 + w) sandwich norms drawn away from zero, tied, bf16
- tiny-olmo2    olmo2: 4 layers, post-norms only (post_attention / post_feedforward), q/k RMSNorms
                over the whole projection (GQA 4/2, head 16), q/k/v/o biases drawn, untied, bf16
- tiny-olmo3    olmo3: 4 layers by layer_types sliding, sliding, full, sliding (window 8: the
                rings wrap), linear RoPE scaling on the full layer only, tied, bf16
- tiny-seed-oss seed_oss: Llama's layers with head_dim 32 (not hidden / heads), q/k/v biases drawn
                and no o bias (attention_bias apart from attention_out_bias), untied, bf16
- tiny-exaone4  exaone4: post-norm layers, per-head q/k norms, sliding_window_pattern "LLG" over 4
                layers (L L G L: window 8, RoPE; G global without positions), tied, bf16
- tiny-hunyuan  hunyuan_v1_dense: per-head q/k norms after RoPE, DynamicNTKAlphaRoPE (alpha 1000),
                untied, bf16
- tiny-minicpm  minicpm: scale_emb 12, scale_depth 1.4 over 4 layers, dim_model_base 16 (logits
                divided by 4), saved without lm_head (mlx-lm's sanitize copies the embedding),
                bf16
- tiny-cohere2  cohere2: 4 layers, one LayerNorm per layer feeding attention and MLP side by side,
                sliding_window_pattern 2 (sliding with traditional RoPE, window 8 / global without
                positions), logit_scale 0.25, tied, float16 (mlx-lm's float32 attention cast)

The tokenizer and chat template are tinymodels' shared ones ("llama" style). Everything is seeded.
"""

import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import cohere2, exaone4, gemma2, hunyuan_v1_dense, minicpm, olmo2, olmo3, seed_oss

import tinymodels
from tinymodels import VOCAB, Job, random_model, randomize_scales, weights_of, write_model


def gemma2_config() -> dict:
    return {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
        "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "rope_theta": 10000.0, "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 4.0, "final_logit_softcapping": 6.0,
        # Read by transformers, ignored by mlx-lm 0.32.2's gemma2 (and so by the engine).
        "sliding_window": 8, "cache_implementation": "hybrid",
    }


def make_gemma2(job: Job) -> Path:
    cfg = gemma2_config()
    model = random_model(gemma2, cfg, job.seed, mx.bfloat16)
    randomize_scales(model, job.seed)
    return write_model(job, weights_of(model), cfg,
                       f"random weights (seed {job.seed}), bf16, softcaps 4 / 6, tied")


def olmo_config(model_type: str) -> dict:
    return {
        "architectures": ["Olmo2ForCausalLM" if model_type == "olmo2" else "Olmo3ForCausalLM"],
        "model_type": model_type, "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
        "max_position_embeddings": 4096, "rope_theta": 500000.0,
    }


def draw_biases(model, seed: int) -> None:
    """nn.Linear's biases start near zero: draw them so a dropped bias shows."""
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        for j, proj in enumerate((a.q_proj, a.k_proj, a.v_proj, a.o_proj)):
            key = mx.random.key(seed * 100 + i * 10 + j)
            proj.bias = (mx.random.normal(proj.bias.shape, key=key) * 0.5).astype(proj.bias.dtype)
    mx.eval(model.parameters())


def make_olmo2(job: Job) -> Path:
    cfg = dict(olmo_config("olmo2"), attention_bias=True, tie_word_embeddings=False)
    model = random_model(olmo2, cfg, job.seed, mx.bfloat16)
    randomize_scales(model, job.seed)
    draw_biases(model, job.seed)
    return write_model(job, weights_of(model), cfg,
                       f"random weights (seed {job.seed}), bf16, q/k/v/o biases, untied")


def make_olmo3(job: Job) -> Path:
    cfg = dict(olmo_config("olmo3"), sliding_window=8, tie_word_embeddings=True,
               layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
               rope_scaling={"rope_type": "linear", "factor": 2.0})
    model = random_model(olmo3, cfg, job.seed, mx.bfloat16)
    randomize_scales(model, job.seed)
    return write_model(job, weights_of(model), cfg, f"random weights (seed {job.seed}), bf16, window 8, tied")


def dense_config(arch: str, model_type: str, **over) -> dict:
    cfg = {
        "architectures": [arch], "model_type": model_type, "hidden_size": 64, "num_hidden_layers": 4,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB, "max_position_embeddings": 4096, "rope_theta": 10000.0,
    }
    cfg.update(over)
    return cfg


def make_seed_oss(job: Job) -> Path:
    cfg = dense_config("SeedOssForCausalLM", "seed_oss", head_dim=32, attention_bias=True,
                       attention_out_bias=False, tie_word_embeddings=False, rope_theta=1000000.0)
    model = random_model(seed_oss, cfg, job.seed, mx.bfloat16)
    randomize_scales(model, job.seed)
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        for j, proj in enumerate((a.q_proj, a.k_proj, a.v_proj)):
            key = mx.random.key(job.seed * 100 + i * 10 + j)
            proj.bias = (mx.random.normal(proj.bias.shape, key=key) * 0.5).astype(proj.bias.dtype)
    mx.eval(model.parameters())
    return write_model(job, weights_of(model), cfg,
                       f"random weights (seed {job.seed}), bf16, head_dim 32, q/k/v biases, untied")


def make_exaone4(job: Job) -> Path:
    cfg = dense_config("Exaone4ForCausalLM", "exaone4", head_dim=16, tie_word_embeddings=True,
                       rope_scaling=None, sliding_window=8, sliding_window_pattern="LLG",
                       # As EXAONE 4's checkpoints spell it out (transformers reads it; mlx-lm the pattern).
                       layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])
    model = random_model(exaone4, cfg, job.seed, mx.bfloat16)
    randomize_scales(model, job.seed)
    return write_model(job, weights_of(model), cfg,
                       f"random weights (seed {job.seed}), bf16, pattern LLG, window 8, tied")


def make_hunyuan(job: Job) -> Path:
    cfg = dense_config("HunYuanDenseV1ForCausalLM", "hunyuan_v1_dense", use_qk_norm=True,
                       rope_scaling={"alpha": 1000.0, "factor": 1.0, "type": "dynamic"},
                       tie_word_embeddings=False)
    model = random_model(hunyuan_v1_dense, cfg, job.seed, mx.bfloat16)
    randomize_scales(model, job.seed)
    return write_model(job, weights_of(model), cfg,
                       f"random weights (seed {job.seed}), bf16, alpha 1000, untied")


def make_minicpm(job: Job) -> Path:
    cfg = dense_config("MiniCPMForCausalLM", "minicpm", dim_model_base=16, scale_emb=12,
                       scale_depth=1.4, tie_word_embeddings=False)
    model = random_model(minicpm, cfg, job.seed, mx.bfloat16)
    randomize_scales(model, job.seed)
    return write_model(job, weights_of(model, drop=("lm_head.weight",)), cfg,
                       f"random weights (seed {job.seed}), bf16, no lm_head saved (the embedding is the head)")


def make_cohere2(job: Job) -> Path:
    cfg = dense_config("Cohere2ForCausalLM", "cohere2", head_dim=16, layer_norm_eps=1e-5, logit_scale=0.25,
                       attention_bias=False, layer_norm_bias=False, sliding_window=8, sliding_window_pattern=2,
                       layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=True)
    del cfg["rms_norm_eps"]
    model = random_model(cohere2, cfg, job.seed, mx.float16)
    randomize_scales(model, job.seed)
    return write_model(job, weights_of(model), cfg, f"random weights (seed {job.seed}), float16, window 8, tied")


if __name__ == "__main__":
    tinymodels.main({"make_dense": sys.modules[__name__]})
