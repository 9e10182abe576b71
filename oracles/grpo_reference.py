"""An independent GRPO reference in numpy (float64): the loss of trl 1.16.0's GRPOTrainer
(`trl/trainer/grpo_trainer.py`), ported from its formulas, from per-token log-probabilities.

    advantages (`_generate_and_score_completions`, multi_objective_aggregation
      "sum_then_normalize"): reward = Σ_k w_k r_k (a completion every function left
      unscored is NaN); per group of G completions of one prompt, the NaN-aware mean μ and
      Bessel-corrected std σ (trl's `nanstd`); A = r - μ, divided by (σ + 1e-4) unless
      scale_rewards is "none" ("batch": σ over the whole batch); NaN advantages become 0.
    `_compute_loss`, importance_sampling_level "token":
      ratio = exp(logp - old_logp)          (old_logp = logp detached when μ_iter = 1)
      clipped = clip(ratio, 1 - eps_low, 1 + eps_high)
      per_token = -min(ratio·A, clipped·A)  (+ beta·(exp(ref - logp) - (ref - logp) - 1))
      "grpo":    mean over rows of Σ_t per_token·mask / max(Σ_t mask, 1)
      "bnpo", "dapo" (one process, no accumulation): Σ per_token·mask / max(Σ mask, 1)
      "dr_grpo": Σ per_token·mask / (rows · max_completion_length)

TRL needs torch, which does not install into oracles/.venv; this port starts where its
`_get_per_token_logps_and_entropies` ends. The gradient with respect to the per-token
log-probabilities is derived by hand and checked here against float64 central differences.

    oracles/.venv/bin/python oracles/grpo_reference.py

Writes goldens/train/grpo-reference.json: seeded inputs and every case's expected terms,
advantages and d loss / d logp.
"""

import json

import numpy as np

from provenance import golden_dir, provenance, write_json


def nanstd(x, axis=None):
    mean = np.nanmean(x, axis=axis, keepdims=True)
    var = np.nanmean((x - mean) ** 2, axis=axis, keepdims=True)
    n = np.sum(~np.isnan(x), axis=axis, keepdims=True)
    corr = np.where(n > 1, n / np.maximum(n - 1, 1), np.nan)
    out = np.sqrt(var * corr)
    return out if axis is None else np.squeeze(out, axis=axis)


def advantages(per_func, weights, groups, scale):
    """per_func [N, K] (NaN: unscored), weights [K], groups of G = N / groups rows."""
    unscored = np.isnan(per_func).all(axis=1)
    r = np.nansum(per_func * weights[None, :], axis=1)
    r[unscored] = np.nan
    g = r.reshape(groups, -1)
    mu = np.repeat(np.nanmean(g, axis=1), g.shape[1])
    if scale == "batch":
        sd = np.full_like(r, nanstd(r))
    else:
        sd = np.repeat(nanstd(g, axis=1), g.shape[1])
    a = r - mu
    if scale != "none":
        a = a / (sd + 1e-4)
    return np.nan_to_num(a, nan=0.0), r


def per_token(lp, old, ref, adv, c):
    ratio = np.exp(lp - old)
    clipped = np.clip(ratio, 1 - c["eps_low"], 1 + c["eps_high"])
    a = adv[:, None]
    loss = -np.minimum(ratio * a, clipped * a)
    # d/dlp of -min(ratio·A, clipped·A): the unclipped branch when it is the min (or ties),
    # the clipped one otherwise, whose derivative is 0 outside the clip range.
    inside = (ratio >= 1 - c["eps_low"]) & (ratio <= 1 + c["eps_high"])
    takes_ratio = ratio * a <= clipped * a
    grad = np.where(takes_ratio | inside, -ratio * a, 0.0)
    kl = np.zeros_like(lp)
    if c["beta"] != 0.0:
        d = ref - lp
        kl = np.exp(d) - d - 1
        loss = loss + c["beta"] * kl
        grad = grad + c["beta"] * (1 - np.exp(d))
    return loss, grad, kl, ratio


def aggregate_weights(mask, c):
    """The weight each masked token's per-token loss gets in the scalar loss [N, T]."""
    n, _ = mask.shape
    if c["loss_type"] == "grpo":
        w = 1.0 / (n * np.maximum(mask.sum(-1, keepdims=True), 1.0))
        return mask * w
    if c["loss_type"] in ("bnpo", "dapo"):
        return mask / max(mask.sum(), 1.0)
    if c["loss_type"] == "dr_grpo":
        return mask / (n * c["max_completion_length"])
    raise ValueError(c["loss_type"])


