"""Tiny mixture-of-experts models, made with mlx-lm's own classes.

    oracles/.venv/bin/python oracles/make_moe.py [NAME ...]
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

The tokenizer and chat template are tiny-qwen3's (make_models.train_tokenizer, "qwen" style).
Everything is seeded. mlx-lm's SwitchGLU sorts the tokens by expert once the routing
indices have >= 64 entries (32 tokens at top-2): the longer L1 prompts take that path.
"""

import shutil
import sys

import mlx.core as mx
from mlx_lm.models import mixtral, qwen2_moe, qwen3_moe

from provenance import golden_dir, provenance, resolve, write_json


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


def make_qwen3_moe(tok) -> None:
    # make_models imports this module for its name dispatch; import its helpers late.
    from make_models import VOCAB, finish_dir, random_model, randomize_scales, save_plain, write_tokenizer

    dest = golden_dir("models/tiny-qwen3-moe")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    cfg = qwen3_moe_config(VOCAB)
    model = random_model(qwen3_moe, cfg, 21, mx.float32)
    randomize_scales(model, 31)
    # nn.Linear's init makes near-uniform router probabilities; widen them so that the
    # top-2 choice is clear (and a wrong choice shows in the logits).
    for layer in model.model.layers:
        if isinstance(layer.mlp, qwen3_moe.Qwen3MoeSparseMoeBlock):
            layer.mlp.gate.weight = layer.mlp.gate.weight * 8
    mx.eval(model.parameters())
    save_plain(dest, model, cfg)
    finish_dir(dest, cfg, write_tokenizer(tok, dest, "qwen"),
               "random weights (seed 21, norm noise seed 31), f32, routers x8, untied")
    size = sum(f.stat().st_size for f in dest.iterdir())
    print(f"{dest}: {size / 1e6:.2f} MB")


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


def make_mixtral(tok) -> None:
    from make_models import VOCAB, finish_dir, random_model, randomize_scales, save_plain, write_tokenizer

    dest = golden_dir("models/tiny-mixtral")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    cfg = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 32,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8,
        "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "vocab_size": VOCAB,
        "max_position_embeddings": 4096, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    }
    model = random_model(mixtral, cfg, 22, mx.float32)
    randomize_scales(model, 32)
    for layer in model.model.layers:
        layer.block_sparse_moe.gate.weight = layer.block_sparse_moe.gate.weight * 8
    mx.eval(model.parameters())
    save_plain(dest, model, cfg)
    finish_dir(dest, cfg, write_tokenizer(tok, dest, "llama"),
               "random weights (seed 22, norm noise seed 32), f32, routers x8, untied")
    size = sum(f.stat().st_size for f in dest.iterdir())
    print(f"{dest}: {size / 1e6:.2f} MB")


def make_qwen2_moe(tok) -> None:
    from make_models import VOCAB, finish_dir, random_model, randomize_scales, save_plain, write_tokenizer

    dest = golden_dir("models/tiny-qwen2-moe")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    cfg = {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
        "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
        "num_experts_per_tok": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "rope_theta": 1000000.0, "tie_word_embeddings": False,
    }
    model = random_model(qwen2_moe, cfg, 23, mx.float32)
    randomize_scales(model, 33)
    for layer in model.model.layers:
        layer.mlp.gate.weight = layer.mlp.gate.weight * 8
        layer.mlp.shared_expert_gate.weight = layer.mlp.shared_expert_gate.weight * 8
    mx.eval(model.parameters())
    save_plain(dest, model, cfg)
    finish_dir(dest, cfg, write_tokenizer(tok, dest, "qwen"),
               "random weights (seed 23, norm noise seed 33), f32, routers and shared gates x8, untied")
    size = sum(f.stat().st_size for f in dest.iterdir())
    print(f"{dest}: {size / 1e6:.2f} MB")


TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]


def make_qwen3_moe_q4(_tok=None) -> None:
    from mlx_lm import load
    from mlx_lm.utils import quantize_model, save_config, save_model

    src = resolve("models/tiny-qwen3-moe")
    model, _, config = load(str(src), return_config=True)
    # Real MoE checkpoints are bf16: their scales and activations are.
    model.set_dtype(mx.bfloat16)
    model, qconfig = quantize_model(model, config, 32, 4)
    dest = golden_dir("models/tiny-qwen3-moe-q4")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    save_model(dest, model)
    save_config(qconfig, dest / "config.json")
    for f in TOKENIZER_FILES:
        shutil.copy(src / f, dest / f)
    write_json(dest / "provenance.json", {
        "provenance": provenance("mlx-lm", "mlx-lm"), "generator": "oracles/make_moe.py",
        "notes": "cast to bf16, affine 4-bit g32 via mlx_lm.utils.quantize_model (routers 8-bit g64 by qwen3_moe's "
                 "quant_predicate); its L1 golden needs make_moe.patch_gather_qmm on MLX 0.32.2"})
    size = sum(f.stat().st_size for f in dest.iterdir())
    print(f"{dest}: {size / 1e6:.2f} MB")


ONLY = {"tiny-qwen3-moe": make_qwen3_moe, "tiny-mixtral": make_mixtral, "tiny-qwen2-moe": make_qwen2_moe,
        "tiny-qwen3-moe-q4": make_qwen3_moe_q4}


def main(only=None) -> None:
    mx.set_default_device(mx.cpu)
    names = only or list(ONLY)
    tok = None
    if any(n != "tiny-qwen3-moe-q4" for n in names):
        from make_models import train_tokenizer
        tok = train_tokenizer()
    for name in names:
        ONLY[name](tok)


if __name__ == "__main__":
    main(sys.argv[1:] or None)
