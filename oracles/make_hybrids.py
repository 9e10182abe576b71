"""Tiny hybrid models (attention beside recurrent layers), made with mlx-lm's own classes.

    oracles/.venv/bin/python oracles/make_hybrids.py [NAME ...]   (its rows of goldens/models/manifest.json)
    (or through make_models.py: `make_models.py tiny-lfm2`)

- tiny-lfm2          lfm2: 4 layers, short convolutions (kernel 3, an ArraysCache state of the last
                     2 inputs) on layers 0, 1 and 3, full attention with q/k layernorms (GQA 4/2) on
                     layer 2; the SwiGLU width auto-adjusted (128 -> 96); conv weights saved in
                     Hugging Face's [hidden, 1, kernel] layout (mlx-lm's sanitize transposes them);
                     tied head, norms drawn away from one, bf16
- tiny-lfm2-conv-bias  tiny-lfm2 (another seed) with attention on layers 0 and 3, a conv bias,
                     kernel 4 and the SwiGLU width as given (no auto-adjust)

- tiny-granite-h      granitemoehybrid (Granite 4.0-H): layers mamba, attention, mamba, mamba (NoPE
                     attention, scale attention_multiplier), every feed-forward the sparse block (8
                     experts, top 2, softmax over the top logits) plus the shared MLP; Granite's
                     embedding / residual multipliers and logits scaling; experts saved fused as
                     Hugging Face does (`input_linear` [E, 2I, D], `output_linear`), [C, 1, K]
                     conv kernels, tied, f32, routers x8
- tiny-granite-h-dense  granitemoehybrid without experts (Granite 4.0-H-Micro's layout): the
                     `shared_mlp` (one `input_linear` [2I, D] whose halves are gate and up) is
                     the feed-forward, mlx-lm's sanitize reads it as `mlp`; RoPE attention
                     (theta nested in rope_parameters) on layer 2, Mamba-2 in 2 groups
                     elsewhere; untied, bf16
- tiny-lfm2-moe       lfm2_moe: tiny-lfm2's layers, layer 0's feed-forward dense (num_dense_layers 1), the
                     others LFM2's sparse block (8 experts, top 2 by sigmoid scores + expert_bias,
                     renormalized, routed_scaling_factor 1.5); saved in Hugging Face's layout
                     (w1/w3/w2, per-expert tensors, [C, 1, K] conv kernels), f32, gates x8
- tiny-lfm2-moe-mlx   lfm2_moe in MLX's layout (stacked switch_mlp, gate/up/down_proj names, [C, K, 1]
                     conv kernels): attention on layers 0 and 2, two dense layers (num_dense_layers
                     2), no expert_bias, the top k unnormalized, routed_scaling_factor absent
                     (mlx-lm's default 1), conv bias (drawn) and kernel 4, theta only in
                     rope_parameters; f32, gates x8
- tiny-qwen3-5        qwen3_5 (flat config): 4 layers, gated delta nets on layers 0-2 (2 key heads
                     repeated to 4 value heads, head dims 16, conv kernel 4, A_log kept in f32 as
                     real checkpoints keep it), gated full attention on layer 3 (GQA 4/2, q/k
                     norms, RoPE on a quarter of the head); saved in Hugging Face's layout
                     (`model.language_model.` names, [C, 1, K] conv kernels, (1 + w) norms stored
                     as w), so that mlx-lm's sanitize (and ours) takes the conversion path;
                     untied head, bf16

- tiny-qwen3-5-kv1    tiny-qwen3-5 with one K/V head in its attention layer (GQA 4/1), another seed:
                     two tensor-parallel ranks outnumber its K/V heads, so mlx-lm's qwen3_5 shard
                     repeats k_proj / v_proj's rows first (`repeat_kv_layer_inplace`)
- tiny-qwen3-5-mm     tiny-qwen3-5 as the multimodal checkpoint ships it: the text model's fields under
                     `text_config` (model_type qwen3_5_text) beside a `vision_config`, and a vision
                     tower tensor (`model.visual.…`) that both mlx-lm's sanitize and ours drop
- tiny-qwen3-5-moe    qwen3_5_moe: tiny-qwen3-5's layout with every MLP a Qwen3-Next sparse block (8
                     experts, top 2 renormalized, a shared expert behind a sigmoid gate; routers
                     and shared gates x8 so that choices are decisive), experts saved fused as
                     Hugging Face does (`experts.gate_up_proj`, `experts.down_proj`), f32 (MLX's
                     CPU gather_mm runs float32 only)
- tiny-qwen3-5-moe-mlx  qwen3_5_moe as mlx-community's checkpoints ship it: the text model under
                     `text_config`, its tensors under `language_model.` with the experts stacked
                     (switch_mlp), [C, K, 1] conv kernels and the norms holding their 1 (no
                     sanitize left to do); full_attention_interval 2 (delta net, attention, ...),
                     the top k unnormalized, half the head rotated, a shared expert of 16, tied, f32
- tiny-qwen3-next     qwen3_next: 4 layers (delta nets 0-2 with the fused in_proj_qkvz / in_proj_ba, gated
                     attention on 3), Qwen3-Next's sparse block on layers 0, 2, 3 (8 experts, top 2,
                     shared expert) and a dense MLP on layer 1 (mlp_only_layers), saved in Hugging
                     Face's per-expert layout with (1 + w) norms stored as w and [C, 1, K] conv
                     kernels, f32, routers and shared gates x8
- tiny-qwen3-next-mlx qwen3_next in MLX's layout (stacked experts, norms with their 1, [C, K, 1] conv
                     kernels: mlx-lm's sanitize leaves it as it is): the sparse block on layers 1
                     and 3 (decoder_sparse_step 2, no mlp_only_layers), attention on the same
                     layers (full_attention_interval 2) with q/k/v/o biases and half the head
                     rotated, 4 key heads and 4 value heads of 8 (key heads of 16), the top k
                     unnormalized, a shared expert of 16, tied, f32
- tiny-mamba2         mamba2 (pure SSM): 3 layers of Mamba-2 mixers, 8 heads of 16 in 2 groups
                     (B and C repeated to 4 heads each), state 16, conv kernel 4 with bias,
                     time_step_limit [0, Infinity] (written as Python's json writes it), HF
                     [C, 1, K] conv kernels, untied head, norms drawn away from one, bf16
- tiny-mamba2-tied    tiny-mamba2 (another seed) in one group, with in_proj/out_proj biases, no
                     conv bias, time_step_limit [0.001, 0.5] (dt clipped) and a tied head

- tiny-nemotron-h     nemotron_h: the pattern M*-M- (Mamba-2 mixers with Nemotron-H's grouped gated norm,
                     attention without positions, ReLU² MLPs), mamba 8 heads of 16 in 2 groups,
                     state 16, conv bias, no time_step_limit (mlx-lm's default (0, inf)), HF
                     [C, 1, K] conv kernels, A_log/dt_bias/D drawn, bf16
- tiny-nemotron-h-moe nemotron_h with Nemotron 3's mixture-of-experts blocks: the pattern ME*E- (tiny-nemotron-h's
                     blocks and `E`: a sigmoid router `gate` with `e_score_correction_bias`, 8 ReLU² experts
                     of 64, top 2 renormalized, routed_scaling_factor 2.5, one shared expert of 64); saved
                     in Hugging Face's layout (per-expert `experts.{e}.up_proj` / `down_proj`, [C, 1, K] conv
                     kernels), A_log and e_score_correction_bias in f32 as real checkpoints keep them,
                     the rest bf16. A source for `engine convert`'s gate; its bf16 expert stacks do not
                     run on MLX's CPU (gather_mm is float32 only, in mlx-lm as in the engine), so the
                     L1 gate runs the two below
- tiny-nemotron-h-moe-q4 tiny-nemotron-h-moe as mlx_lm.convert -q writes it (affine 4-bit g64, the experts
                     stacked into switch_mlp.fc1 / fc2 as mlx-community's checkpoints have them, the
                     routers and their bias unquantized): Nemotron 3 Nano's routing (n_group 1) in bf16
- tiny-nemotron-h-moe-grouped nemotron_h with `E` blocks as tiny-nemotron-h-moe, but f32 (dense experts
                     through gather_mm), the 8 experts in n_group 2 groups with topk_group 1 (the
                     lower-ranked group zeroed before the top 2: DeepSeek-V3's grouped selection) and
                     moe_latent_size 32 (fc1_latent_proj / fc2_latent_proj around the experts, as
                     Nemotron 3 Super); Hugging Face's per-expert layout
- tiny-falcon-h1      falcon_h1 (Falcon-H1): 4 layers, each attention (GQA 4/2, head 16, RoPE 10000)
                     and a Mamba-2 mixer (8 heads of 16 in 2 groups, state 16, conv kernel 4 with
                     bias, no gated norm: mamba_rms_norm false) run side by side on one normed
                     input, then a SwiGLU feed-forward; every µP multiplier away from one
                     (attention_in_multiplier 1.125, the rest mlx-lm's defaults), saved unfolded
                     in Hugging Face's layout ([C, 1, K] conv kernels) so that mlx-lm's sanitize
                     folds the multipliers into the weights; tied head, A_log/dt_bias/D drawn,
                     bf16
- tiny-falcon-h1-norm-after   tiny-falcon-h1 (another seed) with the mixer's gated RMSNorm over
                     all channels after the gate (mamba_rms_norm true, mamba_norm_before_gate
                     false) and an untied lm_head (its multiplier folded into it)
- tiny-falcon-h1-norm-before  the same norm before the gate (mamba_norm_before_gate true), tied

The tokenizer and chat template are tinymodels' shared ones ("llama" style; tiny-qwen3-5 "qwen").
Everything is seeded.
"""

