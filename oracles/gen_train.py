"""LoRA training goldens: mlx-lm 0.32.2's LoRA layers and loss, differentiated and stepped
eagerly (the math of `mlx_lm.tuner.trainer.train`, without its `mx.compile` around the
step), on tiny-llama-trained, tiny-smollm3 (its NoPE layer among the 3 adapted), tiny-gemma3
and tiny-gemma4; the gemma3 / gemma4 wrappers
(tiny-gemma3-mm, tiny-gemma4-mm: adapter names under `language_model.`); and with mlx-lm's
default keys (every linear of a block) tiny-phi3 and the MoE families tiny-qwen3-moe,
tiny-mixtral, tiny-qwen2-moe and the 4-bit tiny-qwen3-moe-q4 (`LoRASwitchLinear` on the
stacked experts, `LoRALinear` on the router gate), tiny-glm4-moe (its router is a `MoEGate`,
no Linear: none there), tiny-ernie4-5-moe, tiny-minimax, tiny-phimoe and tiny-llama4-text; and the hybrid families, also with the
default keys: tiny-qwen3-5 (gated delta net + gated attention), tiny-qwen3-5-moe,
tiny-qwen3-next (fused delta-net projections), tiny-lfm2 / tiny-lfm2-moe (short convolution +
attention), tiny-mamba2 (Mamba-2 only), tiny-nemotron-h (Mamba-2, attention and MLP blocks),
tiny-granite-h (Mamba-2 / attention + experts + shared MLP), tiny-nemotron-h-moe-grouped and
the 4-bit tiny-nemotron-h-moe-q4 (Nemotron 3's `E` blocks: `LoRASwitchLinear` on
switch_mlp.fc1 / fc2, `LoRALinear` on the latent projections and the shared expert; the
router `gate` is mlx-lm's `MoEGate`, no Linear, so it gets none), tiny-falcon-h1 (Mamba-2 and
attention side by side in every layer, SwiGLU `feed_forward`; the µP multipliers folded into
the frozen weights by mlx-lm's sanitize), and with the default keys batch one's dense
families: tiny-gemma2 (softcapped attention), tiny-olmo2 / tiny-olmo3 (post-norm layers,
whole-projection q/k norms), tiny-seed-oss, tiny-exaone4, tiny-hunyuan, tiny-minicpm and
tiny-cohere2 (parallel block, float16); ministral3's tiny-ministral3 and the text paths of
the mistral3 / qwen3_vl wrappers (tiny-mistral3, tiny-qwen3-vl: adapter names under
`language_model.`) with the default keys; tiny-gemma3n over all 4 layers (its 2 KV-shared
ones project their own K/V without a cache) with every linear of a block but AltUp's
prediction / correction coefficients (mlx-lm reads their weights, so its default keys fail
on it); tiny-gpt-oss and its mxfp4 twin tiny-gpt-oss-mxfp4 with the default keys (sink
attention, the router and the biased expert stacks: `LoRASwitchLinear` over mxfp4
`QuantizedSwitchLinear` in the latter); and the MLA families beside tiny-deepseek-v3, with the
default keys over all their blocks: tiny-glm4-moe-lite, tiny-deepseek-v32 (its indexer's
wq_b / wk are Linears: adapted too), tiny-kimi-k25 (the multimodal wrapper: names under
`language_model.`) and tiny-minicpm3 (MLA's projections without absorption: kv_b_proj a
Linear), and tiny-llama4 (the llama4 wrapper: `language_model.`, top-1 experts with a shared
expert, chunked attention). Their recurrent
mixers' linears get adapters (the delta net's in_proj_* and out_proj, Mamba-2's and the short conv's in_proj and out_proj);
their conv1d is not a Linear and gets none.

    oracles/.venv/bin/python oracles/gen_train.py [MODEL] [--out DIR]

Setup: `mx.random.seed(7)`; `model.freeze()`; `linear_to_lora_layers(model, 3 (NUM_LAYERS: tiny-gemma4 4, the nemotron_h ones 5, …),
{rank 4, scale 20.0, dropout 0.0, keys: every linear of a block})` (the lora_a draws come from the
seeded global RNG, lora_b is zero); AdamW(learning_rate 1e-3, weight_decay 0.01, mlx's
default betas/eps). One batch of 2 chat sequences built as `iterate_batches` builds it
(zero padding to 1 + a multiple of 32, `lengths = [[prompt_len, len]]`: prompt masking).
Three steps of `nn.value_and_grad(model, default_loss)` → `optimizer.update`.

Recorded: the initial LoRA parameters, the batch and lengths, then per step the loss,
ntoks and every gradient (f32), and the parameters after the last update; the adapters
after the last step as mlx-lm writes them (`adapters.safetensors` + `adapter_config.json`),
and one forward's logits with those adapters loaded by `mlx_lm.utils.load_adapters` — of the
batch, and of its first row's first 8 tokens (fewer than 64 routing entries: the MoE
experts' unsorted path); without a cache, but tiny-gemma3n's with a fresh prompt cache
(with one its KV-shared layers borrow, without they do not).

With `--fine-tune-type dora` (`--suffix=-dora`) the same run with mlx-lm's `DoRALinear`
(`linear_to_lora_layers(..., use_dora=True)`: lora_a, lora_b and the magnitude `m`
trainable) — on tiny-llama-trained and the quantized tiny-llama-trained-q4 / tiny-qwen3-q8;
with `--fine-tune-type full` (`--suffix=-full`) mlx_lm.lora's full fine-tuning: the last
FULL_NUM_LAYERS block(s) unfrozen, every parameter of them trained and saved.

Output: goldens/train/<model><suffix>/{index.json, data.bin, adapters/}.
"""