def loss_of(lp, old, ref, adv, mask, c):
    ptl, _, _, _ = per_token(lp, old, ref, adv, c)
    return float((ptl * aggregate_weights(mask, c)).sum())


def terms(lp, old, ref, adv, mask, c):
    ptl, g, kl, ratio = per_token(lp, old, ref, adv, c)
    w = aggregate_weights(mask, c)
    masked_mean = lambda x: float((x * mask).sum() / max(mask.sum(), 1.0))
    a = adv[:, None]
    low = (ratio < 1 - c["eps_low"]) & (a < 0)
    high = (ratio > 1 + c["eps_high"]) & (a > 0)
    return {
        "loss": float((ptl * w).sum()),
        "kl": masked_mean(kl),
        "clip_ratio": masked_mean((low | high).astype(np.float64)),
        "grad": (g * w).tolist(),
    }


def check_grad(lp, old, ref, adv, mask, c, grad):
    h = 1e-6
    num = np.zeros_like(lp)
    for i in range(lp.shape[0]):
        for j in range(lp.shape[1]):
            up, dn = lp.copy(), lp.copy()
            up[i, j] += h
            dn[i, j] -= h
            num[i, j] = (loss_of(up, old, ref, adv, mask, c) - loss_of(dn, old, ref, adv, mask, c)) / (2 * h)
    err = np.abs(num - np.array(grad)).max()
    assert err < 1e-7, f"{c}: analytic gradient off by {err}"


def main() -> None:
    rng = np.random.default_rng(42)
    groups, g_size, t = 2, 4, 9
    n = groups * g_size
    lengths = [9, 3, 6, 1, 7, 9, 2, 5]  # completion tokens per row (right padding after)
    mask = np.array([[1.0 if j < l else 0.0 for j in range(t)] for l in lengths])
    lp = (-rng.gamma(0.7, 1.2, size=(n, t))).astype(np.float32)
    # old log-probs a few updates back (μ > 1): ratios on both sides of the clip range
    old = (lp + rng.normal(0.0, 0.25, size=(n, t))).astype(np.float32)
    ref = (lp + rng.normal(0.0, 0.4, size=(n, t))).astype(np.float32)
    # two reward functions; one completion unscored by both, one by the second only
    per_func = np.array([[1, 0.5], [0, 0.25], [1, np.nan], [0, 0.0],
                         [0, 0.75], [np.nan, np.nan], [1, 1.0], [0, 0.5]], dtype=np.float64)
    weights = np.array([1.0, 0.5])
    cases = []
    base = {"eps_low": 0.2, "eps_high": 0.2, "beta": 0.0, "loss_type": "dapo",
            "max_completion_length": t, "scale": "group", "old": "policy"}
    variants = [
        {},
        {"old": "given"},
        {"old": "given", "loss_type": "grpo"},
        {"old": "given", "loss_type": "bnpo", "eps_high": 0.28},
        {"old": "given", "loss_type": "dr_grpo", "beta": 0.04},
        {"beta": 0.04, "scale": "batch"},
        {"old": "given", "scale": "none"},
    ]
    x, xo, xr = (a.astype(np.float64) for a in (lp, old, ref))
    for v in variants:
        c = {**base, **v}
        adv, rewards = advantages(per_func, weights, groups, c["scale"])
        o = xo if c["old"] == "given" else x
        out = terms(x, o, xr, adv, mask, c)
        check_grad(x, o, xr, adv, mask, c, out["grad"])
        cases.append({"config": c, "advantages": adv.tolist(),
                      "rewards": [None if np.isnan(r) else r for r in rewards], **out})
    write_json(golden_dir("train", portable=True) / "grpo-reference.json", {
        "provenance": provenance("numpy", "numpy"),
        "generator": "oracles/grpo_reference.py",
        "semantics": "trl 1.16.0 GRPOTrainer: _generate_and_score_completions (sum_then_normalize) and _compute_loss (token level)",
        "groups": groups,
        "reward_weights": weights.tolist(),
        "rewards_per_func": [[None if np.isnan(v) else v for v in row] for row in per_func],
        "token_logps": lp.tolist(),
        "old_logps": old.tolist(),
        "ref_logps": ref.tolist(),
        "mask": mask.tolist(),
        "cases": cases,
    })
    print(json.dumps([{k: cs[k] for k in ("loss", "kl", "clip_ratio")} for cs in cases], indent=1))


if __name__ == "__main__":
    main()
