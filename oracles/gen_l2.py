"""L2 goldens: optiq 0.7.7's quantized-KV generation on the tiny models, logits included.

    oracles/.venv/bin/python oracles/gen_l2.py [MODEL ...] [--out DIR]

optiq's own code path, as its server runs a request sequentially: `install_mixed_kv` with
the model's mixed per-layer scheme (KV_CONFIGS below, written next to the golden as
kv_config.json), optiq's streaming KV conversion and its fused KV-tiled quantized SDPA
installed, `quantized_kv_start` 0, then mlx-lm's `generate_step` (which calls the patched
conversion hook after every prefill chunk and step). Prefill runs in chunks of 16 so that
later chunks attend to quantized caches (causal mask: fused kernel; a wrapped window's
explicit mask: mlx-lm's quantized SDPA), and a ~600-token prompt makes the fused kernel
span two 512-position tiles.

Cases and logits as gen_l1.py (same prompts plus the long one).
Output: goldens/l2/<model>/{index.json, logits.bin, kv_config.json}.
"""

import argparse
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

import optiq  # noqa: F401  (registers optiq's model patches)
from optiq.runtime.fused_quant_sdpa import install as install_fused_sdpa
from optiq.runtime.kv.rotating import _reassert_sdpa
from optiq.runtime.streaming_kv_quant import install as install_streaming_kv
from optiq.serve import _load_kv_config, install_mixed_kv
from mlx_lm import load
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models.cache import make_prompt_cache
from transformers import AutoTokenizer

import mlx_lm.generate  # noqa: F401
from gen_l1 import CHATS, GREEDY_STEPS, LOGIT_STEPS, RAW_PROMPTS
from provenance import TensorFile, golden_dir, provenance, resolve, write_json

GENERATE = sys.modules["mlx_lm.generate"]
PREFILL_STEP = 16
LONG_TOKENS = 600
# Layers left out stay dense (optiq's rule); group sizes must divide the head dim (≥ 32).
KV_CONFIGS = {
    "tiny-llama-trained": [{"layer_idx": 0, "bits": 8, "group_size": 32},
                           {"layer_idx": 2, "bits": 4, "group_size": 32}],
    "tiny-gemma3-kv": [{"layer_idx": 0, "bits": 4, "group_size": 32},
                       {"layer_idx": 1, "bits": 8, "group_size": 32},
                       {"layer_idx": 2, "bits": 8, "group_size": 32}],
    "tiny-gemma4": [{"layer_idx": 2, "bits": 4, "group_size": 32}],
}
MODELS = list(KV_CONFIGS)


def run(model, prompt_ids):
    captured = []

    def capture(tokens, logits):
        captured.append(logits)
        return logits

    cache = make_prompt_cache(model)
    ids = []
    for token, _ in GENERATE.generate_step(mx.array(prompt_ids), model, max_tokens=GREEDY_STEPS,
                                           prompt_cache=cache, kv_bits=8, kv_group_size=64,
                                           quantized_kv_start=0, prefill_step_size=PREFILL_STEP,
                                           logits_processors=[capture]):
        ids.append(int(token))
    kinds = sorted({f"{type(c).__name__}:{getattr(c, 'bits', '-')}" for c in cache})
    logits = [l.astype(mx.float32).reshape(-1) for l in captured[:LOGIT_STEPS]]
    mx.eval(logits)
    return ids, logits, kinds


FUSED_CALLS = [0]


def count_fused_calls() -> None:
    """Counts optiq's fused kernel runs (recorded in the golden as proof the path ran)."""
    import optiq.runtime.fused_quant_sdpa as fused
    inner = fused._prefill_flashattn_n_tiled

    def counted(*args, **kwargs):
        FUSED_CALLS[0] += 1
        return inner(*args, **kwargs)

    fused._prefill_flashattn_n_tiled = counted


def main(names, out_root) -> None:
    if len(names) > 1:
        # optiq's installs patch module globals; one process per model keeps them clean.
        for name in names:
            subprocess.run([sys.executable, __file__, name, *(["--out", out_root] if out_root else [])],
                           check=True)
        return
    mx.set_default_device(mx.cpu)
    install_streaming_kv()
    install_fused_sdpa()
    count_fused_calls()
    for name in names:
        path = resolve(f"models/{name}")
        dest = Path(out_root) / name if out_root else golden_dir(f"l2/{name}")
        dest.mkdir(parents=True, exist_ok=True)
        write_json(dest / "kv_config.json", KV_CONFIGS[name])
        # One install per model: the patched hook closes over this model's scheme.
        install_mixed_kv(kv_configs=_load_kv_config(str(dest / "kv_config.json")), quantized_kv_start=0)
        model, _ = load(str(path))
        _reassert_sdpa(mlx_lm_base, model)
        hf = AutoTokenizer.from_pretrained(str(path))
        out = TensorFile()
        cases = []
        prompts = [("raw", f"raw{i}", hf.encode(t, add_special_tokens=True), {"prompt": t})
                   for i, t in enumerate(RAW_PROMPTS)]
        for i, messages in enumerate(CHATS):
            rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            prompts.append(("chat", f"chat{i}", hf.encode(rendered, add_special_tokens=False),
                            {"messages": messages, "rendered": rendered}))
        long_text = (Path(__file__).resolve().parent / "corpus.txt").read_text()
        long_ids = hf.encode(long_text, add_special_tokens=True)[:LONG_TOKENS]
        prompts.append(("ids", "long0", long_ids, {}))
        all_kinds = set()
        for kind, case, ids, extra in prompts:
            greedy, logits, kinds = run(model, ids)
            all_kinds.update(kinds)
            cases.append({"name": case, "kind": kind, **extra, "prompt_ids": ids, "greedy_ids": greedy,
                          "logits": [out.add(f"{case}/{s}", l) for s, l in enumerate(logits)]})
        out.write(dest / "logits.bin")
        write_json(dest / "index.json", {
            "provenance": provenance("mlx-optiq", "mlx-optiq"),
            "generator": "oracles/gen_l2.py",
            "model": f"models/{name}",
            "data": "logits.bin",
            "settings": {"sampler": "greedy", "prefill_step_size": PREFILL_STEP,
                         "kv_config": "kv_config.json", "quantized_kv_start": 0,
                         "variant": "optiq serve, sequential generate_step: mixed KV + fused tiled SDPA",
                         "caches_after": sorted(all_kinds),
                         "optiq_fused_kernel_calls": FUSED_CALLS[0],
                         "logit_steps": LOGIT_STEPS, "greedy_steps": GREEDY_STEPS},
            "cases": cases,
        })
        print(f"{name}: {len(cases)} cases, caches {sorted(all_kinds)}, fused kernel calls "
              f"{FUSED_CALLS[0]} -> {dest}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=MODELS)
    ap.add_argument("--out", help="write <out>/<model>/ instead of the goldens (live diffs)")
    args = ap.parse_args()
    main(args.models, args.out)
