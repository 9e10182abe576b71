"""Tiny deterministic model dirs in HF layout, for parity gates and tests, and the one CLI that
makes every tiny model goldens/models/manifest.json lists (oracles/tinymodels.py has the rest).

    oracles/.venv/bin/python oracles/make_models.py                  # every row of the manifest
    oracles/.venv/bin/python oracles/make_models.py tiny-gemma4 tiny-qwen2   # only those
    oracles/.venv/bin/python oracles/make_models.py --only tiny-gemma3 --out /tmp/models
    oracles/.venv/bin/python oracles/make_models.py --list           # the rows, in build order

Writes goldens/models/<name>/ (or goldens/<machine-key>/models/<name>/ off the reference
machine; or DIR/<name>/ with --out) — a model a row `needs` is made before it when both are
asked for, else read from where it is. The models made here, from mlx-lm's own model classes
(mlx_lm.models.llama / qwen3 / qwen2 / gemma3_text / gemma4_text), with config.json,
model.safetensors, tokenizer.json, tokenizer_config.json (with a chat template),
generation_config.json and provenance.json:

- tiny-llama         llama, GQA (4 q / 2 kv heads), untied head, llama3 RoPE scaling, bf16
- tiny-qwen3         qwen3, q/k RMSNorm, explicit head_dim, tied embeddings, f32;
                     written with mlx-lm's own save_model/save_config
- tiny-llama-trained llama, trained here on oracles/corpus.txt (plain text + chat turns) so
                     that its greedy output is the text it learned, bf16
- tiny-gemma3        gemma3_text, sliding window 8 (rotating caches wrap), tied head, bf16

- tiny-qwen2         qwen2 (q/k/v biases), untied, float16
- tiny-smollm3       smollm3: llama with layer 3 of 4 attending without RoPE (NoPE), tied, bf16
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

Made by the other makers (each also runnable by itself for its own rows):
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
- tiny-qwen3-moe-q4  tiny-qwen3-moe in bf16, affine 4-bit: oracles/make_moe.py
- tiny-gemma4-moe, tiny-gemma4-moe-q4
                     gemma4_text with the 26B-A4B's expert block, and its 4-bit gemma4
                     wrapper: oracles/make_gemma4_moe.py
- tiny-gpt-oss, tiny-gpt-oss-mxfp4
                     gpt_oss (attention sinks, sliding/full layers with window 8, 8 experts
                     top-4 through the clamped SwiGLU, yarn RoPE), f32; and cast to bf16 with
                     mxfp4 experts and the rest affine 8-bit (mlx-community's MXFP4-Q8
                     layout): oracles/make_gpt_oss.py
- tiny-lfm2          lfm2 (short convolutions beside full attention): oracles/make_hybrids.py
- tiny-qwen3-tools   qwen3 trained to call a tool and to reason, in transformers 5's layout
                     (chat_template.jinja, two shards + index), its own tokenizer and chat
                     template: oracles/make_tools_model.py
- tiny-qwen3-embedding  qwen3 laid out as Qwen3-Embedding (its tokenizer appends end-of-text;
                     sentence-transformers' modules, last-token pooling, normalize), norm
                     scales off one, f32: oracles/make_embedding.py
- tiny-gemma4-assistant-centroid, -lm-head, -no-lm-head
                     the drafter's head variants: oracles/make_assistants.py
- tiny-llama-trained-q4, tiny-qwen3-q8, tiny-gemma3-q4, tiny-gemma4-q4, tiny-gemma3-mm-q4
                     mlx-lm's affine quantizer on the models above: oracles/make_quantized.py
- tiny-llama-mxfp4, tiny-llama-nvfp4, tiny-llama-mxfp8, tiny-llama-mixed-modes, tiny-qwen3-moe-mxfp4
                     MLX's floating-point quantization modes: oracles/make_quant_modes.py

Everything is seeded (a row's `seed` is the one its weights are drawn from). The tokenizer is a
byte-level BPE (vocab 1024) trained on oracles/corpus.txt with special tokens for
bos/eos/padding and chat turns, retrained deterministically each run.
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten
from mlx_lm.models import gemma3_text, gemma4_text, llama, qwen2, qwen3, smollm3
from mlx_lm.utils import save_config, save_model
from tokenizers import Tokenizer

import make_assistants
import make_dense
import make_embedding
import make_dense2
import make_gemma4_moe
import make_gpt_oss
import make_hybrids
import make_mla
import make_moe
import make_moe2
import make_quant_modes
import make_quantized
import make_rope
import make_tools_model
import make_wrappers
import tinymodels
from provenance import resolve, write_json
from tinymodels import (CORPUS, GEMMA4_KEQV, Job, gemma3_config, gemma4_config, llama_config, qa_pairs,
                        qwen3_config, random_model, randomize_scales, weights_of, write_model, write_provenance)


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


def make_llama(job: Job) -> Path:
    """tiny-llama: random, bf16, GQA, untied, llama3 rope scaling."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    cfg = llama_config(64, 2, 4, 2, 192, rope, tie=False)
    model = random_model(llama, cfg, job.seed, mx.bfloat16)
    return write_model(job, weights_of(model), cfg, f"random weights (seed {job.seed}), bf16")


