"""One GRPO iteration benchmark leg for mlx-lm-lora (peer of `harness leg-grpo`): its
`generate_grpo` (mlx-lm's BatchGenerator with a shared prompt cache per group) samples
--group completions of each prompt at temperature 1 (top-p 1, no top-k / min-p, as the
engine samples), a length reward gives group-normalized advantages (computed here as TRL
does), then its train step: `nn.value_and_grad(model, grpo_loss)` through
`_grpo_value_and_grad` (its micro-batches of as many rows as there are prompts) and
`optimizer.update`. LoRA layers by mlx-lm's `linear_to_lora_layers`. One warm-up
iteration, then --steps timed ones; prints one JSON line (median generate and update
times, peak memory, mean completion length).

mlx-lm-lora is imported from oracles/.lora-peer (see oracles/setup_lora_peer.sh).

    python oracles/train_leg_grpo.py --model DIR --prompts FILE --steps N --rank R \
        --num-layers L --group G --max-tokens T
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / ".lora-peer"))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.tuner.utils import linear_to_lora_layers  # noqa: E402
from mlx_lm.utils import load_model, load_tokenizer  # noqa: E402
from mlx_lm_lora.trainer.grpo_trainer import (  # noqa: E402
    _grpo_value_and_grad, generate_grpo, grpo_loss)


def advantages(lengths, group, target):
    r = np.maximum(0.0, 1.0 - np.abs(np.array(lengths, np.float64) - target) / target)
    g = r.reshape(-1, group)
    mu = g.mean(axis=1, keepdims=True)
    sd = g.std(axis=1, ddof=1, keepdims=True)
    return mx.array(((g - mu) / (sd + 1e-4)).reshape(-1).astype(np.float32))


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("--model", "--prompts"):
        ap.add_argument(name, required=True)
    for name in ("--steps", "--rank", "--num-layers", "--group", "--max-tokens"):
        ap.add_argument(name, type=int, required=True)
    args = ap.parse_args()
    mx.random.seed(0)
    model, _ = load_model(Path(args.model))
    tokenizer = load_tokenizer(Path(args.model))
    model.freeze()
    linear_to_lora_layers(model, args.num_layers, {"rank": args.rank, "scale": 20.0, "dropout": 0.0})
    model.train()
    opt = optim.AdamW(learning_rate=1e-6, weight_decay=0.01)
    prompts = [mx.array(p, dtype=mx.int32) for p in json.loads(Path(args.prompts).read_text())]
    batch = (prompts, [[] for _ in prompts], ["" for _ in prompts], ["" for _ in prompts], None)
    loss_value_and_grad = nn.value_and_grad(model, grpo_loss)
    gen_t, upd_t, lengths = [], [], []
    for i in range(args.steps + 1):
        if i == 1:
            mx.reset_peak_memory()
        t0 = time.perf_counter()
        completions, texts, indices = generate_grpo(
            model, tokenizer, prompts, args.max_tokens, args.group, len(prompts), "", 1.0,
            1.0, 0, 0.0)
        adv = advantages([c.size for c in completions], args.group, args.max_tokens)
        mx.eval(adv)
        t1 = time.perf_counter()
        (loss, _, _), grad = _grpo_value_and_grad(
            loss_value_and_grad, model, len(prompts), batch=batch, completions=completions,
            completion_texts=texts, batch_indices=indices, advantages=adv, reward_metrics={},
            beta=0.0, epsilon=0.2, epsilon_high=0.2, ref_model=None, grpo_loss_type="grpo",
            importance_sampling_level="token", max_tokens=args.max_tokens)
        opt.update(model, grad)
        mx.eval(model.parameters(), opt.state, loss)
        if i >= 1:
            gen_t.append(t1 - t0)
            upd_t.append(time.perf_counter() - t1)
            lengths.append(float(np.mean([c.size for c in completions])))
    print(json.dumps({"stack": "mlx-lm-lora", "generate_s": float(np.median(gen_t)),
                      "update_s": float(np.median(upd_t)),
                      "peak_memory_bytes": mx.get_peak_memory(),
                      "completion_tokens": float(np.median(lengths))}))


if __name__ == "__main__":
    main()
