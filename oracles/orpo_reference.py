"""An independent ORPO reference in numpy (float64) with TRL's batch semantics: a port of
trl 0.19.1's `trl/trainer/orpo_trainer.py` (ORPOTrainer), written from its formulas:

    concatenated_forward: chosen rows first, then rejected, one forward;
      chosen_nll_loss = cross_entropy_loss(logits[:B], labels[:B]) -- nn.CrossEntropyLoss
        (mean reduction, ignore_index -100) over the FLATTENED chosen half: one
        token-weighted mean across the batch's chosen rows, not a mean of per-pair means.
        Decoder-only: labels = input_ids where attention_mask == 1 (prompt and response,
        label-shifted: scope "full"); with the prompt labels masked (its encoder-decoder
        path, `concatenated_labels`): the chosen responses only (scope "response").
      all_logps = get_batch_logps(logits, concatenated_labels, average_log_prob=True):
        each row's mean log-prob over its response positions (lw for chosen, lr rejected).
    odds_ratio_loss: log_odds = (lw - lr) - (log1p(-exp(lw)) - log1p(-exp(lr)));
      ratio = logsigmoid(log_odds)
    get_batch_loss_metrics: loss = chosen_nll_loss - mean(lambda * ratio)

TRL itself needs torch (several GB with its CUDA wheels), which does not install into
oracles/.venv in reasonable time; this port starts from per-token log-probabilities
(what `selective_log_softmax` / cross-entropy give) and builds TRL's label masks itself.

    oracles/.venv/bin/python oracles/orpo_reference.py

Writes goldens/train/orpo-reference.json: seeded pinned inputs (per-token log-probs of
B = 4 pairs of unequal prompt and sequence lengths, the prompt/response target masks,
lambda) and the expected terms for both scopes.
"""

import json

import numpy as np

from provenance import golden_dir, provenance, write_json

IGNORE = -100


def labels_of(rows, t, scope):
    """TRL's label rows [N, t] after the shift (target step s = token s of the row): the
    token position where supervised, IGNORE where not (padding; the prompt in scope
    "response", and always for the logps labels)."""
    out = np.full((len(rows), t - 1), IGNORE)
    for i, (p, n) in enumerate(rows):
        for s in range(1, n):
            if scope == "full" or s >= p:
                out[i, s - 1] = s
    return out


def cross_entropy_loss(token_logps, labels):
    """nn.CrossEntropyLoss() on the flattened rows: the mean of -log p over every target
    that is not IGNORE."""
    flat_lp, flat_lab = token_logps.reshape(-1), labels.reshape(-1)
    keep = flat_lab != IGNORE
    return float(-flat_lp[keep].sum() / keep.sum())


def get_batch_logps(token_logps, labels):
    """average_log_prob=True: each row's mean log-prob over its non-IGNORE targets."""
    mask = labels != IGNORE
    return (token_logps * mask).sum(-1) / mask.sum(-1)


def orpo(token_logps, rows, t, lam, scope):
    b = len(rows) // 2
    nll = cross_entropy_loss(token_logps[:b], labels_of(rows[:b], t, scope))
    logps = get_batch_logps(token_logps, labels_of(rows, t, "response"))
    lw, lr = logps[:b], logps[b:]
    log_odds = (lw - lr) - (np.log1p(-np.exp(lw)) - np.log1p(-np.exp(lr)))
    ratio = -np.logaddexp(0.0, -log_odds)  # logsigmoid(log_odds)
    l_or = -ratio
    return {"loss": nll - float(np.mean(lam * ratio)), "nll": nll,
            "or": float(np.mean(l_or)), "accuracy": float(np.mean(lw > lr)),
            "margin": float(np.mean(lw - lr)), "lw": float(np.mean(lw)), "lr": float(np.mean(lr))}


def main() -> None:
    rng = np.random.default_rng(11)
    t = 24
    prompt_lens = [5, 9, 1, 3]
    lengths = [[17, 14], [24, 20], [12, 23], [7, 11]]  # [chosen, rejected] sequence lengths
    rows = [(p, l[0]) for p, l in zip(prompt_lens, lengths)] + [(p, l[1]) for p, l in zip(prompt_lens, lengths)]
    # log-probs in f32 (what the engine computes in), from near-certain to unlikely tokens
    logps = -rng.gamma(0.6, 1.5, size=(len(rows), t - 1)).astype(np.float32)
    # the engine's inputs: prompt-span and response-span target masks
    pm = (labels_of(rows, t, "full") != IGNORE) & (labels_of(rows, t, "response") == IGNORE)
    rm = labels_of(rows, t, "response") != IGNORE
    lam = 0.25
    x = logps.astype(np.float64)
    out = {scope: orpo(x, rows, t, lam, scope) for scope in ("full", "response")}
    write_json(golden_dir("train", portable=True) / "orpo-reference.json", {
        "provenance": provenance("numpy", "numpy"),
        "generator": "oracles/orpo_reference.py",
        "semantics": "trl 0.19.1 ORPOTrainer (trl/trainer/orpo_trainer.py), batch of 4 pairs of unequal lengths",
        "lambda": lam,
        "token_logps": logps.tolist(),
        "prompt_mask": pm.astype(np.float32).tolist(),
        "response_mask": rm.astype(np.float32).tolist(),
        "expected": out,
    })
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
