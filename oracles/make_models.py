"""Tiny deterministic model dirs in HF layout, for parity gates and tests.

    oracles/.venv/bin/python oracles/make_models.py

Writes goldens/models/<name>/ (or goldens/<machine-key>/models/<name>/ off the reference
machine) with config.json, model.safetensors, tokenizer.json,
tokenizer_config.json (with a chat template), generation_config.json and provenance.json:

- tiny-llama         llama, GQA (4 q / 2 kv heads), untied head, llama3 RoPE scaling, bf16
- tiny-qwen3         qwen3, q/k RMSNorm, explicit head_dim, tied embeddings, f32;
                     written with mlx-lm's own save_model/save_config
- tiny-llama-trained llama, trained here on oracles/corpus.txt (plain text + chat turns) so
                     that its greedy output is the text it learned, bf16
- tiny-gemma3        gemma3_text, sliding window 8 (rotating caches wrap), tied head, bf16

- tiny-qwen2         qwen2 (q/k/v biases), untied, float16
- tiny-gemma4        gemma4_text like the small Gemma 4s: per-layer input embeddings, KV sharing
                     (the last 3 of 6 layers reuse earlier layers' K/V), double-wide MLPs on
                     the sharing layers, proportional partial RoPE and a wider head on full
                     attention, sliding window 8, softcap 10, tied head, bf16
- tiny-gemma3-kv     tiny-gemma3 with head_dim 32 (quantizable KV: the L2 rotating-cache model)
- tiny-llama-draft   llama, 2 layers of width 64, trained like tiny-llama-trained (seed 11/7):
                     the speculative-decoding drafter for tiny-llama-trained (same tokenizer)
- tiny-gemma4-keqv   gemma4_text like the large Gemma 4s: K = V on full-attention layers with
                     their own KV head count, no per-layer inputs, no sharing, untied, bf16
- tiny-gemma4-assistant
                     a Gemma 4 "-assistant" drafter for tiny-gemma4 (optiq's
                     GemmaAssistantDrafter layout: config.json with text_config, HF tensor
                     names, no tokenizer): Q-only layers s s s f reading tiny-gemma4's donor
                     K/V, tied head, no centroid head; briefly distilled on tiny-gemma4's
                     greedy continuations of its L1 prompts so that some drafts are accepted,
                     bf16 (needs tiny-gemma4 and goldens/l1/tiny-gemma4)
- tiny-llama-dynamic, tiny-llama-yarn, tiny-phi3, tiny-llama-rope-params, tiny-gemma3-rope-params
                     the RoPE kinds (dynamic, yarn, longrope), phi3, and transformers 5's
                     rope_parameters-only configs: oracles/make_rope.py
- tiny-gemma3-mm, tiny-gemma4-mm, tiny-gemma4-mm-mlx
                     the multimodal wrappers gemma3 / gemma4 in their checkpoints' layouts:
                     oracles/make_wrappers.py
- tiny-qwen3-moe     qwen3_moe, 8 experts top-2, a dense layer among sparse ones, f32:
                     oracles/make_moe.py
- tiny-mixtral       mixtral, 8 experts top-2 (top-k logits, then softmax), f32:
                     oracles/make_moe.py
- tiny-qwen2-moe     qwen2_moe, 8 experts top-4 and a gated shared expert, f32:
                     oracles/make_moe.py
- tiny-gpt-oss, tiny-gpt-oss-mxfp4
                     gpt_oss (attention sinks, sliding/full layers with window 8, 8 experts
                     top-4 through the clamped SwiGLU, yarn RoPE), f32; and cast to bf16 with
                     mxfp4 experts and the rest affine 8-bit (mlx-community's MXFP4-Q8
                     layout): oracles/make_gpt_oss.py
- tiny-qwen3-tools   qwen3 trained to call a tool and to reason, in transformers 5's layout
                     (chat_template.jinja, two shards + index), its own tokenizer and chat
                     template: oracles/make_tools_model.py

`make_models.py tiny-gemma4 tiny-qwen2` writes only those (the tokenizer is retrained
deterministically; the other models are left as they are).

Everything is seeded. The tokenizer is a byte-level BPE (vocab 1024) trained on
oracles/corpus.txt with special tokens for bos/eos/padding and chat turns.
"""

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten
from mlx_lm.models import gemma3_text, gemma4_text, llama, qwen2, qwen3
from mlx_lm.utils import save_config, save_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from make_moe import make_mixtral, make_qwen2_moe, make_qwen3_moe
from make_tools_model import make_qwen3_tools
from provenance import golden_dir, provenance, write_json

