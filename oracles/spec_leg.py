"""One speculative-decoding benchmark leg for mlx-lm (peer of `harness leg-spec`): load the
target and the drafter, run one discarded warm-up, then each prompt in turn with
`speculative_generate_step` (γ = --num-draft-tokens; 0 = plain `generate_step`), greedy,
EOS not stopping, --max-tokens each; print one JSON line with totals. A drafter directory
holding a Gemma 4 assistant (config with `backbone_hidden_size`) runs mlx-optiq 0.7.7's
`assistant_generate_step` instead (stack "mlx-optiq"; its SpecStats give the counts).

    python oracles/spec_leg.py --model DIR --draft-model DIR --prompts FILE --max-tokens N --num-draft-tokens G

Decode tok/s counts every token after each prompt's first, over the time from that first
token to the last; drafted tokens are recomputed from the accept trace (each round drafts
min(γ, tokens still wanted)).
"""

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.utils import load_model


def is_assistant(path) -> bool:
    return "backbone_hidden_size" in json.loads((Path(path) / "config.json").read_text())


def one_assistant(model, draft, ids, max_tokens, gamma):
    from optiq.runtime.spec.runtime import SpecStats, assistant_generate_step
    stats = SpecStats()
    times = []
    t0 = time.perf_counter()
    for _token, _lp in assistant_generate_step(mx.array(ids), model, drafter=draft if gamma else None,
                                               gamma=gamma, max_tokens=max_tokens, stats=stats):
        times.append(time.perf_counter())
    return times[0] - t0, len(times) - 1, times[-1] - times[0], stats.n_drafted, stats.n_accepted


def one(model, draft, ids, max_tokens, gamma):
    if isinstance(draft, tuple):
        return one_assistant(model, draft[0], ids, max_tokens, gamma)
    if gamma == 0:
        stream = ((t, lp, False) for t, lp in generate_step(mx.array(ids), model, max_tokens=max_tokens))
    else:
        stream = speculative_generate_step(mx.array(ids), model, draft, num_draft_tokens=gamma,
                                           max_tokens=max_tokens)
    times, trace = [], []
    t0 = time.perf_counter()
    for _token, _lp, from_draft in stream:
        times.append(time.perf_counter())
        trace.append(from_draft)
    drafted, done = 0, 0
    if gamma:
        # A round emits its accepted drafts and one target token.
        i = 0
        while i < len(trace):
            drafted += min(gamma, max_tokens - done)
            while i < len(trace) and trace[i]:
                i += 1
                done += 1
            i += 1
            done += 1
    return times[0] - t0, len(times) - 1, times[-1] - times[0], drafted, sum(trace)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--num-draft-tokens", type=int, required=True)
    args = ap.parse_args()
    model, _ = load_model(Path(args.model))
    assistant = is_assistant(args.draft_model)
    if assistant:
        from optiq.runtime.spec.drafters.gemma_assistant import GemmaAssistantDrafter
        draft = (GemmaAssistantDrafter.from_pretrained(args.draft_model),)
        mx.eval(model.parameters())
    else:
        draft, _ = load_model(Path(args.draft_model))
        mx.eval(model.parameters(), draft.parameters())
    prompts = json.loads(Path(args.prompts).read_text())
    one(model, draft, prompts[0], args.max_tokens, args.num_draft_tokens)  # warm-up
    ttft = tokens = seconds = drafted = accepted = 0
    for ids in prompts:
        t, n, s, d, a = one(model, draft, ids, args.max_tokens, args.num_draft_tokens)
        ttft += t
        tokens += n
        seconds += s
        drafted += d
        accepted += a
    print(json.dumps({
        "stack": "mlx-optiq" if assistant else "mlx-lm", "gamma": args.num_draft_tokens, "ttft_s": ttft / len(prompts),
        "decode_tps": tokens / seconds, "drafted": drafted, "accepted": accepted,
    }))


if __name__ == "__main__":
    main()
