"""Tiny mixture-of-experts models, made with mlx-lm's own classes.

    oracles/.venv/bin/python oracles/make_moe.py [NAME ...]   (its rows of goldens/models/manifest.json)
    (or through make_models.py: `make_models.py tiny-qwen3-moe`)

- tiny-qwen3-moe     qwen3_moe: 4 layers, 8 experts, top-2 (norm_topk_prob), layer 1 a dense
                     MLP (mlp_only_layers), untied head, f32 (MLX's CPU gather_mm runs float32
                     only: a bf16 dense MoE fails there, in mlx-lm as in the engine); the
                     router's weights are scaled up so that expert choices are decisive,
                     norms drawn away from one
- tiny-mixtral       mixtral: 2 layers, 8 experts, top-2 (top-k logits, then softmax), GQA,
                     untied head, f32, routers scaled up as above
- tiny-qwen2-moe     qwen2_moe: 2 layers, 8 experts, top-4 (softmax, then the top k unnormalized),
                     a sigmoid-gated shared expert, q/k/v biases, untied head, f32
- tiny-qwen3-moe-q4  tiny-qwen3-moe cast to bf16, then mlx_lm.utils.quantize_model, affine 4-bit g32:
                     the experts become QuantizedSwitchLinear (gather_qmm), the routers
                     8-bit g64 (qwen3_moe's own quant_predicate)

The tokenizer and chat template are tiny-qwen3's (tinymodels' shared tokenizer, "qwen" style;
tiny-mixtral's the "llama" style).
Everything is seeded. mlx-lm's SwitchGLU sorts the tokens by expert once the routing
indices have >= 64 entries (32 tokens at top-2): the longer L1 prompts take that path.
"""

import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import mixtral, qwen2_moe, qwen3_moe

import tinymodels
from tinymodels import VOCAB, Job, quantize, random_model, randomize_scales, weights_of, write_model


def qwen3_moe_config(vocab: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "decoder_sparse_step": 1, "mlp_only_layers": [1], "norm_topk_prob": True,
        "rms_norm_eps": 1e-6, "vocab_size": vocab, "max_position_embeddings": 4096,
        "rope_theta": 1000000.0, "tie_word_embeddings": False,
    }


def make_qwen3_moe(job: Job) -> Path:
    cfg = qwen3_moe_config(VOCAB)
    model = random_model(qwen3_moe, cfg, job.seed, mx.float32)
    randomize_scales(model, 31)
    # nn.Linear's init makes near-uniform router probabilities; widen them so that the
    # top-2 choice is clear (and a wrong choice shows in the logits).
    for layer in model.model.layers:
        if isinstance(layer.mlp, qwen3_moe.Qwen3MoeSparseMoeBlock):
            layer.mlp.gate.weight = layer.mlp.gate.weight * 8
    mx.eval(model.parameters())
    return write_model(job, weights_of(model), cfg,
                       f"random weights (seed {job.seed}, norm noise seed 31), f32, routers x8, untied", style="qwen")


def patch_gather_qmm() -> None:
    """mlx-lm 0.32.2's QuantizedSwitchLinear calls `mx.gather_qmm(..., global_scale=None)`,
    a keyword MLX 0.32.2's gather_qmm does not have (TypeError: quantized MoE cannot run in
    the pinned pair as shipped). Drop the keyword when it is None (no global scale: the
    affine call MLX 0.32.2 makes anyway); refuse any other value."""
    if getattr(mx.gather_qmm, "_drops_global_scale", False):
        return
    original = mx.gather_qmm

    def gather_qmm(*args, global_scale=None, **kwargs):
        if global_scale is not None:
            raise TypeError("MLX 0.32.2's gather_qmm has no global_scale")
        return original(*args, **kwargs)

    gather_qmm._drops_global_scale = True
    mx.gather_qmm = gather_qmm


def make_mixtral(job: Job) -> Path:
    cfg = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 32,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8,
        "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "vocab_size": VOCAB,
        "max_position_embeddings": 4096, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    }
    model = random_model(mixtral, cfg, job.seed, mx.float32)
    randomize_scales(model, 32)
    for layer in model.model.layers:
        layer.block_sparse_moe.gate.weight = layer.block_sparse_moe.gate.weight * 8
    mx.eval(model.parameters())
    return write_model(job, weights_of(model), cfg,
                       f"random weights (seed {job.seed}, norm noise seed 32), f32, routers x8, untied")


def make_qwen2_moe(job: Job) -> Path:
    cfg = {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
        "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
        "num_experts_per_tok": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "rope_theta": 1000000.0, "tie_word_embeddings": False,
    }
    model = random_model(qwen2_moe, cfg, job.seed, mx.float32)
    randomize_scales(model, 33)
    for layer in model.model.layers:
        layer.mlp.gate.weight = layer.mlp.gate.weight * 8
        layer.mlp.shared_expert_gate.weight = layer.mlp.shared_expert_gate.weight * 8
    mx.eval(model.parameters())
    return write_model(job, weights_of(model), cfg,
                       f"random weights (seed {job.seed}, norm noise seed 33), f32, routers and shared gates x8, "
                       "untied", style="qwen")


def make_qwen3_moe_q4(job: Job) -> Path:
    # Real MoE checkpoints are bf16: their scales and activations are.
    return quantize(job, "tiny-qwen3-moe",
                    "cast to bf16, affine 4-bit g32 via mlx_lm.utils.quantize_model (routers 8-bit g64 by qwen3_moe's "
                    "quant_predicate); its L1 golden needs make_moe.patch_gather_qmm on MLX 0.32.2",
                    "oracles/make_moe.py", 32, 4, dtype=mx.bfloat16)


if __name__ == "__main__":
    tinymodels.main({"make_moe": sys.modules[__name__]})