def make_qwen3(job: Job) -> Path:
    """tiny-qwen3: random, f32, q/k norm, tied; saved by mlx-lm's own writers."""
    cfg = qwen3_config()
    model = random_model(qwen3, cfg, job.seed, mx.float32)

    def save(dest: Path) -> None:
        save_model(dest, model)
        save_config(dict(cfg), dest / "config.json")

    return write_model(job, None, cfg, f"random weights (seed {job.seed}), f32, mlx_lm.utils.save_model",
                       style="qwen", save=save)


def trained_llama(job: Job, cfg: dict, role: str = "") -> Path:
    """A llama of `cfg` drawn from the row's seed, trained in f32 on the corpus (`train`,
    batches seed 7), saved in bf16."""
    model = random_model(llama, cfg, job.seed, mx.float32)
    final = train(model, training_text(job.tok))
    model.set_dtype(mx.bfloat16)
    return write_model(job, weights_of(model), cfg,
                       f"{role}trained 600 steps on oracles/corpus.txt (seed {job.seed}/7), final loss {final:.3f}, bf16")


def make_llama_trained(job: Job) -> Path:
    """tiny-llama-trained: f32 training on the corpus, saved in bf16."""
    return trained_llama(job, llama_config(128, 3, 4, 2, 320, None, tie=False))


def make_gemma3(job: Job) -> Path:
    """tiny-gemma3: gemma3_text with a sliding window of 8 (layers 0 and 2 slide through a
    rotating cache, layers 1 and 3 attend globally), tied head (no lm_head saved), bf16."""
    cfg = gemma3_config()
    model = random_model(gemma3_text, cfg, job.seed, mx.bfloat16)
    return write_model(job, weights_of(model, drop=("lm_head.weight",)), cfg,
                       f"random weights (seed {job.seed}), bf16, tied (no lm_head)")


def make_gemma3_kv(job: Job) -> Path:
    """tiny-gemma3-kv: as tiny-gemma3 but with head_dim 32, so that MLX can quantize its
    caches (group sizes start at 32) — the L2 model for quantized rotating caches."""
    cfg = dict(gemma3_config(), head_dim=32, query_pre_attn_scalar=32)
    model = random_model(gemma3_text, cfg, job.seed, mx.bfloat16)
    return write_model(job, weights_of(model, drop=("lm_head.weight",)), cfg,
                       f"random weights (seed {job.seed}), bf16, head_dim 32, tied")


def make_smollm3(job: Job) -> Path:
    """tiny-smollm3: smollm3 (SmolLM 3: Llama's layers, layer 3 of 4 without RoPE as its
    explicit no_rope_layers says), GQA, tied head, norms drawn away from one, bf16."""
    cfg = llama_config(64, 4, 4, 2, 192, None, tie=True)
    cfg.update({"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3",
                "no_rope_layer_interval": 4, "no_rope_layers": [1, 1, 1, 0]})
    model = random_model(smollm3, cfg, job.seed, mx.bfloat16)
    randomize_scales(model, job.seed)
    return write_model(job, weights_of(model), cfg,
                       f"random weights (seed {job.seed}), bf16, NoPE on layer 3")