import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import falcon_h1, granitemoehybrid, lfm2, lfm2_moe, mamba2, nemotron_h, qwen3_5, qwen3_5_moe, qwen3_next

import tinymodels
from tinymodels import VOCAB, Job, quantize, random_model, randomize_scales, weights_of, write_model


def lfm2_config() -> dict:
    return {
        "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2",
        "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3,
        "block_dim": 64, "block_ff_dim": 128, "block_multiple_of": 32,
        "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True,
        "rope_theta": 1000000.0,
        "layer_types": ["conv", "conv", "full_attention", "conv"],
        "tie_word_embeddings": True,
    }


def make_lfm2(job: Job) -> Path:
    return write_lfm2(job, lfm2_config())


def make_lfm2_conv_bias(job: Job) -> Path:
    cfg = dict(lfm2_config(), conv_bias=True, conv_L_cache=4, block_auto_adjust_ff_dim=False,
               layer_types=["full_attention", "conv", "conv", "full_attention"])
    return write_lfm2(job, cfg)


def write_lfm2(job: Job, cfg: dict) -> Path:
    model = random_model(lfm2, cfg, job.seed, mx.bfloat16)
    randomize_scales(model, job.seed)
    weights = weights_of(model)
    # Hugging Face's layout of a depthwise conv: [channels, 1, kernel].
    for name in list(weights):
        if name.endswith("conv.conv.weight"):
            weights[name] = weights[name].transpose(0, 2, 1)
    return write_model(job, weights, cfg,
                       f"random weights (seed {job.seed}), bf16, conv weights in HF layout, tied")


