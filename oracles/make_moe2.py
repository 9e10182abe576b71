"""More tiny mixture-of-experts models, made with mlx-lm 0.32.2's own classes.

    oracles/.venv/bin/python oracles/make_models.py --only NAME   (rows of goldens/models/manifest.json)

- tiny-glm4-moe   glm4_moe: 4 layers (layer 0 dense: first_k_dense_replace 1), 8 experts in 4
                  groups (topk_group 2: the two weakest groups zeroed before the top 2), the
                  router and e_score_correction_bias drawn (MoEGate starts at zeros), one
                  shared expert, routed_scaling_factor 2.5, q/k norms, q/k/v biases, half the
                  head rotated, f32; Hugging Face's per-expert layout and an MTP layer
                  (`model.layers.4.…`) that mlx-lm's sanitize drops
- tiny-ernie4-5-moe  ernie4_5_moe: 4 layers, the sparse block on layers 1 and 2
                  (moe_layer_start_index 1, moe_layer_end_index 2), 8 experts top 2 (softmax,
                  renormalized), one shared expert, traditional RoPE, tied head, f32; Hugging
                  Face's per-expert layout, plus MTP tensors and an e_score_correction_bias
                  that mlx-lm's sanitize drops
- tiny-minimax    minimax_m2 (mlx-lm's alias of minimax): 3 layers, 8 experts top 2, σ routing
                  with a drawn e_score_correction_bias, q/k RMSNorm over all heads at once,
                  rotary_dim 8 of head_dim 16, untied, f32; Hugging Face's per-expert w1/w2/w3
- tiny-llama4-text  llama4_text (mlx-lm's dense Llama 4 text stack): 4 layers, layer 3 NoPE
                  (no_rope_layers [1, 1, 1, 0]), weightless q/k RMSNorm, traditional RoPE, the
                  untied head named `output`, bf16
- tiny-phimoe     phimoe: 3 layers, LayerNorms (biases drawn), q/k/v/o and lm_head biases,
                  8 experts top 2 by sparsemixer (router_jitter_noise 0.1), SuScaledRoPE from
                  a longrope rope_scaling with long_mscale, f32; Hugging Face's per-expert w1/w2/w3
- tiny-llama4     llama4 (the multimodal wrapper, for text): 4 layers, chunked attention
                  (attention_chunk_size 8: the L1 prompts cross chunk boundaries; ChunkedKVCache
                  trims its front) on layers 0-2, layer 3 global NoPE with temperature tuning
                  (floor_scale 4 so the scale moves at these lengths), llama3 RoPE, q/k norms,
                  top-1 MoE with a shared expert on layers 1 and 3, f32; Hugging Face's layout
                  (`language_model.` names, fused experts.gate_up_proj, a vision tensor)

Everything is seeded; the tokenizer is the shared one ("qwen" style).
"""

from pathlib import Path

import mlx.core as mx
from mlx_lm.models import ernie4_5_moe, glm4_moe, llama4, llama4_text, minimax, phimoe

from make_hybrids import per_expert_layout
from tinymodels import VOCAB, Job, random_model, randomize_scales, weights_of, write_model


def glm4_moe_config() -> dict:
    return {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "max_position_embeddings": 4096, "norm_topk_prob": True, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
        "n_routed_experts": 8, "routed_scaling_factor": 2.5, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "num_hidden_layers": 4, "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "rope_scaling": None, "use_qk_norm": True,
        "tie_word_embeddings": False, "attention_bias": True, "partial_rotary_factor": 0.5,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    }


def draw_routers(gates: list, seed: int, dtype) -> None:
    """MoEGate's weight and e_score_correction_bias start at zeros: draw them (the bias f32,
    as the checkpoints keep it), the weights wide enough that the choice is decisive."""
    for i, gate in enumerate(gates):
        k1, k2 = mx.random.split(mx.random.key(seed * 100 + 50 + i))
        gate.weight = (mx.random.normal(gate.weight.shape, key=k1) * 0.5).astype(dtype)
        gate.e_score_correction_bias = mx.random.normal(gate.e_score_correction_bias.shape, key=k2) * 0.1


def mtp_layer(cfg: dict, seed: int) -> dict:
    """A few tensors of the multi-token prediction layer GLM-4.5 checkpoints carry after the
    last decoder layer (mlx-lm's sanitize drops every `model.layers.{num_hidden_layers}.…`)."""
    h, n = cfg["hidden_size"], cfg["num_hidden_layers"]
    key = mx.random.key(seed * 100 + 99)
    return {
        f"model.layers.{n}.eh_proj.weight": mx.random.normal((h, 2 * h), key=key),
        f"model.layers.{n}.enorm.weight": mx.ones((h,)),
        f"model.layers.{n}.mlp.experts.0.gate_proj.weight": mx.zeros((cfg["moe_intermediate_size"], h)),
    }


