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
        "tiny-gemma4-keqv": make_gemma4_keqv}


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
    make_gemma4_keqv(tok)
    make_gemma3_kv(tok)
    make_llama_draft(tok)
    for name in ["tiny-llama", "tiny-qwen3", "tiny-llama-trained", "tiny-gemma3", "tiny-qwen2",
                 "tiny-gemma4", "tiny-gemma4-keqv", "tiny-gemma3-kv", "tiny-llama-draft"]:
        d = golden_dir(f"models/{name}")
        size = sum(f.stat().st_size for f in d.iterdir())
        print(f"{d}: {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main(sys.argv[1:] or None)