def granite_h_config() -> dict:
    return {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 4,
        "max_position_embeddings": 4096, "num_attention_heads": 4, "num_key_value_heads": 2,
        "attention_bias": False, "embedding_multiplier": 12.0, "attention_multiplier": 0.0078125,
        "logits_scaling": 8.0, "residual_multiplier": 0.22, "rms_norm_eps": 1e-5,
        "layer_types": ["mamba", "attention", "mamba", "mamba"], "num_local_experts": 8,
        "num_experts_per_tok": 2, "shared_intermediate_size": 64, "mamba_n_heads": 8, "mamba_d_head": 16,
        "mamba_proj_bias": False, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_n_groups": 1,
        "mamba_conv_bias": True, "position_embedding_type": "nope", "tie_word_embeddings": True,
    }


def make_granite_h(job: Job) -> Path:
    cfg = granite_h_config()
    model = random_model(granitemoehybrid, cfg, job.seed, mx.float32)
    randomize_scales(model, job.seed)
    for layer in model.layers:
        layer.block_sparse_moe.router.layer.weight = layer.block_sparse_moe.router.layer.weight * 8
    draw_ssm_parameters([l.mamba for l in model.layers if l.layer_type == "mamba"], job.seed)
    for l in model.layers:
        if l.layer_type == "mamba":
            l.mamba.dt_bias = l.mamba.dt_bias.astype(mx.float32)
            l.mamba.D = l.mamba.D.astype(mx.float32)
    mx.eval(model.parameters())
    weights = hf_conv_layout(weights_of(model))
    for name in [n for n in weights if n.endswith("switch_mlp.gate_proj.weight")]:
        prefix = name[: -len("switch_mlp.gate_proj.weight")]
        gate = weights.pop(name)
        up = weights.pop(prefix + "switch_mlp.up_proj.weight")
        weights[prefix + "input_linear.weight"] = mx.concatenate([gate, up], axis=1)
        weights[prefix + "output_linear.weight"] = weights.pop(prefix + "switch_mlp.down_proj.weight")
    return write_model(job, weights, cfg,
                       f"random weights (seed {job.seed}; A_log/dt_bias/D drawn), f32, routers x8, Hugging Face "
                       "fused experts, tied")


