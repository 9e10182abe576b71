"""An independent float64 numpy reference for DPO, CPO and SimPO as TRL 1.16.0 defines them,
written from its code (not copied):

  trl/trainer/dpo_trainer.py, DPOTrainer._compute_loss (f_divergence_type reverse_kl, one
    loss type, no ld_alpha, no use_weighting):
      logps = per-token log-probs summed over the completion targets (labels -100 elsewhere);
      chosen/rejected = the two halves of the [chosen; rejected] batch;
      d+ = chosen_logps - ref_chosen_logps, d- = rejected_logps - ref_rejected_logps,
      delta = d+ - d-;
      sigmoid: -logsigmoid(beta*delta); hinge: relu(1 - beta*delta);
      ipo: (d+/max(n+,1) - d-/max(n-,1) - 1/(2 beta))^2 with n = completion token counts;
      robust: (-(1-eps) logsigmoid(beta*delta) + eps logsigmoid(-beta*delta)) / (1 - 2 eps);
      loss = mean over pairs; rewards = beta * d (detached), accuracies = mean(r+ > r-),
      margins = mean(r+ - r-), logps/chosen, logps/rejected = means of the summed logps.
  trl/experimental/cpo/cpo_trainer.py, CPOTrainer (alpha = 0, no AlphaPO):
      concatenated_forward: logps averaged over the completion for loss_type ipo/simpo,
        summed otherwise; nll_loss = nn.CrossEntropyLoss over the flattened chosen half with
        the prompt labels -100 (a token-weighted mean over the chosen responses), 0 when
        cpo_alpha == 0;
      cpo_loss: logits = chosen - rejected (simpo: minus gamma/beta);
        sigmoid/simpo: -(1-eps) logsigmoid(beta*logits) - eps logsigmoid(-beta*logits);
      get_batch_loss_metrics: loss = mean(losses) + cpo_alpha * nll_loss; rewards = beta *
        policy logps; nll_loss logged.

TRL needs torch (not installed here); like oracles/orpo_reference.py this port starts from
per-token log-probabilities and builds TRL's completion masks itself. It also gives the
gradient of the loss with respect to every per-token log-prob, analytically, and checks it
against float64 central differences before writing anything.

    oracles/.venv/bin/python oracles/preference_reference.py

Writes goldens/train/preference-reference.json: two seeded input sets (B = 1, and B = 4
pairs of unequal prompt and sequence lengths, zero-padded), the f32 per-token log-probs,
response masks and reference log-probs, and per case (objective and hyper-parameters) the
expected terms and d loss / d token log-probs.
"""

import json

import numpy as np

from provenance import golden_dir, provenance, write_json


def log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def response_mask(rows, t):
    """[2B, t-1]: target step s (token s of the row) is a completion target when
    prompt_len <= s < seq_len."""
    m = np.zeros((len(rows), t - 1))
    for i, (p, n) in enumerate(rows):
        m[i, p - 1:n - 1] = 1.0
    return m


def pair_scores(x, mask, average):
    sums = (x * mask).sum(-1)
    counts = mask.sum(-1)
    return (sums / counts if average else sums), sums, counts


def dpo(case, x, mask, ref):
    """DPOTrainer._compute_loss: terms and dL/dx."""
    beta, kind, eps = case["beta"], case["loss"], case.get("label_smoothing", 0.0)
    b = x.shape[0] // 2
    _, sums, counts = pair_scores(x, mask, False)
    c, r, nc, nr = sums[:b], sums[b:], counts[:b], counts[b:]
    dc, dr = c - ref[:b], r - ref[b:]
    delta = dc - dr
    z = beta * delta
    if kind == "sigmoid":
        losses = -log_sigmoid(z)
        g_c = -beta * sigmoid(-z)
        g_r = -g_c
    elif kind == "hinge":
        losses = np.maximum(1.0 - z, 0.0)
        g_c = np.where(1.0 - z > 0, -beta, 0.0)
        g_r = -g_c
    elif kind == "robust":
        losses = (-(1 - eps) * log_sigmoid(z) + eps * log_sigmoid(-z)) / (1 - 2 * eps)
        g_c = beta * (-(1 - eps) * sigmoid(-z) - eps * sigmoid(z)) / (1 - 2 * eps)
        g_r = -g_c
    elif kind == "ipo":
        u = dc / np.maximum(nc, 1.0) - dr / np.maximum(nr, 1.0) - 1.0 / (2 * beta)
        losses = u ** 2
        g_c = 2 * u / np.maximum(nc, 1.0)
        g_r = -2 * u / np.maximum(nr, 1.0)
    else:
        raise ValueError(kind)
    rc, rr = beta * dc, beta * dr
    terms = {"loss": losses.mean(), "rewards/chosen": rc.mean(), "rewards/rejected": rr.mean(),
             "rewards/accuracies": (rc > rr).mean(), "rewards/margins": (rc - rr).mean(),
             "logps/chosen": c.mean(), "logps/rejected": r.mean()}
    # d mean(losses) / d sums, then through the masked sum to each token
    g_rows = np.concatenate([g_c, g_r]) / b
    return terms, g_rows[:, None] * mask