HERE = Path(__file__).resolve().parent
CORPUS = (HERE / "corpus.txt").read_text()
VOCAB = 1024
SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
           "<|im_start|>", "<|im_end|>"]

# Llama-style turns: bos, then <|role|>\ncontent<|end|>\n per message.
LLAMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] | trim }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# ChatML-style turns (Qwen): no bos; a default system line when none is given.
QWEN_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful robot.<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qa_pairs():
    for line in CORPUS.splitlines():
        if line.startswith("Question:") and " Answer: " in line:
            q, a = line.removeprefix("Question: ").split(" Answer: ")
            yield q.strip(), a.strip()


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    return tok


def write_tokenizer(tok: Tokenizer, dest: Path, style: str) -> dict:
    tok = Tokenizer.from_str(tok.to_str())
    if style == "llama":
        bos = tok.token_to_id("<|bos|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)]
        )
        cfg = {"bos_token": "<|bos|>", "eos_token": "<|end|>", "chat_template": LLAMA_TEMPLATE}
        eos = ["<|end|>", "<|eos|>"]
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        cfg = {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": QWEN_TEMPLATE}
        eos = ["<|im_end|>", "<|eos|>"]
    tok.save(str(dest / "tokenizer.json"))
    write_json(dest / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": "<|pad|>",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        **cfg,
    })
    return {"eos_token_id": [tok.token_to_id(t) for t in eos],
            "bos_token_id": tok.token_to_id("<|bos|>") if style == "llama" else None}


def llama_config(hidden, layers, heads, kv_heads, inter, rope_scaling, tie) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "rope_theta": 500000.0 if rope_scaling else 10000.0, "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie, "attention_bias": False, "mlp_bias": False,
    }


def qwen3_config() -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 160,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "rope_theta": 1000000.0, "tie_word_embeddings": True,
    }


def finish_dir(dest: Path, config: dict, tok_info: dict, notes: str) -> None:
    write_json(dest / "generation_config.json", {
        "bos_token_id": tok_info["bos_token_id"], "eos_token_id": tok_info["eos_token_id"],
        "do_sample": False,
    })
    write_json(dest / "provenance.json", {"provenance": provenance("mlx-lm", "mlx-lm"),
                                          "generator": "oracles/make_models.py", "notes": notes})


def save_plain(dest: Path, model: nn.Module, config: dict) -> None:
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_json(dest / "config.json", config)


def random_model(module, config: dict, seed: int, dtype):
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def training_text(tok: Tokenizer) -> list[int]:
    bos, end = tok.token_to_id("<|bos|>"), tok.token_to_id("<|end|>")
    ids = []
    for paragraph in CORPUS.split("\n\n"):
        ids += [bos] + tok.encode(paragraph.strip()).ids + [end]
    chats = []
    for q, a in qa_pairs():
        chats.append(f"<|user|>\n{q}<|end|>\n<|assistant|>\n{a}<|end|>\n")
    for text in chats * 6:
        ids += [bos] + tok.encode(text).ids
    return ids


def train(model, ids: list[int], steps=600, seq=64, batch=16, seed=7):
    """Next-token training on random windows; deterministic given the seed."""
    mx.random.seed(seed)
    data = mx.array(ids)
    opt = optim.AdamW(learning_rate=optim.cosine_decay(3e-3, steps), weight_decay=0.01)

    def loss_fn(model, x, y):
        return nn.losses.cross_entropy(model(x), y, reduction="mean")

    step_fn = nn.value_and_grad(model, loss_fn)
    for step in range(steps):
        starts = mx.random.randint(0, len(ids) - seq - 1, (batch,))
        idx = starts[:, None] + mx.arange(seq + 1)[None]
        window = data[idx]
        loss, grads = step_fn(model, window[:, :-1], window[:, 1:])
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        if step % 100 == 0 or step == steps - 1:
            print(f"  step {step:4d}  loss {loss.item():.3f}", file=sys.stderr)
    return loss.item()