def make_granite_h_dense(job: Job) -> Path:
    """Granite 4.0-H's dense layout (no experts: `shared_mlp` is the feed-forward), RoPE
    positions with the theta nested in rope_parameters, bf16, untied."""
    cfg = dict(granite_h_config(), intermediate_size=96, layer_types=["mamba", "mamba", "attention", "mamba"],
               num_local_experts=0, mamba_n_groups=2, position_embedding_type="rope",
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
    for moe_only in ("num_experts_per_tok", "shared_intermediate_size"):
        cfg.pop(moe_only)
    model = random_model(granitemoehybrid, cfg, job.seed, mx.bfloat16)
    randomize_scales(model, job.seed)
    draw_ssm_parameters([l.mamba for l in model.layers if l.layer_type == "mamba"], job.seed)
    mx.eval(model.parameters())
    weights = hf_conv_layout(weights_of(model))
    for name in [n for n in weights if n.endswith(".mlp.gate_proj.weight")]:
        prefix = name[: -len("mlp.gate_proj.weight")]
        up = weights.pop(prefix + "mlp.up_proj.weight")
        weights[prefix + "shared_mlp.input_linear.weight"] = mx.concatenate([weights.pop(name), up], axis=0)
        weights[prefix + "shared_mlp.output_linear.weight"] = weights.pop(prefix + "mlp.down_proj.weight")
    return write_model(job, weights, cfg,
                       f"random weights (seed {job.seed}; A_log/dt_bias/D drawn), bf16, no experts (Hugging Face's "
                       "`shared_mlp` layout), RoPE, untied")


def lfm2_moe_config() -> dict:
    cfg = {k: v for k, v in lfm2_config().items() if not k.startswith("block_")}
    cfg.update({"architectures": ["Lfm2MoeForCausalLM"], "model_type": "lfm2_moe", "intermediate_size": 96,
                "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
                "use_expert_bias": True, "num_dense_layers": 1, "routed_scaling_factor": 1.5})
    return cfg


def random_lfm2_moe(cfg: dict, seed: int):
    """An f32 lfm2_moe of `cfg` drawn from `seed`, norms away from one, the routers x8 and
    (with use_expert_bias) the expert_bias drawn; a conv bias (nn.Conv1d starts it at zeros)
    drawn too."""
    model = random_model(lfm2_moe, cfg, seed, mx.float32)
    randomize_scales(model, seed)
    for i, layer in enumerate(model.layers):
        if cfg["conv_bias"] and not layer.is_attention_layer:
            conv = layer.conv.conv
            conv.bias = mx.random.normal(conv.bias.shape, key=mx.random.key(seed * 100 + 50 + i)) * 0.3
        ff = layer.feed_forward
        if isinstance(ff, lfm2_moe.Lfm2MoeSparseMoeBlock):
            ff.gate.weight = ff.gate.weight * 8
            if cfg["use_expert_bias"]:
                ff.expert_bias = mx.random.normal(ff.expert_bias.shape, key=mx.random.key(seed * 100 + i)) * 0.5
    mx.eval(model.parameters())
    return model


def make_lfm2_moe(job: Job) -> Path:
    cfg = lfm2_moe_config()
    hf = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    weights = {}
    for name, v in weights_of(random_lfm2_moe(cfg, job.seed)).items():
        if name.endswith("conv.conv.weight"):
            v = v.transpose(0, 2, 1)
        if ".switch_mlp." not in name:
            for ours, theirs in hf.items():
                if name.endswith(f"feed_forward.{ours}.weight"):
                    name = name.replace(f"feed_forward.{ours}.weight", f"feed_forward.{theirs}.weight")
        weights[name] = v
    return write_model(job, per_expert_layout(weights, hf), cfg,
                       f"random weights (seed {job.seed}; expert_bias drawn), f32, gates x8, Hugging Face layout, tied")


def make_lfm2_moe_mlx(job: Job) -> Path:
    cfg = dict(lfm2_moe_config(), norm_topk_prob=False, use_expert_bias=False, num_dense_layers=2,
               conv_bias=True, conv_L_cache=4, layer_types=["full_attention", "conv", "full_attention", "conv"],
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    for default in ("routed_scaling_factor", "rope_theta"):
        cfg.pop(default)
    return write_model(job, weights_of(random_lfm2_moe(cfg, job.seed)), cfg,
                       f"random weights (seed {job.seed}), f32, gates x8, no expert_bias, MLX's layout (stacked "
                       "switch_mlp, gate/up/down_proj names, [C, K, 1] conv kernels), tied")


def per_expert_layout(weights: dict, names: dict | None = None) -> dict:
    """Hugging Face's per-expert layout of stacked experts (what mlx-lm's sanitizes stack):
    each `<prefix>.switch_mlp.<proj>.weight` [E, ...] becomes E tensors
    `<prefix>.experts.<e>.<names[proj]>.weight` where it stood, the other tensors as they are."""
    out = {}
    for name, v in weights.items():
        if ".switch_mlp." not in name:
            out[name] = v
            continue
        prefix, proj = name.split(".switch_mlp.")
        proj = proj[: -len(".weight")]
        proj = (names or {}).get(proj, proj)
        for e in range(v.shape[0]):
            out[f"{prefix}.experts.{e}.{proj}.weight"] = v[e]
    return out


def qwen3_5_config() -> dict:
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "mrope_section": [11, 11, 10],
                            "rope_theta": 100000, "partial_rotary_factor": 0.25},
    }