def make_glm4_moe(job: Job) -> Path:
    cfg = glm4_moe_config()
    model = random_model(glm4_moe, cfg, job.seed, mx.float32)
    randomize_scales(model, job.seed)
    draw_routers([l.mlp.gate for l in model.model.layers if isinstance(l.mlp, glm4_moe.MoE)], job.seed, mx.float32)
    mx.eval(model.parameters())
    weights = per_expert_layout(weights_of(model)) | mtp_layer(cfg, job.seed)
    return write_model(job, weights, cfg,
                       f"random weights (seed {job.seed}; routers and e_score_correction_bias drawn), f32, "
                       "8 experts in 4 groups (topk_group 2), a shared expert, first layer dense, partial "
                       "rotary 0.5, q/k norms and q/k/v biases; Hugging Face per-expert layout plus an MTP "
                       "layer that sanitize drops", style="qwen")


def ernie4_5_moe_config() -> dict:
    return {
        "architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe",
        "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 4096,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4, "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB, "rope_theta": 500000.0, "use_bias": False, "tie_word_embeddings": True,
        "moe_num_experts": 8, "moe_layer_start_index": 1, "moe_layer_end_index": 2,
        "moe_intermediate_size": 32, "moe_k": 2, "moe_layer_interval": 1, "moe_use_aux_free": True,
        "moe_num_shared_experts": 1, "moe_gate_act": "softmax",
    }


def make_ernie4_5_moe(job: Job) -> Path:
    cfg = ernie4_5_moe_config()
    model = random_model(ernie4_5_moe, cfg, job.seed, mx.float32)
    randomize_scales(model, job.seed)
    # nn.Linear's init makes near-uniform router probabilities: widen them so the choice shows.
    for layer in model.model.layers:
        if isinstance(layer.mlp, ernie4_5_moe.Ernie4_5_MoeMLP):
            layer.mlp.gate.weight = layer.mlp.gate.weight * 8
    mx.eval(model.parameters())
    key = mx.random.key(job.seed * 100 + 99)
    extra = {
        "model.mtp_block.0.input_layernorm.weight": mx.ones((64,)),
        "model.mtp_linear_proj.0.weight": mx.random.normal((64, 128), key=key),
        "model.layers.1.mlp.moe_statics.e_score_correction_bias": mx.zeros((1, 8)),
    }
    weights = per_expert_layout(weights_of(model)) | extra
    return write_model(job, weights, cfg,
                       f"random weights (seed {job.seed}), f32, routers x8, sparse on layers 1-2 of 4, a shared "
                       "expert, tied; Hugging Face per-expert layout plus MTP tensors and an "
                       "e_score_correction_bias that sanitize drops", style="qwen")


def minimax_config() -> dict:
    return {
        "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2",
        "hidden_size": 64, "intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 4096, "num_experts_per_tok": 2, "num_local_experts": 8,
        "shared_intermediate_size": 0, "num_hidden_layers": 3, "rms_norm_eps": 1e-6, "rope_theta": 5000000.0,
        "rotary_dim": 8, "vocab_size": VOCAB, "tie_word_embeddings": False, "scoring_func": "sigmoid",
        "use_qk_norm": True,
    }