def gemma3_config() -> dict:
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 16,
        "sliding_window": 8, "sliding_window_pattern": 2,
    }


def make_gemma3(tok) -> None:
    """tiny-gemma3: gemma3_text with a sliding window of 8 (layers 0 and 2 slide through a
    rotating cache, layers 1 and 3 attend globally), tied head (no lm_head saved), bf16."""
    dest = golden_dir("models/tiny-gemma3")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    cfg = gemma3_config()
    model = random_model(gemma3_text, cfg, 4, mx.bfloat16)
    weights = {k: v for k, v in tree_flatten(model.parameters()) if k != "lm_head.weight"}
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_json(dest / "config.json", cfg)
    finish_dir(dest, cfg, write_tokenizer(tok, dest, "llama"), "random weights (seed 4), bf16, tied (no lm_head)")


def make_gemma3_kv(tok) -> None:
    """tiny-gemma3-kv: as tiny-gemma3 but with head_dim 32, so that MLX can quantize its
    caches (group sizes start at 32) — the L2 model for quantized rotating caches."""
    dest = golden_dir("models/tiny-gemma3-kv")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    cfg = dict(gemma3_config(), head_dim=32, query_pre_attn_scalar=32)
    model = random_model(gemma3_text, cfg, 9, mx.bfloat16)
    weights = {k: v for k, v in tree_flatten(model.parameters()) if k != "lm_head.weight"}
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_json(dest / "config.json", cfg)
    finish_dir(dest, cfg, write_tokenizer(tok, dest, "llama"), "random weights (seed 9), bf16, head_dim 32, tied")


def make_qwen2(tok) -> None:
    """tiny-qwen2: qwen2 (q/k/v biases, no o bias), GQA, untied head, float16."""
    dest = golden_dir("models/tiny-qwen2")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    cfg = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB, "max_position_embeddings": 4096, "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    }
    model = random_model(qwen2, cfg, 5, mx.float16)
    # nn.Linear initialises biases near zero; give them weight so a dropped bias shows.
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.bias = (mx.random.normal(proj.bias.shape, key=mx.random.key(11)) * 0.5).astype(mx.float16)
    save_plain(dest, model, cfg)
    finish_dir(dest, cfg, write_tokenizer(tok, dest, "qwen"), "random weights (seed 5), float16, q/k/v biases")


GEMMA4_ROPE = {
    "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
    "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0, "rope_type": "default"},
}


def gemma4_config(**over) -> dict:
    cfg = {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
        "hidden_size": 64, "num_hidden_layers": 6, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "global_head_dim": 32,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": 16, "num_kv_shared_layers": 3, "use_double_wide_mlp": True,
        "sliding_window": 8, "sliding_window_pattern": 3, "max_position_embeddings": 4096,
        "rope_parameters": GEMMA4_ROPE, "final_logit_softcapping": 10.0,
        "attention_k_eq_v": False, "enable_moe_block": False, "tie_word_embeddings": True,
    }
    cfg.update(over)
    # Spelled out, so every reader of config.json (mlx-lm, transformers, us) agrees.
    pattern = cfg["sliding_window_pattern"]
    cfg["layer_types"] = ["full_attention" if i % pattern == pattern - 1 else "sliding_attention"
                          for i in range(cfg["num_hidden_layers"])]
    return cfg


def randomize_scales(model, seed: int) -> None:
    """Norm weights and layer scalars initialise to ones; make them differ from one so a
    dropped or misplaced norm or scalar changes the logits."""
    params = tree_flatten(model.parameters())
    updates = []
    for i, (name, v) in enumerate(params):
        if name.endswith("norm.weight") or name.endswith("layer_scalar"):
            noise = mx.random.normal(v.shape, key=mx.random.key(seed * 1000 + i)) * 0.3
            updates.append((name, (1.0 + noise).astype(v.dtype)))
    model.load_weights(updates, strict=False)
    mx.eval(model.parameters())