# The (1 + w) norms Hugging Face's Qwen 3.5 checkpoints store as w (mlx-lm's sanitize adds the 1).
QWEN3_5_OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                        ".q_norm.weight", ".k_norm.weight")


def random_qwen3_5(cfg: dict, seed: int):
    """A bf16 qwen3_5 of `cfg` drawn from `seed`, norms away from one, A_log kept in f32 as
    real checkpoints keep it."""
    model = random_model(qwen3_5, cfg, seed, mx.bfloat16)
    randomize_scales(model, seed)
    for layer in model.layers:
        if layer.is_linear:
            layer.linear_attn.A_log = layer.linear_attn.A_log.astype(mx.float32)
    mx.eval(model.parameters())
    return model


def make_qwen3_5(job: Job) -> Path:
    cfg = qwen3_5_config()
    weights = hf_qwen3_5_weights(random_qwen3_5(cfg, job.seed))
    return write_model(job, weights, cfg,
                       f"random weights (seed {job.seed}), bf16 (A_log f32), Hugging Face layout, untied",
                       style="qwen")


def make_qwen3_5_kv1(job: Job) -> Path:
    cfg = dict(qwen3_5_config(), num_key_value_heads=1)
    weights = hf_qwen3_5_weights(random_qwen3_5(cfg, job.seed))
    return write_model(job, weights, cfg,
                       f"random weights (seed {job.seed}), bf16 (A_log f32), one K/V head, Hugging Face layout, untied",
                       style="qwen")


def make_qwen3_5_mm(job: Job) -> Path:
    text = dict(qwen3_5_config(), model_type="qwen3_5_text")
    text.pop("architectures")
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "text_config": text, "vision_config": {"depth": 1, "hidden_size": 32}, "tie_word_embeddings": False}
    weights = hf_qwen3_5_weights(random_qwen3_5(cfg, job.seed))
    weights["model.visual.blocks.0.attn.qkv.weight"] = mx.zeros((96, 32), dtype=mx.bfloat16)
    return write_model(job, weights, cfg,
                       f"random weights (seed {job.seed}), bf16 (A_log f32), Hugging Face multimodal layout "
                       "(text_config, a vision tensor to drop), untied", style="qwen")


def hf_qwen3_5_weights(model) -> dict:
    """tiny-qwen3-5's Hugging Face layout (see make_qwen3_5) of a qwen3_5 model's weights;
    SwitchGLU experts fused as `experts.gate_up_proj` (gate first) and `experts.down_proj`."""
    weights = {}
    for name, v in weights_of(model).items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name[len("language_model.model."):]
        elif name.startswith("language_model."):
            name = name[len("language_model."):]
        if name.endswith("conv1d.weight"):
            v = v.transpose(0, 2, 1)
        hf_name = name.replace("model.language_model.", "model.")
        if any(hf_name.endswith(sfx) for sfx in QWEN3_5_OFFSET_NORMS) and v.ndim == 1:
            v = v - 1.0
        weights[name] = v
    for name in [n for n in weights if n.endswith("switch_mlp.gate_proj.weight")]:
        prefix = name[: -len("switch_mlp.gate_proj.weight")]
        gate = weights.pop(name)
        up = weights.pop(prefix + "switch_mlp.up_proj.weight")
        weights[prefix + "experts.gate_up_proj"] = mx.concatenate([gate, up], axis=-2)
        weights[prefix + "experts.down_proj"] = weights.pop(prefix + "switch_mlp.down_proj.weight")
    return weights


def qwen3_5_moe_config() -> dict:
    return dict(qwen3_5_config(), architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe",
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=64, norm_topk_prob=True)


