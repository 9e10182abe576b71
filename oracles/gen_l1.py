"""L1 goldens: mlx-lm 0.32.2 greedy generation on the tiny models, logits included.

    oracles/.venv/bin/python oracles/gen_l1.py [MODEL ...] [--out DIR] [--prefill-step N --suffix S]
        [--kv-bits B --kv-group-size G --quantized-kv-start S] [--long N]

With --kv-bits, mlx-lm's own KV quantization runs (QuantizedKVCache, converted by
generate_step's hook, read through mlx-lm's quantized SDPA): the L1 gate of
`engine generate --kv-quant 4|8`.

For each model in goldens/models/ and each prompt (raw text and chat turns) this records:
the prompt ids (transformers tokenizer; raw prompts with special tokens, chat prompts as
the rendered template without, as mlx_lm.generate does), the rendered chat string
(transformers apply_chat_template), the full-vocabulary logits at the prefill's last
position and at each of the first 16 decode steps (as f32), and 64 greedy ids. Generation
runs through mlx_lm.generate.generate_step itself with its standard KV cache; a pass-through
logits processor captures the logits it computes.

With --long N the golden has one case instead, `long0`: N ids (oracles/corpus.txt encoded
with special tokens, repeated until N), prefilled in chunks of --prefill-step: the `l1-long`
gate, where recurrent states cross prefill chunks and the scans' own chunks.

Output: goldens/l1/<model>/index.json + logits.bin (raw little-endian f32).
"""

import argparse
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from transformers import AutoTokenizer

from provenance import TensorFile, golden_dir, provenance, resolve, write_json
from make_moe import patch_gather_qmm

patch_gather_qmm()  # mlx-lm's QuantizedSwitchLinear on MLX 0.32.2 (see make_moe.py)
from make_rope import oracle_view
from tinymodels import load_manifest

# The L1 gate's models: the manifest's rows that name it (the harness reads the same rows).
MODELS = [row["name"] for row in load_manifest() if "l1" in row["gates"]]
RAW_PROMPTS = [
    "The little robot",
    "Question: What color is the grass? Answer:",
    "On Friday the robot went to the market. The market had apples, bread, cheese, flowers and tools. The robot bought",
]
CHATS = [
    [{"role": "user", "content": "What color is the sky?"}],
    [{"role": "system", "content": "You answer in one sentence."},
     {"role": "user", "content": "Who brought the broken clock?"},
     {"role": "assistant", "content": "Mira brought the broken clock."},
     {"role": "user", "content": "What does the robot like? ü ✓"}],
]
LOGIT_STEPS = 17   # prefill + 16 decode steps
GREEDY_STEPS = 64


def prompt_cases(hf, raw_prompts, chats):
    """Each prompt's case head, its ids made as mlx_lm.generate makes them: raw text encoded
    with special tokens, chat turns rendered (apply_chat_template, generation prompt on) and
    encoded without. The L1 and real-vocabulary goldens share it."""
    cases = []
    for i, text in enumerate(raw_prompts):
        cases.append({"name": f"raw{i}", "kind": "raw", "prompt": text,
                      "prompt_ids": hf.encode(text, add_special_tokens=True)})
    for i, messages in enumerate(chats):
        rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        cases.append({"name": f"chat{i}", "kind": "chat", "messages": messages, "rendered": rendered,
                      "prompt_ids": hf.encode(rendered, add_special_tokens=False)})
    return cases


def run(model, prompt_ids, prefill_step, kv=None):
    captured = []

    def capture(tokens, logits):
        captured.append(logits)
        return logits

    ids = []
    for token, _ in generate_step(mx.array(prompt_ids), model, max_tokens=GREEDY_STEPS,
                                  logits_processors=[capture], prefill_step_size=prefill_step,
                                  **(kv or {})):
        ids.append(int(token))
    logits = [l.astype(mx.float32).reshape(-1) for l in captured[:LOGIT_STEPS]]
    mx.eval(logits)
    return ids, logits


def long_case(hf, n):
    """One case of `n` ids: the corpus, encoded as a raw prompt, repeated to length."""
    text = (Path(__file__).resolve().parent / "corpus.txt").read_text()
    once = hf.encode(text, add_special_tokens=True)
    ids = (once * (n // len(once) + 1))[:n]
    return {"name": "long0", "kind": "ids", "prompt_ids": ids}


def main(names, out_root, prefill_step, suffix, kv=None, long=None) -> None:
    mx.set_default_device(mx.cpu)
    for name in names:
        path = resolve(f"models/{name}")
        model, _ = load(str(oracle_view(path)))   # rope_parameters flattened where mlx-lm ignores them
        hf = AutoTokenizer.from_pretrained(str(path))
        out = TensorFile()
        cases = [long_case(hf, long)] if long else prompt_cases(hf, RAW_PROMPTS, CHATS)
        for case in cases:
            greedy, logits = run(model, case["prompt_ids"], prefill_step, kv)
            case["greedy_ids"] = greedy
            case["logits"] = [out.add(f"{case['name']}/{s}", l) for s, l in enumerate(logits)]
        golden = name + suffix
        dest = Path(out_root) / golden if out_root else golden_dir(f"l1/{golden}")
        out.write(dest / "logits.bin")
        write_json(dest / "index.json", {
            "provenance": provenance("mlx-lm", "mlx-lm"),
            "generator": "oracles/gen_l1.py",
            "model": f"models/{name}",
            "data": "logits.bin",
            "settings": {"sampler": "greedy", "prefill_step_size": prefill_step,
                         "cache": "QuantizedKVCache" if kv else "KVCache", **(kv or {}),
                         "logit_steps": LOGIT_STEPS, "greedy_steps": GREEDY_STEPS},
            "cases": cases,
        })
        print(f"{golden}: {len(cases)} cases -> {dest}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=MODELS)
    ap.add_argument("--out", help="write <out>/<golden>/ instead of the goldens (live diffs)")
    ap.add_argument("--prefill-step", type=int, default=2048,
                    help="mlx-lm's prefill_step_size (chunked prefill); default 2048 as mlx-lm")
    ap.add_argument("--suffix", default="", help="golden name = model name + suffix")
    ap.add_argument("--kv-bits", type=int, help="mlx-lm's KV cache quantization (generate_step kv_bits)")
    ap.add_argument("--kv-group-size", type=int, default=64)
    ap.add_argument("--quantized-kv-start", type=int, default=0)
    ap.add_argument("--long", type=int, help="one case of this many ids instead (the l1-long gate)")
    args = ap.parse_args()
    kv = None
    if args.kv_bits:
        kv = {"kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size,
              "quantized_kv_start": args.quantized_kv_start}
    main(args.models, args.out, args.prefill_step, args.suffix, kv, args.long)
