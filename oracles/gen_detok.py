"""Streaming-detokenizer goldens: the text mlx-lm 0.32.2 streams for a sequence of ids, piece
by piece, as `mlx_lm.generate` and `mlx_lm.server` emit it (`TokenizerWrapper.detokenizer`:
for our byte-level BPE tokenizer that is `BPEStreamingDetokenizer`; for the real tokenizers
it is BPE for Qwen3 / Llama 3.x and `SPMStreamingDetokenizer` for Gemma 3 (trim_space off)
and the converted Mistral ones).

    oracles/.venv/bin/python oracles/gen_detok.py [MODEL] [--out DIR]
    oracles/.venv/bin/python oracles/gen_detok.py FIXTURE --fixture [--out DIR]

With --fixture, FIXTURE is a real tokenizer fetched by scripts/fetch_fixtures.sh (qwen3,
gemma3, llama3.1, llama3.2, mistral-v1, mistral-v3, deepseek-v3, llama2, gpt-oss, …) and the cases are: gen_tokenize.py's
hand-written texts (scripts, code, emoji that SentencePiece spells in byte tokens, whitespace
runs, leading spaces, digit runs, tabs) and its 240 seeded generated texts, encoded without
special tokens; for deepseek-v3 (AS_WRITTEN), the hand-written texts its transformers encoding
loses, as the ids of its tokenizer.json as written; the same with a leading space; special tokens in
mid-stream; and 20 seeded random walks of 60 ids over the tokenizer's ids.

Cases: the greedy continuations of the L1 golden's prompts; text with multi-byte characters
(accents, CJK, an emoji split across byte tokens); added/special tokens in mid-stream; a
leading space at the start of the stream; ids past the tokenizer's vocabulary (a model's
padded embedding rows, which untrained models do emit); and 20 seeded random walks of 60
ids over the whole id range (split UTF-8 sequences, lone spaces, specials, padding). For each: the ids, the segment after every `add_token` (`last_segment`),
the segment `finalize` adds, and the final text.

Output: goldens/detok/<model>/index.json (a fixture's pins its tokenizer.json's sha256).
"""

import argparse
import json
import random
from pathlib import Path

from mlx_lm.tokenizer_utils import load as load_tokenizer

from gen_tokenize import HAND, SEED, fixture_dir, generated, sha256
from provenance import GOLDENS, golden_dir, provenance, resolve, write_json

TEXTS = {
    "multibyte": "Héllo, wörld — naïve café. 日本語のテキスト 🙂🚀 done.",
    "leading-space": " The sky is blue.",
}


def stream(tokenizer, ids):
    detok = tokenizer.detokenizer
    detok.reset()
    segments = []
    for i in ids:
        detok.add_token(i)
        segments.append(detok.last_segment)
    detok.finalize()
    return segments, detok.last_segment, detok.text


def added_ids(tokenizer):
    return sorted(t.id if hasattr(t, "id") else t for t in
                  tokenizer._tokenizer.added_tokens_decoder.keys())


def model_cases(name, tokenizer):
    model_dir = resolve(f"models/{name}")
    config = json.loads((model_dir / "config.json").read_text())
    vocab = len(tokenizer._tokenizer)
    padded = int(config["vocab_size"])
    l1 = json.loads((resolve(f"l1/{name}") / "index.json").read_text())
    cases = []
    for c in l1["cases"]:
        cases.append((f"greedy/{c['name']}", list(c["greedy_ids"])))
    for key, text in TEXTS.items():
        cases.append((key, tokenizer.encode(text, add_special_tokens=False)))
    plain = tokenizer.encode(" The robot fixed the clock.", add_special_tokens=False)
    special = added_ids(tokenizer)
    cases.append(("special-mid-stream", plain[:3] + special[:3] + plain[3:]))
    cases.append(("padding-ids", plain[:2] + [vocab, padded - 1, vocab + 5] + plain[2:]))
    rng = random.Random(7)
    for k in range(20):
        cases.append((f"random-walk/{k}", [rng.randrange(padded) for _ in range(60)]))
    settings = {"tokenizer_len": vocab, "model_vocab_size": padded}
    return cases, settings


