"""One ORPO training-step benchmark leg for mlx-lm-lora (peer of `harness leg-train`): the
step its `train_orpo` compiles — `nn.value_and_grad` over `orpo_loss_from_model` (two
forwards: chosen, rejected), `optimizer.update`, compiled with the model/optimizer/random
state — on LoRA layers made by mlx-lm's `linear_to_lora_layers`, for the given token pairs;
two warm-up steps, then --steps timed ones; prints one JSON line (median step time, peak
memory). Its ORPO is not canonical (see docs/training.md): time and memory are compared,
not losses.

mlx-lm-lora asks for mlx 0.32.4; it is installed without dependencies next to the pinned
0.32.2 (oracles/setup_lora_peer.sh) and imported from oracles/.lora-peer.

With --method dpo, the step is its `train_dpo`'s instead: `get_token_scores` (two
forwards), `compute_score` and `dpo_loss` (sigmoid, beta 0.1), the reference scores computed
once before the steps from the model with fresh LoRA (the base model), as the engine's DPO
leg precomputes them. With --method cpo, its `cpo_loss_from_model` (sigmoid, beta 0.1; no
NLL term). With --method simpo, which mlx-lm-lora lacks, its nearest step: CPO with
length-normalized scores (`loss_type` "ipo": the mean log-prob per response, two forwards,
no reference, as SimPO's), reported as mlx-lm-lora-cpo-mean.

    python oracles/train_leg.py --model DIR --pairs FILE --steps N --rank R --num-layers L \
        [--method orpo|dpo|cpo|simpo]
"""

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / ".lora-peer"))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.tuner.utils import linear_to_lora_layers  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402
from mlx_lm_lora.trainer.cpo_trainer import cpo_loss_from_model  # noqa: E402
from mlx_lm_lora.trainer.dpo_trainer import compute_score, dpo_loss, get_token_scores  # noqa: E402
from mlx_lm_lora.trainer.orpo_trainer import orpo_loss_from_model  # noqa: E402


def batch(pairs):
    # As iterate_orpo_batches: zero padding to a multiple of 8, masks on response tokens.
    longest = max(max(len(p["chosen"]), len(p["rejected"])) for p in pairs)
    width = 8 * ((longest + 7) // 8)
    out = {k: np.zeros((len(pairs), width), np.int32) for k in ("chosen", "rejected")}
    masks = {k: np.zeros((len(pairs), width), np.float32) for k in ("chosen", "rejected")}
    for j, p in enumerate(pairs):
        for k in ("chosen", "rejected"):
            out[k][j, :len(p[k])] = p[k]
            masks[k][j, p["prompt_len"]:len(p[k])] = 1.0
    return (mx.array(out["chosen"]), mx.array(out["rejected"]), mx.array(masks["chosen"]),
            mx.array(masks["rejected"]), mx.ones((len(pairs),), mx.float32))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--pairs", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--num-layers", type=int, required=True)
    ap.add_argument("--method", choices=("orpo", "dpo", "cpo", "simpo"), default="orpo")
    args = ap.parse_args()
    mx.random.seed(0)
    model, _ = load_model(Path(args.model))
    model.freeze()
    linear_to_lora_layers(model, args.num_layers, {"rank": args.rank, "scale": 20.0, "dropout": 0.0})
    model.train()
    opt = optim.AdamW(learning_rate=1e-4, weight_decay=0.01)
    data = batch(json.loads(Path(args.pairs).read_text()))

    def loss_wrapper(model, chosen, rejected, chosen_masks, rejected_masks, scores):
        loss, _, _, _ = orpo_loss_from_model(model, chosen, rejected, chosen_masks, rejected_masks, scores, beta=0.1)
        return loss

    if args.method == "dpo":
        chosen, rejected, cm, rm, _ = data
        ref = [mx.stop_gradient(compute_score(get_token_scores(model, x, m), m, "sigmoid"))
               for x, m in ((chosen, cm), (rejected, rm))]
        mx.eval(ref)
        data = data[:4]

        def loss_wrapper(model, chosen, rejected, chosen_masks, rejected_masks):
            pc = compute_score(get_token_scores(model, chosen, chosen_masks), chosen_masks, "sigmoid")
            pr = compute_score(get_token_scores(model, rejected, rejected_masks), rejected_masks, "sigmoid")
            loss, _, _, _ = dpo_loss(pc, pr, ref[0], ref[1], chosen_masks, rejected_masks,
                                     beta=0.1, delta=50.0, loss_type="sigmoid")
            return loss

    if args.method in ("cpo", "simpo"):
        data = data[:4]
        kind = "sigmoid" if args.method == "cpo" else "ipo"

        def loss_wrapper(model, chosen, rejected, chosen_masks, rejected_masks):
            loss, _, _, _ = cpo_loss_from_model(model, chosen, rejected, chosen_masks, rejected_masks,
                                                beta=0.1, delta=50.0, loss_type=kind)
            return loss

    value_and_grad = nn.value_and_grad(model, loss_wrapper)
    state = [model.state, opt.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(*batch):
        loss, grad = value_and_grad(model, *batch)
        opt.update(model, grad)
        return loss

    times = []
    for i in range(args.steps + 2):
        if i == 2:
            mx.reset_peak_memory()
        t0 = time.perf_counter()
        loss = step(*data)
        mx.eval(state, loss)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    stack = {"orpo": "mlx-lm-lora", "dpo": "mlx-lm-lora-dpo", "cpo": "mlx-lm-lora-cpo",
             "simpo": "mlx-lm-lora-cpo-mean"}[args.method]
    print(json.dumps({"stack": stack, "step_s": float(np.median(times)),
                      "peak_memory_bytes": mx.get_peak_memory()}))


if __name__ == "__main__":
    main()