def make_gemma4(tok) -> None:
    """tiny-gemma4: layers s s f | s s f with layers 3-5 reusing the K/V of layers 1 (sliding)
    and 2 (full); sliding window 8 so the rotating caches wrap."""
    dest = golden_dir("models/tiny-gemma4")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    cfg = gemma4_config()
    model = random_model(gemma4_text, cfg, 6, mx.bfloat16)
    randomize_scales(model, 16)
    save_plain(dest, model, cfg)
    finish_dir(dest, cfg, write_tokenizer(tok, dest, "llama"),
               "random weights (seed 6, norm/scalar noise seed 16), bf16, tied, KV sharing, per-layer inputs")


def make_gemma4_keqv(tok) -> None:
    """tiny-gemma4-keqv: layers s f s f; full layers project one K that is also V (2 KV heads
    on sliding layers, 1 on full ones); untied head."""
    dest = golden_dir("models/tiny-gemma4-keqv")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    cfg = gemma4_config(num_hidden_layers=4, sliding_window_pattern=2, num_key_value_heads=2,
                        num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=0,
                        hidden_size_per_layer_input=0, use_double_wide_mlp=False,
                        final_logit_softcapping=30.0, tie_word_embeddings=False)
    model = random_model(gemma4_text, cfg, 8, mx.bfloat16)
    randomize_scales(model, 18)
    save_plain(dest, model, cfg)
    finish_dir(dest, cfg, write_tokenizer(tok, dest, "llama"),
               "random weights (seed 8, norm/scalar noise seed 18), bf16, untied, K=V on full attention")


ASSISTANT_STEPS = 10           # distillation steps (one sequence each): few, so that drafts are
                               # accepted ~10-90% by case (~40% at gamma 2), not nearly always
ASSISTANT_CHAIN = 3            # draft steps unrolled per position (covers gamma <= 3)
ASSISTANT_CONTINUATION = 40    # greedy target tokens appended to each L1 prompt


def gemma4_assistant_config(target: dict) -> dict:
    """Gemma4AssistantConfig for a drafter of `target` (a gemma4_text config): the K/V head
    count and head dims must equal the target's, which the drafter's queries attend to."""
    return {
        "architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant",
        "backbone_hidden_size": target["hidden_size"],
        "use_ordered_embeddings": False, "num_centroids": 0, "centroid_intermediate_top_k": 0,
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "gemma4_text",
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": target["num_key_value_heads"],
            "head_dim": target["head_dim"], "global_head_dim": target["global_head_dim"],
            "rms_norm_eps": target["rms_norm_eps"],
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
            "sliding_window": target["sliding_window"],
            "max_position_embeddings": target["max_position_embeddings"],
            "vocab_size": target["vocab_size"], "rope_parameters": target["rope_parameters"],
            "num_kv_shared_layers": 4, "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0, "use_double_wide_mlp": False,
            "enable_moe_block": False, "tie_word_embeddings": True,
        },
    }