def random_qwen3_5_moe(cfg: dict, seed: int):
    """An f32 qwen3_5_moe of `cfg` drawn from `seed`, norms away from one, routers and shared
    gates x8 so that choices are decisive."""
    model = random_model(qwen3_5_moe, cfg, seed, mx.float32)
    randomize_scales(model, seed)
    for layer in model.layers:
        layer.mlp.gate.weight = layer.mlp.gate.weight * 8
        layer.mlp.shared_expert_gate.weight = layer.mlp.shared_expert_gate.weight * 8
    mx.eval(model.parameters())
    return model


def make_qwen3_5_moe(job: Job) -> Path:
    cfg = qwen3_5_moe_config()
    return write_model(job, hf_qwen3_5_weights(random_qwen3_5_moe(cfg, job.seed)), cfg,
                       f"random weights (seed {job.seed}), f32, routers and shared gates x8, Hugging Face layout "
                       "with fused experts, untied", style="qwen")


def make_qwen3_5_moe_mlx(job: Job) -> Path:
    text = dict(qwen3_5_moe_config(), model_type="qwen3_5_moe_text", full_attention_interval=2,
                norm_topk_prob=False, shared_expert_intermediate_size=16, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "mrope_section": [11, 11, 10], "rope_theta": 10000,
                                 "partial_rotary_factor": 0.5})
    text.pop("architectures")
    cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "text_config": text, "tie_word_embeddings": True}
    return write_model(job, weights_of(random_qwen3_5_moe(cfg, job.seed)), cfg,
                       f"random weights (seed {job.seed}), f32, routers and shared gates x8, mlx-community's "
                       "layout (language_model. names, stacked switch_mlp, norms with their 1, [C, K, 1] conv "
                       "kernels), text_config, tied", style="qwen")


def qwen3_next_config() -> dict:
    return {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [1],
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "norm_topk_prob": True,
        "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "full_attention_interval": 4,
        "tie_word_embeddings": False, "attention_bias": False,
    }


def random_qwen3_next(cfg: dict, seed: int):
    """An f32 qwen3_next of `cfg` drawn from `seed`, norms away from one, routers and shared
    gates x8."""
    model = random_model(qwen3_next, cfg, seed, mx.float32)
    randomize_scales(model, seed)
    for layer in model.layers:
        if isinstance(layer.mlp, qwen3_next.Qwen3NextSparseMoeBlock):
            layer.mlp.gate.weight = layer.mlp.gate.weight * 8
            layer.mlp.shared_expert_gate.weight = layer.mlp.shared_expert_gate.weight * 8
    mx.eval(model.parameters())
    return model


def make_qwen3_next(job: Job) -> Path:
    cfg = qwen3_next_config()
    weights = {}
    for name, v in weights_of(random_qwen3_next(cfg, job.seed)).items():
        if any(name.endswith(sfx) for sfx in QWEN3_5_OFFSET_NORMS) and v.ndim == 1:
            v = v - 1.0
        weights[name] = v
    return write_model(job, hf_conv_layout(per_expert_layout(weights)), cfg,
                       f"random weights (seed {job.seed}), f32, routers and shared gates x8, Hugging Face "
                       "per-expert layout, untied", style="qwen")


def make_qwen3_next_mlx(job: Job) -> Path:
    cfg = dict(qwen3_next_config(), linear_num_key_heads=4, linear_value_head_dim=8, decoder_sparse_step=2,
               mlp_only_layers=[], norm_topk_prob=False, partial_rotary_factor=0.5, full_attention_interval=2,
               tie_word_embeddings=True, attention_bias=True, shared_expert_intermediate_size=16)
    return write_model(job, weights_of(random_qwen3_next(cfg, job.seed)), cfg,
                       f"random weights (seed {job.seed}), f32, routers and shared gates x8, MLX's layout "
                       "(stacked switch_mlp, norms with their 1, [C, K, 1] conv kernels), tied", style="qwen")


def mamba2_config() -> dict:
    return {
        "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2",
        "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 3, "num_heads": 8, "head_dim": 16,
        "state_size": 16, "n_groups": 2, "conv_kernel": 4, "expand": 2, "intermediate_size": 128,
        "layer_norm_epsilon": 1e-6, "use_bias": False, "use_conv_bias": True, "tie_word_embeddings": False,
        "time_step_limit": [0.0, float("inf")], "time_step_rank": "auto", "max_position_embeddings": 4096,
    }


def make_mamba2(job: Job) -> Path:
    return write_mamba2(job, mamba2_config(), "untied")