import argparse
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tuner.trainer import default_loss
from mlx_lm.tuner.utils import linear_to_lora_layers, load_adapters

from provenance import TensorFile, golden_dir, provenance, resolve, write_json
from make_moe import patch_gather_qmm

patch_gather_qmm()  # mlx-lm's QuantizedSwitchLinear on MLX 0.32.2 (see make_moe.py)

KEYS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
# Gemma 4's small models add a per-layer input branch with two more linears.
GEMMA4_EXTRA = ["per_layer_input_gate", "per_layer_projection"]
# Gemma 3n: every Linear of a block but AltUp's prediction_coefs / correction_coefs, whose
# weights mlx-lm's Gemma3nAltUp reads directly (with them as LoRA layers its default keys
# fail on the first forward: 'LoRALinear' object has no attribute 'weight').
GEMMA3N_EXTRA = ["altup.modality_router", "laurel.linear_left", "laurel.linear_right",
                 "per_layer_input_gate", "per_layer_projection"]
EXTRA_KEYS = {"tiny-gemma4": GEMMA4_EXTRA, "tiny-gemma4-mm": GEMMA4_EXTRA, "tiny-gemma3n": GEMMA3N_EXTRA}
# Its last 3 layers borrow K/V (no k/v projections): 4 layers reach one that has them.
# tiny-qwen3-moe: all 4, so the dense layer (mlp_only_layers [1]) is adapted too.
# tiny-nemotron-h (M*-M-): all 5, so its one attention block is adapted too; the Nemotron 3
# ones (ME*E-): all 5, so both `E` blocks and the Mamba-2 block are adapted.
NUM_LAYERS = {"tiny-gemma4": 4, "tiny-gemma4-mm": 4, "tiny-qwen3-moe": 4, "tiny-qwen3-moe-q4": 4,
              "tiny-nemotron-h": 5, "tiny-nemotron-h-moe-grouped": 5, "tiny-nemotron-h-moe-q4": 5,
              "tiny-glm4-moe": 4, "tiny-ernie4-5-moe": 4, "tiny-llama4-text": 4, "tiny-llama4": 4,
              "tiny-gemma3n": 4}
# No `keys`: mlx-lm's default, every Linear / SwitchLinear of a block (phi3's fused
# qkv_proj and gate_up_proj; the MoE families' router gate, stacked experts and shared expert).
DEFAULT_KEYS = {"tiny-phi3", "tiny-qwen3-moe", "tiny-qwen3-moe-q4", "tiny-mixtral", "tiny-qwen2-moe",
                "tiny-qwen3-5", "tiny-qwen3-5-moe", "tiny-qwen3-next", "tiny-lfm2", "tiny-lfm2-moe",
                "tiny-mamba2", "tiny-nemotron-h", "tiny-granite-h", "tiny-nemotron-h-moe-grouped",
                "tiny-nemotron-h-moe-q4", "tiny-falcon-h1", "tiny-olmo2", "tiny-gemma2", "tiny-glm4-moe",
                "tiny-ernie4-5-moe", "tiny-minimax", "tiny-phimoe", "tiny-llama4-text", "tiny-olmo3",
                "tiny-seed-oss", "tiny-exaone4", "tiny-hunyuan", "tiny-minicpm", "tiny-cohere2",
                "tiny-deepseek-v3", "tiny-glm4-moe-lite", "tiny-deepseek-v32", "tiny-kimi-k25",
                "tiny-minicpm3", "tiny-llama4", "tiny-ministral3", "tiny-mistral3", "tiny-qwen3-vl",
                "tiny-gpt-oss", "tiny-gpt-oss-mxfp4"}
CACHED_LOGITS = {"tiny-gemma3n"}
# Full fine-tuning trains whole blocks: one keeps the golden small.
FULL_NUM_LAYERS = 1
LORA = {"rank": 4, "scale": 20.0, "dropout": 0.0, "keys": KEYS}
PAIRS = [("What color is the sky?", "The sky is blue."),
         ("Who came to the workshop?", "A girl named Mira came to the workshop.")]
STEPS = 3
SHORT = 8


