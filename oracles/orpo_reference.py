"""An independent ORPO reference in numpy (float64), TRL ORPOTrainer's formula:

    log_odds = (lw - lr) - (log1p(-exp(lw)) - log1p(-exp(lr)))
    L_OR     = -log_sigmoid(log_odds)
    loss     = mean(NLL + lambda * L_OR)

with lw, lr the mean per-token log-probabilities of each pair's chosen / rejected response
positions, and NLL either the chosen sequence's token-mean over every supervised position,
prompt and response (scope "full", TRL's chosen_nll_loss), or -lw (scope "response").

    oracles/.venv/bin/python oracles/orpo_reference.py

Writes goldens/train/orpo-reference.json: seeded pinned inputs (per-token log-probs of 3
pairs, their prompt and sequence lengths, lambda) and the expected terms for both scopes.
"""

import json

import numpy as np

from provenance import golden_dir, provenance, write_json


def log1mexp(x):
    return np.log1p(-np.exp(x))


def orpo(logps, prompt_mask, response_mask, lam, scope):
    b = logps.shape[0] // 2
    resp_sum = (logps * response_mask).sum(-1)
    resp_n = response_mask.sum(-1)
    mean = resp_sum / resp_n
    lw, lr = mean[:b], mean[b:]
    if scope == "full":
        prompt_sum = (logps * prompt_mask).sum(-1)[:b]
        prompt_n = prompt_mask.sum(-1)[:b]
        nll = -(prompt_sum + resp_sum[:b]) / (prompt_n + resp_n[:b])
    else:
        nll = -lw
    log_odds = (lw - lr) - (log1mexp(lw) - log1mexp(lr))
    l_or = np.logaddexp(0.0, -log_odds)  # -log_sigmoid(log_odds)
    return {"loss": float(np.mean(nll + lam * l_or)), "nll": float(np.mean(nll)),
            "or": float(np.mean(l_or)), "accuracy": float(np.mean(lw > lr)),
            "margin": float(np.mean(lw - lr)), "lw": float(np.mean(lw)), "lr": float(np.mean(lr))}


def main() -> None:
    rng = np.random.default_rng(11)
    t = 24
    prompt_lens = [5, 9, 1]
    lengths = [[17, 14], [24, 20], [12, 23]]  # [chosen, rejected] sequence lengths
    rows = [(p, l[0]) for p, l in zip(prompt_lens, lengths)] + [(p, l[1]) for p, l in zip(prompt_lens, lengths)]
    # log-probs in f32 (what the engine computes in), from near-certain to unlikely tokens
    logps = -rng.gamma(0.6, 1.5, size=(len(rows), t - 1)).astype(np.float32)
    pm = np.zeros_like(logps)
    rm = np.zeros_like(logps)
    for i, (p, n) in enumerate(rows):
        for s in range(1, t):
            pm[i, s - 1] = 1.0 if s < p else 0.0
            rm[i, s - 1] = 1.0 if p <= s < n else 0.0
    lam = 0.25
    x = logps.astype(np.float64)
    out = {scope: orpo(x, pm.astype(np.float64), rm.astype(np.float64), lam, scope) for scope in ("full", "response")}
    write_json(golden_dir("train") / "orpo-reference.json", {
        "provenance": provenance("numpy", "numpy"),
        "generator": "oracles/orpo_reference.py",
        "lambda": lam,
        "token_logps": logps.tolist(),
        "prompt_mask": pm.tolist(),
        "response_mask": rm.tolist(),
        "expected": out,
    })
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