def make_mamba2_tied(job: Job) -> Path:
    cfg = dict(mamba2_config(), n_groups=1, use_bias=True, use_conv_bias=False, tie_word_embeddings=True,
               time_step_limit=[0.001, 0.5])
    return write_mamba2(job, cfg, "one group, projection biases, no conv bias, dt clipped to [0.001, 0.5], tied")


def write_mamba2(job: Job, cfg: dict, what: str) -> Path:
    model = random_model(mamba2, cfg, job.seed, mx.bfloat16)
    randomize_scales(model, job.seed)
    draw_ssm_parameters([layer.mixer for layer in model.layers], job.seed)
    mx.eval(model.parameters())
    return write_model(job, hf_conv_layout(weights_of(model)), cfg,
                       f"random weights (seed {job.seed}; A_log f32, dt_bias and D drawn), bf16, HF conv layout, {what}")


def draw_ssm_parameters(mixers, seed: int) -> None:
    """mlx-lm initializes A_log, dt_bias and D to fixed values; draw them so that a head or
    a term mixed up shows in the logits (A_log kept in f32, as real checkpoints keep it)."""
    for i, m in enumerate(mixers):
        k1, k2, k3 = mx.random.split(mx.random.key(seed * 100 + i), 3)
        m.A_log = mx.log(mx.random.uniform(1, 16, m.A_log.shape, key=k1)).astype(mx.float32)
        m.dt_bias = (mx.random.normal(m.dt_bias.shape, key=k2) * 0.5 - 1.0).astype(mx.bfloat16)
        m.D = (1.0 + mx.random.normal(m.D.shape, key=k3) * 0.3).astype(mx.bfloat16)


def hf_conv_layout(weights: dict) -> dict:
    """Depthwise conv kernels in Hugging Face's [C, 1, K] layout."""
    return {k: (v.transpose(0, 2, 1) if k.endswith("conv1d.weight") else v) for k, v in weights.items()}


def nemotron_h_config() -> dict:
    return {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 4096,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "attention_bias": False,
        "mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_proj_bias": False, "ssm_state_size": 16,
        "conv_kernel": 4, "n_groups": 2, "mlp_bias": False, "layer_norm_epsilon": 1e-5, "use_bias": False,
        "use_conv_bias": True, "hybrid_override_pattern": "M*-M-", "tie_word_embeddings": False,
    }


def make_nemotron_h(job: Job) -> Path:
    cfg = nemotron_h_config()
    model = random_model(nemotron_h, cfg, job.seed, mx.bfloat16)
    randomize_scales(model, job.seed)
    draw_ssm_parameters([l.mixer for l in model.layers if l.block_type == "M"], job.seed)
    mx.eval(model.parameters())
    return write_model(job, hf_conv_layout(weights_of(model)), cfg,
                       f"random weights (seed {job.seed}; A_log f32, dt_bias and D drawn), bf16, HF conv layout")


def nemotron_h_moe_config(**over) -> dict:
    cfg = dict(nemotron_h_config(), hybrid_override_pattern="ME*E-", n_routed_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=64, moe_shared_expert_intermediate_size=64, n_shared_experts=1, n_group=1,
               topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5)
    return dict(cfg, **over)


def random_nemotron_h_moe(cfg: dict, seed: int, dtype):
    """A nemotron_h with `E` blocks of `cfg` drawn from `seed` in `dtype`: SSM parameters drawn, the
    routers (MoEGate starts at zeros) and their e_score_correction_bias drawn, the bias f32 as
    Nemotron 3 keeps it."""
    model = random_model(nemotron_h, cfg, seed, dtype)
    randomize_scales(model, seed)
    draw_ssm_parameters([l.mixer for l in model.layers if l.block_type == "M"], seed)
    for i, layer in enumerate(model.layers):
        if layer.block_type == "E":
            k1, k2 = mx.random.split(mx.random.key(seed * 100 + 50 + i))
            gate = layer.mixer.gate
            gate.weight = (mx.random.normal(gate.weight.shape, key=k1) * 0.5).astype(dtype)
            gate.e_score_correction_bias = mx.random.normal(gate.e_score_correction_bias.shape, key=k2) * 0.1
    mx.eval(model.parameters())
    return model


def hf_nemotron_h_moe_weights(model) -> dict:
    """The weights in Hugging Face's layout: per-expert `experts.{e}.up_proj` / `down_proj`
    (mlx-lm's sanitize stacks them into switch_mlp.fc1 / fc2), [C, 1, K] conv kernels."""
    return hf_conv_layout(per_expert_layout(weights_of(model), {"fc1": "up_proj", "fc2": "down_proj"}))