def batch_of(tokenizer):
    seqs, offsets = [], []
    for q, a in PAIRS:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        full = tokenizer.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
        assert full[:len(prompt)] == prompt
        seqs.append(full)
        offsets.append(len(prompt))
    lengths = [len(s) for s in seqs]
    width = 1 + 32 * ((max(lengths) + 31) // 32)
    arr = np.zeros((len(seqs), width), np.int32)
    for j, s in enumerate(seqs):
        arr[j, :len(s)] = s
    return mx.array(arr), mx.array(list(zip(offsets, lengths)))


def make_trainable(model, name, fine_tune_type):
    """What mlx_lm.lora's `train_model` makes trainable: LoRA / DoRA layers on the chosen
    linears of the last blocks, or (`full`) every parameter of the last blocks."""
    model.freeze()
    lora = {**LORA, "keys": KEYS + EXTRA_KEYS.get(name, [])}
    if name in DEFAULT_KEYS:
        del lora["keys"]
    if fine_tune_type == "full":
        num_layers = FULL_NUM_LAYERS
        for layer in model.layers[-max(num_layers, 0):]:
            layer.unfreeze()
    else:
        num_layers = NUM_LAYERS.get(name, 3)
        linear_to_lora_layers(model, num_layers, lora, use_dora=fine_tune_type == "dora")
    return num_layers, lora


def main(name, out_root, fine_tune_type="lora", suffix="") -> None:
    mx.set_default_device(mx.cpu)
    model_dir = resolve(f"models/{name}")
    model, tokenizer = load(str(model_dir))
    mx.random.seed(7)
    num_layers, lora = make_trainable(model, name, fine_tune_type)
    data = TensorFile()
    # Full fine-tuning starts from the model's own weights (goldens/models): not stored again.
    initial = [] if fine_tune_type == "full" else [
        {"name": k, **data.add(f"init/{k}", v)} for k, v in tree_flatten(model.trainable_parameters())]
    batch, lengths = batch_of(tokenizer)
    opt = optim.AdamW(learning_rate=1e-3, weight_decay=0.01)
    loss_vg = nn.value_and_grad(model, default_loss)
    steps = []
    for step in range(STEPS):
        (loss, ntoks), grads = loss_vg(model, batch, lengths)
        mx.eval(loss, ntoks, grads)
        steps.append({
            "loss": data.add(f"step{step}/loss", loss),
            "loss_value": loss.item(),
            "ntoks": int(ntoks.item()),
            "grads": [{"name": k, **data.add(f"step{step}/grad/{k}", g)} for k, g in tree_flatten(grads)],
        })
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
        print(f"step {step}: loss {loss.item():.6f} ntoks {int(ntoks.item())}")
    final = [{"name": k, **data.add(f"final/{k}", v)} for k, v in tree_flatten(model.trainable_parameters())]
    dest = Path(out_root) / f"{name}{suffix}" if out_root else golden_dir(f"train/{name}{suffix}")
    adapters = dest / "adapters"
    adapters.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(adapters / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    (adapters / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": fine_tune_type, "num_layers": num_layers, "lora_parameters": lora}, indent=2) + "\n")
    # The adapters loaded the way mlx_lm.generate --adapter-path loads them: one forward.
    fresh, _ = load(str(model_dir))
    load_adapters(fresh, str(adapters))
    # Gemma 3n's forward differs with and without a cache (its KV-shared layers borrow only
    # through one): its logits are the cached forward's, as generation runs it and as the
    # engine's check computes them (with fresh caches).
    cache = (lambda: make_prompt_cache(fresh)) if name in CACHED_LOGITS else (lambda: None)
    logits = fresh(batch[:, :-1], cache=cache())
    adapted = data.add("adapted_logits", logits.astype(mx.float32))
    # A short input too: with under 64 routing entries the experts take the unsorted path.
    short = fresh(batch[:1, :SHORT], cache=cache()).astype(mx.float32)
    adapted_short = data.add("adapted_logits_short", short)
    data.write(dest / "data.bin")
    write_json(dest / "index.json", {
        "provenance": provenance("mlx-lm", "mlx-lm"),
        "generator": "oracles/gen_train.py",
        "model": f"models/{name}",
        "data": "data.bin",
        "settings": {"seed": 7, "fine_tune_type": fine_tune_type, "num_layers": num_layers, "lora_parameters": lora,
                     "optimizer": {"name": "adamw", "learning_rate": 1e-3, "weight_decay": 0.01,
                                   "betas": [0.9, 0.999], "eps": 1e-8},
                     "loss": "mlx_lm.tuner.trainer.default_loss", "steps": STEPS,
                     "path": "nn.value_and_grad + optimizer.update, eager"},
        "batch": batch.tolist(),
        "lengths": lengths.tolist(),
        "initial": initial,
        "steps": steps,
        "final": final,
        "adapters": "adapters",
        "adapted_logits": adapted,
        "short_input": [1, SHORT],
        "adapted_logits_short": adapted_short,
    })
    print(f"train/{name} -> {dest}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="tiny-llama-trained")
    ap.add_argument("--out", help="write <out>/<model>/ instead of the goldens (live diffs)")
    ap.add_argument("--fine-tune-type", choices=["lora", "dora", "full"], default="lora",
                    help="mlx_lm.lora's --fine-tune-type (dora: `DoRALinear`; full: the last "
                         f"{FULL_NUM_LAYERS} block(s) unfrozen)")
    ap.add_argument("--suffix", default="", help="golden name suffix: train/<model><suffix>")
    args = ap.parse_args()
    main(args.model, args.out, args.fine_tune_type, args.suffix)