def cpo(case, x, mask, ref):
    """CPOTrainer (loss_type sigmoid or simpo): terms and dL/dx."""
    beta, eps, alpha = case["beta"], case.get("label_smoothing", 0.0), case["cpo_alpha"]
    simpo = case["method"] == "simpo"
    b = x.shape[0] // 2
    scores, _, counts = pair_scores(x, mask, simpo)
    c, r = scores[:b], scores[b:]
    logits = c - r - (case["gamma"] / beta if simpo else 0.0)
    z = beta * logits
    losses = -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)
    g = beta * (-(1 - eps) * sigmoid(-z) + eps * sigmoid(z)) / b
    g_rows = np.concatenate([g, -g])
    if simpo:
        g_rows = g_rows / counts  # the mean's derivative
    grad = g_rows[:, None] * mask
    cm = mask[:b]
    if alpha == 0:
        nll = 0.0
    else:
        nll = -(x[:b] * cm).sum() / cm.sum()
        grad[:b] += alpha * (-cm / cm.sum())
    rc, rr = beta * c, beta * r
    terms = {"loss": losses.mean() + alpha * nll, "rewards/chosen": rc.mean(),
             "rewards/rejected": rr.mean(), "rewards/accuracies": (rc > rr).mean(),
             "rewards/margins": (rc - rr).mean(), "logps/chosen": c.mean(),
             "logps/rejected": r.mean(), "nll_loss": nll}
    return terms, grad


def terms_and_grad(case, x, mask, ref):
    return (dpo if case["method"] == "dpo" else cpo)(case, x, mask, ref)


def check_gradient(case, x, mask, ref):
    """The analytic gradient against central differences (float64); returns max |diff|."""
    _, grad = terms_and_grad(case, x, mask, ref)
    h = 1e-6
    worst = 0.0
    for idx in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[idx] += h
        down[idx] -= h
        num = (terms_and_grad(case, up, mask, ref)[0]["loss"]
               - terms_and_grad(case, down, mask, ref)[0]["loss"]) / (2 * h)
        worst = max(worst, abs(num - grad[idx]))
    return worst


CASES = [
    {"method": "dpo", "beta": 0.1, "loss": "sigmoid"},
    {"method": "dpo", "beta": 0.1, "loss": "hinge"},
    {"method": "dpo", "beta": 0.5, "loss": "hinge"},
    {"method": "dpo", "beta": 0.1, "loss": "ipo"},
    {"method": "dpo", "beta": 0.3, "loss": "robust", "label_smoothing": 0.2},
    {"method": "cpo", "beta": 0.1, "cpo_alpha": 1.0},
    {"method": "cpo", "beta": 0.2, "cpo_alpha": 0.5, "label_smoothing": 0.15},
    {"method": "simpo", "beta": 0.1, "cpo_alpha": 0.0, "gamma": 0.5},
    {"method": "simpo", "beta": 2.0, "cpo_alpha": 0.3, "gamma": 1.0, "label_smoothing": 0.1},
]


def input_set(rng, prompt_lens, lengths):
    """Seeded f32 per-token log-probs, masks and reference sums for pairs of the given
    prompt and [chosen, rejected] sequence lengths (zero-padded to the longest)."""
    t = max(max(l) for l in lengths)
    rows = [(p, l[0]) for p, l in zip(prompt_lens, lengths)] + \
           [(p, l[1]) for p, l in zip(prompt_lens, lengths)]
    logps = (-rng.gamma(0.6, 1.5, size=(len(rows), t - 1))).astype(np.float32)
    mask = response_mask(rows, t)
    sums = (logps.astype(np.float64) * mask).sum(-1)
    # a reference near the policy, off by a few nats either way
    ref = (sums + rng.normal(0.0, 3.0, size=sums.shape)).astype(np.float32)
    return rows, logps, mask, ref


def main() -> None:
    rng = np.random.default_rng(42)
    sets = {
        "b1": input_set(rng, [3], [[10, 14]]),
        "b4": input_set(rng, [5, 9, 1, 3], [[17, 14], [24, 20], [12, 23], [7, 11]]),
    }
    out = {}
    for name, (rows, logps, mask, ref) in sets.items():
        x, r64 = logps.astype(np.float64), ref.astype(np.float64)
        cases = []
        for case in CASES:
            worst = check_gradient(case, x, mask, r64)
            assert worst < 1e-6, (name, case, worst)
            terms, grad = terms_and_grad(case, x, mask, r64)
            print(f"{name} {case}: gradient vs central differences max |diff| {worst:.2e}")
            cases.append({**case, "expected": {k: float(v) for k, v in terms.items()},
                          "grad": grad.tolist(), "fd_max_abs_diff": worst})
        out[name] = {"rows": rows, "token_logps": logps.tolist(),
                     "response_mask": mask.astype(np.float32).tolist(),
                     "reference": ref.tolist(), "cases": cases}
    write_json(golden_dir("train", portable=True) / "preference-reference.json", {
        "provenance": provenance("numpy", "numpy"),
        "generator": "oracles/preference_reference.py",
        "semantics": "trl 1.16.0 DPOTrainer._compute_loss (sigmoid, hinge, ipo, robust) and "
                     "CPOTrainer (sigmoid, simpo): terms and d loss / d per-token log-probs",
        "sets": out,
    })


if __name__ == "__main__":
    main()