def make_nemotron_h_moe(job: Job) -> Path:
    cfg = nemotron_h_moe_config()
    model = random_nemotron_h_moe(cfg, job.seed, mx.bfloat16)
    return write_model(job, hf_nemotron_h_moe_weights(model), cfg,
                       f"random weights (seed {job.seed}; A_log f32, dt_bias and D drawn; router and "
                       "e_score_correction_bias drawn, the bias f32), bf16, Hugging Face per-expert and conv layout; "
                       "a convert source (its bf16 expert stacks do not run on MLX's CPU, in mlx-lm as in the "
                       "engine: the L1 gate runs tiny-nemotron-h-moe-q4, made from it)")


def make_nemotron_h_moe_q4(job: Job) -> Path:
    # mlx_lm.convert -q's defaults (affine 4-bit g64; nemotron_h has no quant_predicate, and its
    # MoEGate is no nn.Linear, so the routers stay bf16), no cast: what `engine convert -q` writes.
    return quantize(job, "tiny-nemotron-h-moe",
                    "tiny-nemotron-h-moe through mlx_lm.utils.quantize_model, affine 4-bit g64 as mlx_lm.convert -q "
                    "(experts stacked by mlx-lm's sanitize: mlx-community's layout; routers and "
                    "e_score_correction_bias unquantized); its L1 golden needs make_moe.patch_gather_qmm on MLX 0.32.2",
                    tinymodels.GENERATOR, 64, 4)


def make_nemotron_h_moe_grouped(job: Job) -> Path:
    cfg = nemotron_h_moe_config(n_group=2, topk_group=1, moe_latent_size=32)
    model = random_nemotron_h_moe(cfg, job.seed, mx.float32)
    return write_model(job, hf_nemotron_h_moe_weights(model), cfg,
                       f"random weights (seed {job.seed}; A_log, dt_bias and D drawn; router and "
                       "e_score_correction_bias drawn), f32, 8 experts in 2 groups (topk_group 1: the lower group "
                       "zeroed before the top 2), moe_latent_size 32 (fc1/fc2_latent_proj around the experts), "
                       "Hugging Face per-expert and conv layout")


def falcon_h1_config() -> dict:
    return {
        "architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1",
        "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "attention_bias": False,
        "mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 16,
        "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 128, "mamba_conv_bias": True,
        "mamba_proj_bias": False, "mamba_rms_norm": False, "mamba_norm_before_gate": False,
        "mlp_bias": False, "projectors_bias": False, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "rope_traditional": False, "max_position_embeddings": 4096, "tie_word_embeddings": True,
        "attention_in_multiplier": 1.125, "attention_out_multiplier": 0.9375, "key_multiplier": 0.390625,
        "embedding_multiplier": 5.656854249492381, "lm_head_multiplier": 0.0390625,
        "ssm_in_multiplier": 1.25, "ssm_out_multiplier": 0.23570226039551587,
        "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
        "mlp_multipliers": [0.8838834764831844, 0.5859375],
    }


def write_falcon_h1(job: Job, cfg: dict, what: str) -> Path:
    model = random_model(falcon_h1, cfg, job.seed, mx.bfloat16)
    randomize_scales(model, job.seed)
    draw_ssm_parameters([layer.mamba for layer in model.layers], job.seed)
    mx.eval(model.parameters())
    return write_model(job, hf_conv_layout(weights_of(model)), cfg,
                       f"random weights (seed {job.seed}; A_log f32, dt_bias and D drawn), bf16, unfolded "
                       f"multipliers and HF conv layout (mlx-lm's sanitize folds them), {what}")


def make_falcon_h1(job: Job) -> Path:
    return write_falcon_h1(job, falcon_h1_config(), "tied")


def make_falcon_h1_norm_after(job: Job) -> Path:
    cfg = dict(falcon_h1_config(), mamba_rms_norm=True, mamba_norm_before_gate=False, tie_word_embeddings=False)
    return write_falcon_h1(job, cfg, "the mixer's gated RMSNorm after the gate, untied head")


def make_falcon_h1_norm_before(job: Job) -> Path:
    cfg = dict(falcon_h1_config(), mamba_rms_norm=True, mamba_norm_before_gate=True)
    return write_falcon_h1(job, cfg, "the mixer's gated RMSNorm before the gate, tied")


if __name__ == "__main__":
    tinymodels.main({"make_hybrids": sys.modules[__name__]})