# Fixtures whose transformers encoding loses text (DeepSeek V3's byte-level tokenizer.json
# rebuilt as LlamaTokenizer drops spaces, tabs and emoji), while a model trained on the file
# emits its byte-level ids: their golden adds, for each hand-written text so lost, the ids of
# the file as written (tokenizers' own encoding), streamed through mlx-lm's detokenizer.
AS_WRITTEN = ["deepseek-v3"]


def as_written_cases(tokenizer, src):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(src / "tokenizer.json"))
    cases = []
    for k, text in enumerate(t for t in HAND if t.strip()):
        if tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) != text:
            cases.append((f"as-written/{k}", raw.encode(text, add_special_tokens=False).ids))
    return cases


def fixture_cases(tokenizer, src, name):
    vocab = len(tokenizer._tokenizer)
    cases = []
    for k, text in enumerate(t for t in HAND if t.strip()):
        cases.append((f"text/{k}", tokenizer.encode(text, add_special_tokens=False)))
    if name in AS_WRITTEN:
        cases += as_written_cases(tokenizer, src)
    for k, text in enumerate(t for t in generated(random.Random(SEED), 240) if t.strip()):
        cases.append((f"generated/{k}", tokenizer.encode(text, add_special_tokens=False)))
    for key, text in TEXTS.items():
        cases.append((key, tokenizer.encode(text, add_special_tokens=False)))
    plain = tokenizer.encode(" The robot fixed the clock.", add_special_tokens=False)
    special = added_ids(tokenizer)
    picks = random.Random(5).sample(special, min(4, len(special)))
    cases.append(("special-mid-stream", plain[:3] + picks + plain[3:]))
    cases.append(("special-first", picks[:1] + plain))
    rng = random.Random(7)
    for k in range(20):
        cases.append((f"random-walk/{k}", [rng.randrange(vocab) for _ in range(60)]))
    settings = {"tokenizer_len": vocab, "tokenizer_json_sha256": sha256(src / "tokenizer.json")}
    return cases, settings


def main(name, out_root, fixture=False) -> None:
    src = fixture_dir(name) if fixture else resolve(f"models/{name}")
    tokenizer = load_tokenizer(src)
    if fixture:
        cases, settings = fixture_cases(tokenizer, src, name)
    else:
        cases, settings = model_cases(name, tokenizer)
    records = []
    for case_name, ids in cases:
        segments, final, text = stream(tokenizer, ids)
        records.append({"name": case_name, "ids": ids, "segments": segments,
                        "finalize": final, "text": text})
        print(f"{case_name}: {len(ids)} ids -> {text!r}")
    # A fixture's golden is pure text processing, the same on every machine: no machine layer.
    here = GOLDENS / "detok" / name if fixture else golden_dir(f"detok/{name}")
    dest = Path(out_root) / name if out_root else here
    dest.mkdir(parents=True, exist_ok=True)
    detok = tokenizer.detokenizer
    write_json(dest / "index.json", {
        "provenance": provenance("mlx-lm", "mlx-lm"),
        "generator": "oracles/gen_detok.py",
        ("fixture" if fixture else "model"): name if fixture else f"models/{name}",
        "settings": {"detokenizer": type(detok).__name__,
                     **({"trim_space": detok.trim_space} if hasattr(detok, "trim_space") else {}),
                     **settings},
        "cases": records,
    })
    print(f"detok/{name} -> {dest}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="tiny-llama-trained")
    ap.add_argument("--out", help="write <out>/<model>/ instead of the goldens (live diffs)")
    ap.add_argument("--fixture", action="store_true",
                    help="MODEL is a real tokenizer fixture (scripts/fetch_fixtures.sh)")
    args = ap.parse_args()
    main(args.model, args.out, args.fixture)
