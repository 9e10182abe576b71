"""Tiny models for every RoPE kind mlx-lm's rope_utils accepts, and phi3.

    oracles/.venv/bin/python oracles/make_rope.py [NAME ...]   (its rows of goldens/models/manifest.json)
    (or oracles/.venv/bin/python oracles/make_models.py NAME: the same makers)

Writes goldens/models/<name>/ (config.json, model.safetensors, the shared tokenizer of
oracles/tinymodels.py, generation_config.json, provenance.json), random weights built by
mlx-lm's own model classes (mlx_lm.models.llama / gemma3_text / phi3), bf16:

- tiny-llama-dynamic   llama, rope_scaling {type: dynamic, factor 2}, max_position_embeddings 32:
                       the L1 prompts and their continuations run past 32 positions, where
                       DynamicNTKScalingRoPE's base starts to grow at every step
- tiny-llama-yarn      llama, rope_scaling {rope_type: yarn, factor 4, original 32, beta 32/1,
                       mscale 1, mscale_all_dim 0}: ramped frequencies and an mscale of 1.139
- tiny-phi3            phi3: fused qkv_proj / gate_up_proj, partial_rotary_factor 0.75,
                       rope_scaling {type: longrope, short/long factors}, max_position_embeddings
                       256 over original 32 (SuScaledRoPE's input scale sqrt(1 + ln 8 / ln 32))
- tiny-llama-rope-params
                       llama in transformers 5's layout: no rope_theta / rope_scaling at the top
                       level, rope_parameters {rope_type: yarn, factor 4, original 32, rope_theta
                       50000}
- tiny-gemma3-rope-params
                       gemma3_text in transformers 5's layout: rope_parameters per layer type
                       {full_attention: linear factor 4, theta 100000; sliding_attention: default,
                       theta 5000}

mlx-lm 0.32.2 ignores rope_parameters for llama, qwen2, gemma3_text and phi3 (their ModelArgs
have no such field); transformers reads it. The engine follows transformers, and the L1 golden
of such a model is mlx-lm run on the same config with the settings flattened to the top level
(`oracle_view`, which gen_l1.py loads through).
"""

import json
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import gemma3_text, llama, phi3

import tinymodels
from tinymodels import VOCAB, Job, gemma3_config, llama_config, random_model, weights_of, write_model

# The model types whose mlx-lm ModelArgs drop rope_parameters.
IGNORES_ROPE_PARAMETERS = {"llama", "mistral", "qwen2", "gemma3_text", "phi3"}


def flattened(cfg: dict) -> dict:
    """The config with transformers 5's rope_parameters moved to where mlx-lm reads them."""
    cfg = dict(cfg)
    params = cfg.pop("rope_parameters", None)
    if not params:
        return cfg
    if cfg["model_type"] == "gemma3_text":
        full, sliding = params["full_attention"], params["sliding_attention"]
        cfg.setdefault("rope_theta", full["rope_theta"])
        cfg.setdefault("rope_local_base_freq", sliding["rope_theta"])
        params = full
    else:
        cfg.setdefault("rope_theta", params["rope_theta"])
    if cfg["model_type"] == "phi3":
        for key in ("partial_rotary_factor", "original_max_position_embeddings"):
            if key in params:
                cfg.setdefault(key, params[key])
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") != "default" and cfg.get("rope_scaling") is None:
        scaling.setdefault("type", scaling["rope_type"])   # phi3 reads `type` only
        cfg["rope_scaling"] = scaling
    return cfg


def oracle_view(path: Path) -> Path:
    """The model dir mlx-lm should load: `path` itself, or, when its config carries
    rope_parameters that mlx-lm would ignore, a temporary copy (files linked) whose
    config.json has them flattened."""
    cfg = json.loads((path / "config.json").read_text())
    if "rope_parameters" not in cfg or cfg["model_type"] not in IGNORES_ROPE_PARAMETERS:
        return path
    view = Path(tempfile.mkdtemp(prefix=f"{path.name}-flat-"))
    for f in path.iterdir():
        if f.name != "config.json":
            (view / f.name).symlink_to(f.resolve())
    (view / "config.json").write_text(json.dumps(flattened(cfg), indent=1))
    return view


def save(job: Job, module, cfg: dict, notes: str, drop: tuple = ()) -> Path:
    """Random weights from mlx-lm's `module` built on the flattened config, saved with `cfg`
    as config.json."""
    model = random_model(module, flattened(cfg), job.seed, mx.bfloat16)
    return write_model(job, weights_of(model, drop), cfg,
                       f"oracles/make_rope.py: random weights (seed {job.seed}), bf16{notes}")


def small_llama(**over) -> dict:
    cfg = llama_config(64, 2, 4, 2, 192, None, tie=False)
    cfg.update(over)
    return cfg


def make_llama_dynamic(job: Job) -> Path:
    cfg = small_llama(max_position_embeddings=32, rope_scaling={"type": "dynamic", "factor": 2.0})
    return save(job, llama, cfg, "; dynamic NTK RoPE past 32 positions")


def make_llama_yarn(job: Job) -> Path:
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1, "mscale_all_dim": 0}
    cfg = small_llama(max_position_embeddings=128, rope_scaling=rope)
    return save(job, llama, cfg, "; yarn RoPE with mscale")


def make_llama_rope_params(job: Job) -> Path:
    cfg = small_llama(max_position_embeddings=128)
    del cfg["rope_theta"], cfg["rope_scaling"]
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 32, "rope_theta": 50000.0}
    return save(job, llama, cfg, "; transformers 5 rope_parameters only (mlx-lm ran it flattened to the top level)")


def make_gemma3_rope_params(job: Job) -> Path:
    cfg = gemma3_config()
    del cfg["rope_theta"], cfg["rope_local_base_freq"]
    cfg["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
    }
    return save(job, gemma3_text, cfg, ", tied (no lm_head); transformers 5 rope_parameters per layer type only "
                "(mlx-lm ran it flattened to the top level)", drop=("lm_head.weight",))


def make_phi3(job: Job) -> Path:
    rotated = int(16 * 0.75)
    cfg = {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
        "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 160,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB, "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "max_position_embeddings": 256, "original_max_position_embeddings": 32,
        "rope_scaling": {"type": "longrope",
                         "short_factor": [1.0 + 0.05 * i for i in range(rotated // 2)],
                         "long_factor": [1.0 + 0.75 * i for i in range(rotated // 2)]},
        "tie_word_embeddings": False,
    }
    return save(job, phi3, cfg, "; longrope, partial rotary 0.75, fused qkv / gate_up")


if __name__ == "__main__":
    tinymodels.main({"make_rope": sys.modules[__name__]})
