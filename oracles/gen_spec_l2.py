"""Speculative-decoding L2 goldens: optiq 0.7.7's `assistant_generate_step` (the loop
`optiq serve --drafter` runs) on tiny-gemma4 with the tiny-gemma4-assistant drafter, greedy.

    oracles/.venv/bin/python oracles/gen_spec_l2.py [--drafter NAME] [--out DIR]

Cases: the L1 prompts raw0 (4 ids, shorter than the sliding window 8), raw1, raw2 and chat1
(11, 26 and 55 ids), each for γ = 1, 2, 3 with 20 tokens, plus raw1 with γ = 3 and 3 tokens
(the draft budget min(γ, remaining - 1) caps the only drafting pass at one draft). The
generator is read to max_tokens (no EOS stop), prefill in one chunk (optiq's default 2048).

optiq is instrumented without being modified, by swapping module attributes it looks up at
call time: `runtime._target_step` (each verify pass: the ids fed), `runtime._target_embed`
(the token each draft step reads) and the drafter instance's `forward` (each draft step: its
position, argmax and full logits row); the sampler passed in is the default greedy one,
recorded (the verify argmax per fed position). A yielded token is an accepted draft exactly
when no verify pass ran since the previous yield: `cur` (a target token) is always the first
yield after a pass, and the first pass after prefill yields nothing.

Per case: ids, from_draft, logprobs (the [V] row each id was yielded with, in its own dtype,
bf16: uncapped log-softmax), passes ({input, verify, accepted}; accepted is optiq's n for that
pass, 0 for a final pass cut short before its drafts were checked), drafts ({pass, position,
token_in, id, logits}), stats (optiq's SpecStats counts) and the cache offsets afterwards.

Output: goldens/spec-l2/tiny-gemma4/index.json + data.bin; with `--drafter NAME` (one of
the head variants oracles/make_assistants.py makes) goldens/spec-l2/NAME/, the same cases.

The head is the one the drafter's tensors carry (`masked_embedding.*` → the centroid head,
else `lm_head.weight` → its own, else the tied embedding). optiq 0.7.7 chooses it from the
config flags instead, so where a drafter's flags contradict its tensors optiq runs on a copy
of its config with the flags set to what the tensors say, and the index records what optiq
does with the committed config (`optiq_on_committed_config`).
"""

import argparse
import copy
import json
import tempfile
from pathlib import Path

import mlx.core as mx
import optiq.runtime.spec.runtime as runtime
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model
from optiq.runtime.spec import GemmaAssistantDrafter, SpecStats, assistant_generate_step

from provenance import TensorFile, golden_dir, provenance, resolve, write_json

TARGET = "tiny-gemma4"
DRAFTER = "tiny-gemma4-assistant"
GAMMAS = (1, 2, 3)
MAX_TOKENS = 20
PREFILL_STEP = 2048
PROMPTS = ("raw0", "raw1", "raw2", "chat1")


def cases(l1):
    prompts = {c["name"]: c["prompt_ids"] for c in l1["cases"]}
    out = [{"name": f"{name}-g{gamma}", "prompt": name, "prompt_ids": prompts[name],
            "gamma": gamma, "max_tokens": MAX_TOKENS} for name in PROMPTS for gamma in GAMMAS]
    out.append({"name": "raw1-g3-max3", "prompt": "raw1", "prompt_ids": prompts["raw1"],
                "gamma": 3, "max_tokens": 3})
    return out


def run(model, drafter, case, data: TensorFile):
    """One case through optiq's generator, with every verify pass and draft step recorded."""
    name = case["name"]
    stats = SpecStats()
    passes, drafts, embedded = [], [], []
    target_step, target_embed, forward = runtime._target_step, runtime._target_embed, drafter.forward

    def settle():
        # optiq counts a pass's accepted drafts after the pass; settle the previous one.
        if passes:
            passes[-1]["accepted"] = stats.n_accepted - passes[-1].pop("accepted_before")

    def rec_target_step(target, ids, cache):
        settle()
        passes.append({"input": ids[0].tolist(), "accepted_before": stats.n_accepted})
        return target_step(target, ids, cache)

    def rec_target_embed(target, token_id):
        embedded.append(int(token_id))
        return target_embed(target, token_id)

    def rec_forward(**kw):
        logits, h_next = forward(**kw)
        k = len(drafts)
        drafts.append({"pass": len(passes), "position": int(kw["position"]), "token_in": embedded[-1],
                       "id": int(mx.argmax(logits)), "logits": data.add(f"{name}/draft{k}", logits)})
        return logits, h_next

    def sampler(lp):
        toks = mx.argmax(lp, axis=-1)              # optiq's default sampler
        passes[-1]["verify"] = toks.tolist()
        return toks

    cache = make_prompt_cache(model)
    ids, from_draft, logprobs = [], [], []
    seen = 0
    runtime._target_step, runtime._target_embed, drafter.forward = rec_target_step, rec_target_embed, rec_forward
    try:
        for token, lp in assistant_generate_step(
            mx.array(case["prompt_ids"]), model, drafter=drafter, gamma=case["gamma"],
            max_tokens=case["max_tokens"], sampler=sampler, prompt_cache=cache,
            prefill_step_size=PREFILL_STEP, stats=stats,
        ):
            ids.append(int(token))
            from_draft.append(len(passes) == seen)
            seen = len(passes)
            logprobs.append(data.add(f"{name}/{len(logprobs)}", lp))
        settle()
    finally:
        runtime._target_step, runtime._target_embed = target_step, target_embed
        del drafter.forward
    return dict(case, ids=ids, from_draft=from_draft, logprobs=logprobs, passes=passes, drafts=drafts,
                stats={"n_drafted": stats.n_drafted, "n_accepted": stats.n_accepted,
                       "n_target_calls": stats.n_target_calls, "n_emitted": stats.n_emitted},
                cache_offsets=[c.offset for c in cache])