def make_qwen2(job: Job) -> Path:
    """tiny-qwen2: qwen2 (q/k/v biases, no o bias), GQA, untied head, float16."""
    cfg = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "vocab_size": tinymodels.VOCAB, "max_position_embeddings": 4096, "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    }
    model = random_model(qwen2, cfg, job.seed, mx.float16)
    # nn.Linear initialises biases near zero; give them weight so a dropped bias shows.
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.bias = (mx.random.normal(proj.bias.shape, key=mx.random.key(11)) * 0.5).astype(mx.float16)
    return write_model(job, weights_of(model), cfg, f"random weights (seed {job.seed}), float16, q/k/v biases",
                       style="qwen")


def make_gemma4(job: Job) -> Path:
    """tiny-gemma4: layers s s f | s s f with layers 3-5 reusing the K/V of layers 1 (sliding)
    and 2 (full); sliding window 8 so the rotating caches wrap."""
    cfg = gemma4_config()
    model = random_model(gemma4_text, cfg, job.seed, mx.bfloat16)
    randomize_scales(model, 16)
    return write_model(job, weights_of(model), cfg,
                       f"random weights (seed {job.seed}, norm/scalar noise seed 16), bf16, tied, KV sharing, "
                       "per-layer inputs")


def make_gemma4_keqv(job: Job) -> Path:
    """tiny-gemma4-keqv: layers s f s f; full layers project one K that is also V (2 KV heads
    on sliding layers, 1 on full ones); untied head."""
    cfg = gemma4_config(**GEMMA4_KEQV)
    model = random_model(gemma4_text, cfg, job.seed, mx.bfloat16)
    randomize_scales(model, 18)
    return write_model(job, weights_of(model), cfg,
                       f"random weights (seed {job.seed}, norm/scalar noise seed 18), bf16, untied, K=V on full "
                       "attention")


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


def make_gemma4_assistant(job: Job) -> Path:
    """tiny-gemma4-assistant: seeded weights (seed 22, norm/scalar noise seed 23) distilled in
    f32 (seed 24) on tiny-gemma4's greedy continuations of its L1 prompts, saved in bf16
    under the HF names optiq's GemmaAssistantDrafter.from_pretrained loads."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model
    from optiq.runtime.spec import GemmaAssistantDrafter
    from optiq.runtime.spec.drafters.gemma_assistant import GemmaAssistantConfig

    target_dir = job.source("tiny-gemma4")
    target, _ = load_model(target_dir)
    cfg = gemma4_assistant_config(json.loads((target_dir / "config.json").read_text()))
    dest = job.dest()

    mx.random.seed(job.seed)
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
    write_provenance(
        dest, f"drafter for models/tiny-gemma4: seeded weights (seed {job.seed}, norm/scalar noise seed 23), "
              f"distilled {ASSISTANT_STEPS} Adam steps (3e-3, seed 24, f32, {ASSISTANT_CHAIN} chained "
              f"draft steps) on tiny-gemma4's {ASSISTANT_CONTINUATION}-token greedy continuations of "
              f"its L1 prompts (labels: the target's uncapped argmax), final loss {loss.item():.3f}, bf16",
        oracle="mlx-optiq")
    return dest


def make_llama_draft(job: Job) -> Path:
    """A smaller model trained on the same text: drafts that tiny-llama-trained often accepts."""
    return trained_llama(job, llama_config(64, 2, 2, 1, 160, None, tie=True), role="drafter: ")


# The maker modules, by the name a manifest row's `maker` gives (this one included).
MAKERS = {m.__name__: m for m in (make_assistants, make_dense, make_dense2, make_embedding, make_gemma4_moe, make_gpt_oss, make_hybrids,
                                  make_mla, make_moe, make_moe2, make_quant_modes, make_quantized, make_rope,
                                  make_tools_model, make_wrappers)}
MAKERS["make_models"] = sys.modules[__name__]


def main(argv=None) -> None:
    tinymodels.main(MAKERS, argv)


if __name__ == "__main__":
    main()