def make_minimax(job: Job) -> Path:
    cfg = minimax_config()
    model = random_model(minimax, cfg, job.seed, mx.float32)
    randomize_scales(model, job.seed)
    for i, layer in enumerate(model.model.layers):
        moe = layer.block_sparse_moe
        moe.gate.weight = moe.gate.weight * 8
        key = mx.random.key(job.seed * 100 + 50 + i)
        moe.e_score_correction_bias = mx.random.normal(moe.e_score_correction_bias.shape, key=key) * 0.1
    mx.eval(model.parameters())
    weights = per_expert_layout(weights_of(model), {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"})
    return write_model(job, weights, cfg,
                       f"random weights (seed {job.seed}; routers x8, e_score_correction_bias drawn), f32, "
                       "minimax_m2 alias, q/k norms over all heads, rotary_dim 8 of 16; Hugging Face "
                       "per-expert w1/w2/w3 layout", style="qwen")


def llama4_text_config() -> dict:
    return {
        "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text",
        "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4, "vocab_size": VOCAB,
        "intermediate_size": 96, "intermediate_size_mlp": 128, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "head_dim": 16, "tie_word_embeddings": False, "no_rope_layers": [1, 1, 1, 0],
        "use_qk_norm": True, "max_position_embeddings": 4096,
    }


def make_llama4_text(job: Job) -> Path:
    cfg = llama4_text_config()
    model = random_model(llama4_text, cfg, job.seed, mx.bfloat16)
    randomize_scales(model, job.seed)
    return write_model(job, weights_of(model), cfg,
                       f"random weights (seed {job.seed}), bf16, layer 3 NoPE, weightless q/k norms, "
                       "untied `output` head", style="qwen")


def phimoe_config() -> dict:
    return {
        "architectures": ["PhiMoEForCausalLM"], "model_type": "phimoe",
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "num_local_experts": 8,
        "num_experts_per_tok": 2, "rope_theta": 10000.0, "router_jitter_noise": 0.1,
        "rope_scaling": {
            "type": "longrope", "short_mscale": 1.243163121016122, "long_mscale": 1.243163121016122,
            "short_factor": [1.0, 1.05, 1.1, 1.2, 1.4, 1.7, 2.1, 2.6],
            "long_factor": [1.0, 1.1, 1.3, 1.7, 2.5, 4.0, 6.5, 10.0],
        },
        "tie_word_embeddings": False,
    }


def make_phimoe(job: Job) -> Path:
    cfg = phimoe_config()
    model = random_model(phimoe, cfg, job.seed, mx.float32)
    randomize_scales(model, job.seed)
    # LayerNorm biases start at zeros: draw them so a dropped bias shows.
    norms = [l.input_layernorm for l in model.model.layers] + [l.post_attention_layernorm for l in model.model.layers]
    for i, norm in enumerate(norms + [model.model.norm]):
        norm.bias = mx.random.normal(norm.bias.shape, key=mx.random.key(job.seed * 100 + i)) * 0.1
    for layer in model.model.layers:
        layer.block_sparse_moe.gate.weight = layer.block_sparse_moe.gate.weight * 8
    mx.eval(model.parameters())
    weights = per_expert_layout(weights_of(model), {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"})
    return write_model(job, weights, cfg,
                       f"random weights (seed {job.seed}; LayerNorm biases drawn, routers x8), f32, "
                       "sparsemixer with jitter 0.1, longrope with long_mscale; Hugging Face per-expert "
                       "w1/w2/w3 layout", style="qwen")


def llama4_config() -> dict:
    return {
        "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
        "text_config": {
            "model_type": "llama4_text", "attention_bias": False, "attention_chunk_size": 8, "head_dim": 16,
            "hidden_size": 64, "interleave_moe_layer_step": 2, "intermediate_size": 32,
            "intermediate_size_mlp": 128, "max_position_embeddings": 4096, "num_attention_heads": 4,
            "num_experts_per_tok": 1, "num_hidden_layers": 4, "num_key_value_heads": 2,
            "num_local_experts": 4, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "use_qk_norm": True,
            "vocab_size": VOCAB, "attn_temperature_tuning": True, "floor_scale": 4, "attn_scale": 0.1,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        },
        "tie_word_embeddings": False,
    }


def hf_llama4_weights(model) -> dict:
    """Hugging Face's Llama 4 layout of the stacked experts mlx-lm's sanitize makes: one
    `experts.gate_up_proj` [E, D, 2I] (gate then up, transposed) and `experts.down_proj`
    [E, I, D]; plus a vision tensor the sanitize drops."""
    out = {}
    for name, v in weights_of(model).items():
        if ".experts.gate_proj." in name:
            up = weights_of(model)[name.replace("gate_proj", "up_proj")]
            fused = mx.concatenate([v.swapaxes(1, 2), up.swapaxes(1, 2)], axis=-1)
            out[name.replace("gate_proj.weight", "gate_up_proj")] = fused
        elif ".experts.down_proj." in name:
            out[name.replace("down_proj.weight", "down_proj")] = v.swapaxes(1, 2)
        elif ".experts.up_proj." not in name:
            out[name] = v
    out["vision_model.patch_embedding.linear.weight"] = mx.zeros((8, 12))
    return out


def make_llama4(job: Job) -> Path:
    cfg = llama4_config()
    model = random_model(llama4, cfg, job.seed, mx.float32)
    randomize_scales(model, job.seed)
    for layer in model.language_model.model.layers:
        if layer.is_moe_layer:
            layer.feed_forward.router.weight = layer.feed_forward.router.weight * 8
    mx.eval(model.parameters())
    return write_model(job, hf_llama4_weights(model), cfg,
                       f"random weights (seed {job.seed}; routers x8), f32, chunk 8, floor_scale 4, llama3 "
                       "RoPE, top-1 MoE on layers 1 and 3; Hugging Face layout (fused experts, "
                       "language_model. names, a vision tensor)", style="qwen")