def assistant_traces(target, sequences: list[list[int]]):
    """Teacher-forced target passes (plain KVCaches, so every position's K/V is kept): per
    sequence the ids, the post-final-norm hidden states, the target's argmax at every
    position (uncapped head: the id optiq's verify pass compares a draft with) and the
    donor layers' K/V by layer type."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache
    from optiq.runtime.spec.kv_view import find_donor_layers

    sliding, full = find_donor_layers(target)
    f32 = lambda a: a.astype(mx.float32)
    out = []
    for ids in sequences:
        caches = [KVCache() for _ in make_prompt_cache(target)]
        hidden = target.model(mx.array([ids]), cache=caches)
        labels = mx.argmax(target.model.embed_tokens.as_linear(hidden)[0], axis=-1)
        kv = {kind: (f32(caches[i].keys[..., :len(ids), :]), f32(caches[i].values[..., :len(ids), :]))
              for kind, i in (("sliding_attention", sliding), ("full_attention", full))}
        mx.eval(hidden, labels, kv)
        out.append((ids, f32(hidden), labels, kv))
    return out


def assistant_chain(drafter, target, trace, depth: int):
    """The drafter's forward for every query position of one trace at once, unrolled `depth`
    draft steps, as optiq's loop chains them: step k of the draft for the token at position
    p reads token ids[p+k] (teacher-forced: a rejected draft is never chained on) through
    the target's scaled embedding, the target hidden at p-1 (k = 0) or the previous step's
    post_projection, and the donor K/V of positions before p only (the last window-1 of
    them on sliding layers), with its query at position p+k. Returns per step the logits
    [P, V] and the labels [P] (the target's argmax at p+k)."""
    ids, hidden, labels, kv = trace
    T, window = len(ids), drafter.cfg.sliding_window
    P = T - depth                                         # query positions p = 1 .. P
    p = mx.arange(1, P + 1)[:, None]
    j = mx.arange(T)[None]
    masks = {"full_attention": j < p, "sliding_attention": (j < p) & (j >= p - (window - 1))}
    emb = target.model.embed_tokens
    h_in = hidden[:, :P]
    steps = []
    for k in range(depth):
        tok = mx.array(ids[1 + k:P + 1 + k])[None]
        h = drafter.pre_projection(mx.concatenate([emb(tok) * target.model.embed_scale, h_in], axis=-1))
        for blk in drafter.layers:
            keys, values = kv[blk.layer_type]
            att = blk.self_attn
            q = att.q_proj(blk.input_layernorm(h)).reshape(1, P, att.n_heads, att.head_dim)
            q = att.rope(att.q_norm(q).transpose(0, 2, 1, 3), offset=1 + k)
            rep = att.n_heads // att.n_kv_heads
            o = mx.fast.scaled_dot_product_attention(
                q, mx.repeat(keys, rep, axis=1), mx.repeat(values, rep, axis=1),
                scale=att.scale, mask=masks[blk.layer_type])
            o = att.o_proj(o.transpose(0, 2, 1, 3).reshape(1, P, -1))
            h = h + blk.post_attention_layernorm(o)
            h = h + blk.post_feedforward_layernorm(blk.mlp(blk.pre_feedforward_layernorm(h)))
            h = h * blk.layer_scalar
        h = drafter.model_norm(h)
        steps.append((drafter.model_embed_tokens.as_linear(h)[0], labels[1 + k:P + 1 + k]))
        h_in = drafter.post_projection(h)
    return steps


def make_gemma4_assistant(tok) -> None:
    """tiny-gemma4-assistant: seeded weights (seed 22, norm/scalar noise seed 23) distilled in
    f32 (seed 24) on tiny-gemma4's greedy continuations of its L1 prompts, saved in bf16
    under the HF names optiq's GemmaAssistantDrafter.from_pretrained loads."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model
    from optiq.runtime.spec import GemmaAssistantDrafter
    from optiq.runtime.spec.drafters.gemma_assistant import GemmaAssistantConfig

    from provenance import resolve

    target_dir = resolve("models/tiny-gemma4")
    target, _ = load_model(target_dir)
    cfg = gemma4_assistant_config(json.loads((target_dir / "config.json").read_text()))
    dest = golden_dir("models/tiny-gemma4-assistant")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)

    mx.random.seed(22)
    drafter = GemmaAssistantDrafter(GemmaAssistantConfig.from_dict(cfg))
    drafter.set_dtype(mx.float32)
    randomize_scales(drafter, 23)

    l1 = json.loads((resolve("l1/tiny-gemma4") / "index.json").read_text())
    sequences = []
    for case in l1["cases"]:
        prompt = case["prompt_ids"]
        cont = [int(t) for (t, _), _ in zip(generate_step(mx.array(prompt), target,
                                                          max_tokens=ASSISTANT_CONTINUATION),
                                             range(ASSISTANT_CONTINUATION))]
        sequences.append(prompt + cont)
    traces = assistant_traces(target, sequences)

    # The batched chain is optiq's forward laid out over positions: check it on a few.
    from optiq.runtime.spec.runtime import _target_embed
    ids, hidden, _, kv = traces[0]
    logits0 = assistant_chain(drafter, target, traces[0], 1)[0][0]
    for pos in (1, 5, len(ids) - 2):
        first = max(0, pos - (drafter.cfg.sliding_window - 1))
        view = {"full_attention": tuple(a[..., :pos, :] for a in kv["full_attention"]),
                "sliding_attention": tuple(a[..., first:pos, :] for a in kv["sliding_attention"])}
        ref, _ = drafter.forward(last_token_emb=_target_embed(target, ids[pos]),
                                 target_hidden=hidden[:, pos - 1:pos], shared_kv=view, position=pos)
        assert mx.allclose(ref, logits0[pos - 1], atol=1e-4).item(), pos

    def loss_fn(model, trace):
        steps = assistant_chain(model, target, trace, ASSISTANT_CHAIN)
        return sum(nn.losses.cross_entropy(lg, lb, reduction="mean") for lg, lb in steps) / len(steps)

    mx.random.seed(24)
    opt = optim.Adam(learning_rate=3e-3)
    step_fn = nn.value_and_grad(drafter, loss_fn)
    order = mx.random.permutation(ASSISTANT_STEPS) % len(traces)
    for step in range(ASSISTANT_STEPS):
        loss, grads = step_fn(drafter, traces[order[step].item()])
        opt.update(drafter, grads)
        mx.eval(drafter.parameters(), opt.state, loss)
        if step % 5 == 0 or step == ASSISTANT_STEPS - 1:
            print(f"  step {step:4d}  loss {loss.item():.3f}", file=sys.stderr)

    drafter.set_dtype(mx.bfloat16)
    hf_names = {"model_embed_tokens.weight": "model.embed_tokens.weight", "model_norm.weight": "model.norm.weight"}
    weights = {hf_names.get(k, "model." + k if k.startswith("layers.") else k): v
               for k, v in tree_flatten(drafter.parameters())}
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_json(dest / "config.json", cfg)
    GemmaAssistantDrafter.from_pretrained(str(dest))      # loads, with nothing missing
    write_json(dest / "provenance.json", {
        "provenance": provenance("mlx-optiq", "mlx-optiq"), "generator": "oracles/make_models.py",
        "notes": f"drafter for models/tiny-gemma4: seeded weights (seed 22, norm/scalar noise seed 23), "
                 f"distilled {ASSISTANT_STEPS} Adam steps (3e-3, seed 24, f32, {ASSISTANT_CHAIN} chained "
                 f"draft steps) on tiny-gemma4's {ASSISTANT_CONTINUATION}-token greedy continuations of "
                 f"its L1 prompts (labels: the target's uncapped argmax), final loss {loss.item():.3f}, bf16"})


def make_llama_draft(tok) -> None:
    """A smaller model trained on the same text: drafts that tiny-llama-trained often accepts."""
    dest = golden_dir("models/tiny-llama-draft")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    cfg = llama_config(64, 2, 2, 1, 160, None, tie=True)
    model = random_model(llama, cfg, 11, mx.float32)
    final = train(model, training_text(tok))
    model.set_dtype(mx.bfloat16)
    save_plain(dest, model, cfg)
    finish_dir(dest, cfg, write_tokenizer(tok, dest, "llama"),
               f"drafter: trained 600 steps on oracles/corpus.txt (seed 11/7), final loss {final:.3f}, bf16")


ONLY = {"tiny-llama-draft": make_llama_draft, "tiny-gemma3": make_gemma3, "tiny-qwen2": make_qwen2, "tiny-gemma3-kv": make_gemma3_kv, "tiny-gemma4": make_gemma4,
        "tiny-gemma4-keqv": make_gemma4_keqv, "tiny-gemma4-assistant": make_gemma4_assistant,
        "tiny-qwen3-tools": make_qwen3_tools, "tiny-qwen3-moe": make_qwen3_moe,
        "tiny-mixtral": make_mixtral, "tiny-qwen2-moe": make_qwen2_moe}


def make_wrapper(name):
    """The multimodal wrappers (gemma3, gemma4) are made by oracles/make_wrappers.py, which
    imports this module: loaded when asked for."""
    def make(tok):
        import make_wrappers
        make_wrappers.ONLY[name](tok)
    return make


WRAPPERS = ("tiny-gemma3-mm", "tiny-gemma4-mm", "tiny-gemma4-mm-mlx")
ONLY.update({n: make_wrapper(n) for n in WRAPPERS})


def make_rope_model(name):
    """The RoPE-kind models and tiny-phi3 are made by oracles/make_rope.py, which imports
    this module: loaded when asked for."""
    def make(tok):
        import make_rope
        make_rope.ONLY[name](tok)
    return make


ROPE_MODELS = ("tiny-llama-dynamic", "tiny-llama-yarn", "tiny-phi3", "tiny-llama-rope-params",
               "tiny-gemma3-rope-params")
ONLY.update({n: make_rope_model(n) for n in ROPE_MODELS})


def make_gemma4_moe_model(name):
    """The Gemma 4 mixture-of-experts models are made by oracles/make_gemma4_moe.py, which
    imports this module: loaded when asked for."""
    def make(tok):
        import make_gemma4_moe
        make_gemma4_moe.ONLY[name](tok)
    return make


ONLY.update({n: make_gemma4_moe_model(n) for n in ("tiny-gemma4-moe", "tiny-gemma4-moe-q4")})


def make_assistant_variant(name):
    """The assistant drafter's head variants are made by oracles/make_assistants.py from
    tiny-gemma4-assistant: loaded when asked for."""
    def make(tok):
        import make_assistants
        make_assistants.ONLY[name](tok)
    return make


ONLY.update({n: make_assistant_variant(n) for n in ("tiny-gemma4-assistant-centroid",
                                                    "tiny-gemma4-assistant-lm-head",
                                                    "tiny-gemma4-assistant-no-lm-head")})


def make_gpt_oss_model(name):
    """The gpt-oss models are made by oracles/make_gpt_oss.py, which imports this module:
    loaded when asked for."""
    def make(tok):
        import make_gpt_oss
        make_gpt_oss.ONLY[name](tok)
    return make


ONLY.update({n: make_gpt_oss_model(n) for n in ("tiny-gpt-oss", "tiny-gpt-oss-mxfp4")})


def main(only=None) -> None:
    mx.set_default_device(mx.cpu)
    tok = train_tokenizer()
    if only:
        for name in only:
            ONLY[name](tok)
        return

    # tiny-llama: random, bf16, GQA, untied, llama3 rope scaling.
    dest = golden_dir("models/tiny-llama")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    cfg = llama_config(64, 2, 4, 2, 192, rope, tie=False)
    save_plain(dest, random_model(llama, cfg, 1, mx.bfloat16), cfg)
    finish_dir(dest, cfg, write_tokenizer(tok, dest, "llama"), "random weights (seed 1), bf16")

    # tiny-qwen3: random, f32, q/k norm, tied; saved by mlx-lm's own writers.
    dest = golden_dir("models/tiny-qwen3")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    cfg = qwen3_config()
    save_model(dest, random_model(qwen3, cfg, 2, mx.float32))
    save_config(dict(cfg), dest / "config.json")
    finish_dir(dest, cfg, write_tokenizer(tok, dest, "qwen"), "random weights (seed 2), f32, mlx_lm.utils.save_model")

    # tiny-llama-trained: f32 training on the corpus, saved in bf16.
    dest = golden_dir("models/tiny-llama-trained")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    cfg = llama_config(128, 3, 4, 2, 320, None, tie=False)
    model = random_model(llama, cfg, 3, mx.float32)
    final = train(model, training_text(tok))
    model.set_dtype(mx.bfloat16)
    save_plain(dest, model, cfg)
    finish_dir(dest, cfg, write_tokenizer(tok, dest, "llama"),
               f"trained 600 steps on oracles/corpus.txt (seed 3/7), final loss {final:.3f}, bf16")
    make_gemma3(tok)
    make_qwen2(tok)
    make_gemma4(tok)
    make_gemma4_assistant(tok)
    make_gemma4_keqv(tok)
    make_gemma3_kv(tok)
    make_llama_draft(tok)
    make_qwen3_tools(tok)
    make_qwen3_moe(tok)
    make_mixtral(tok)
    make_qwen2_moe(tok)
    for name in WRAPPERS:
        ONLY[name](tok)
    for name in ROPE_MODELS:
        ONLY[name](tok)
    for name in ("tiny-gpt-oss", "tiny-gpt-oss-mxfp4"):
        ONLY[name](tok)
    for name in ["tiny-llama", "tiny-qwen3", "tiny-llama-trained", "tiny-gemma3", "tiny-qwen2",
                 "tiny-gemma4", "tiny-gemma4-assistant", "tiny-gemma4-keqv", "tiny-gemma3-kv",
                 "tiny-llama-draft", "tiny-qwen3-moe", "tiny-mixtral",
                 "tiny-qwen2-moe"]:
        d = golden_dir(f"models/{name}")
        size = sum(f.stat().st_size for f in d.iterdir())
        print(f"{d}: {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main(sys.argv[1:] or None)