def tensor_head(path: Path) -> tuple[bool, bool]:
    """(centroid, lm_head): the heads the drafter's tensors carry."""
    names = set(mx.load(str(path / "model.safetensors")))
    return "masked_embedding.centroids.weight" in names, "lm_head.weight" in names


def load_drafter(path: Path):
    """optiq's drafter for `path` with its flags set to its tensors' head, and what optiq
    does with the committed config."""
    cfg = json.loads((path / "config.json").read_text())
    centroid, lm_head = tensor_head(path)
    fixed = copy.deepcopy(cfg)
    fixed["use_ordered_embeddings"] = centroid
    if not centroid:
        for c in (fixed, fixed.get("text_config", {})):
            c["tie_word_embeddings"] = not lm_head
    try:
        as_is = GemmaAssistantDrafter.from_pretrained(str(path)).cfg
        head = ("centroid" if as_is.use_ordered_embeddings else
                "tied embedding" if as_is.tie_word_embeddings else "lm_head")
        committed = f"loads, head: {head}"
    except ValueError as e:
        committed = f"refused: {e}"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(fixed))
        (Path(tmp) / "model.safetensors").symlink_to((path / "model.safetensors").resolve())
        drafter = GemmaAssistantDrafter.from_pretrained(tmp)
    corrected = {k: fixed[k] for k in ("use_ordered_embeddings", "tie_word_embeddings")
                 if fixed.get(k) != cfg.get(k)}
    return drafter, committed, corrected


def main(out_root, drafter_name=DRAFTER) -> None:
    mx.set_default_device(mx.cpu)
    model, _ = load_model(resolve(f"models/{TARGET}"))
    drafter, committed, corrected = load_drafter(resolve(f"models/{drafter_name}"))
    print(f"{drafter_name}: optiq on the committed config: {committed}; flags set to the tensors: {corrected}")
    l1 = json.loads((resolve(f"l1/{TARGET}") / "index.json").read_text())
    data = TensorFile()
    done = []
    for case in cases(l1):
        case = run(model, drafter, case, data)
        done.append(case)
        s = case["stats"]
        print(f"{case['name']:14s} accepted {s['n_accepted']:2d}/{s['n_drafted']:2d}  "
              f"passes {s['n_target_calls']:2d}  {case['ids'][:10]}")
    name = TARGET if drafter_name == DRAFTER else drafter_name
    dest = Path(out_root) / name if out_root else golden_dir(f"spec-l2/{name}")
    data.write(dest / "data.bin")
    write_json(dest / "index.json", {
        "provenance": provenance("mlx-optiq", "mlx-optiq"),
        "generator": "oracles/gen_spec_l2.py",
        "model": f"models/{TARGET}",
        "drafter": f"models/{drafter_name}",
        "drafter_flags_set_to_tensors": corrected,
        "optiq_on_committed_config": committed,
        "data": "data.bin",
        "gamma_values": list(GAMMAS),
        "settings": {"path": "optiq.runtime.spec.assistant_generate_step", "sampler": "greedy",
                     "prefill_step_size": PREFILL_STEP, "cache": "make_prompt_cache",
                     "eos": "not stopped (the generator is read to max_tokens)"},
        "cases": done,
    })
    print(f"spec-l2/{name} -> {dest}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", default=DRAFTER, help="the drafter (a head variant: goldens/spec-l2/NAME)")
    ap.add_argument("--out", help="write <out>/tiny-gemma4/ (<out>/NAME/) instead of the goldens (live diffs)")
    args = ap.parse_args()
    main(args.out, args.drafter)
