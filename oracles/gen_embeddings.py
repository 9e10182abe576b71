"""Goldens of `/v1/embeddings` on tiny-qwen3-embedding, from two oracles.

    oracles/.venv/bin/python oracles/gen_embeddings.py            # mlx: goldens/serve/embeddings-mlx.json
    /tmp/stvenv/bin/python oracles/gen_embeddings.py --st          # goldens/serve/embeddings-st.json
    (the sentence-transformers venv: oracles/requirements-embeddings.txt)

mlx (the bit-exact gate): mlx_lm.load of the model; each input alone through
`model.model(ids[None])` (mlx-lm's Qwen3Model: the hidden states after the final norm, before
the head), cast to float32, pooled (last token: h[-1]; mean: the mean over the tokens),
L2-normalized (v / sqrt(sum(v*v))); with `dimensions` d below the hidden size the normalized
vector's first d values normalized again. Texts are tokenized by the model's tokenizer with its special tokens (the
post-processor appends the end-of-text token, as sentence-transformers feeds the model); token
ids are fed as given. Each embedding is stored as base64 of its little-endian f32 bytes, as the
server answers with `encoding_format: "base64"`.

st (the cosine gate): sentence-transformers' `SentenceTransformer(dir).encode(texts)` (torch,
float32, its batching and left padding), last-token pooling as the model's 1_Pooling says; with
`truncate_dim` for the `dimensions` case; and its Transformer module → Pooling("mean") →
Normalize for the mean case. The token ids sentence-transformers fed the model
are stored too (the server's tokenization is checked against them).
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODEL = "tiny-qwen3-embedding"
GENERATOR = "oracles/gen_embeddings.py"

TEXTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "Question: what is the capital of France? Answer: Paris is the capital.",
]
# Each case: a request body (less `model`, `encoding_format`) and the server's pooling flag.
CASES = [
    {"name": "single", "pooling": "last", "body": {"input": TEXTS[1]}},
    {"name": "batch", "pooling": "last", "body": {"input": TEXTS}},
    {"name": "ids", "pooling": "last", "body": {"input": [[5, 17, 300, 42, 2], [9, 9], [1000]]}},
    {"name": "ids-flat", "pooling": "last", "body": {"input": [7, 8, 9, 10, 11]}},
    {"name": "dimensions", "pooling": "last", "body": {"input": TEXTS, "dimensions": 16}},
    {"name": "mean", "pooling": "mean", "body": {"input": TEXTS}},
    {"name": "mean-ids", "pooling": "mean", "body": {"input": [[5, 17, 300, 42, 2], [9, 9]]}},
]


def b64(v: np.ndarray) -> str:
    return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()


def inputs_of(body: dict) -> list:
    x = body["input"]
    if isinstance(x, str):
        return [x]
    if x and isinstance(x[0], int):
        return [x]
    return list(x)


def mlx_oracle(model_dir: Path) -> dict:
    import mlx.core as mx
    from mlx_lm import load

    sys.path.insert(0, str(HERE))
    from provenance import golden_dir, provenance

    mx.set_default_device(mx.cpu)
    model, tok = load(str(model_dir))

    def ids_of(x) -> list[int]:
        return tok._tokenizer(x)["input_ids"] if isinstance(x, str) else list(x)

    def normalize(v):
        return v / mx.sqrt(mx.sum(v * v))

    def embed(ids: list[int], pooling: str, dims: int | None):
        h = model.model(mx.array(ids)[None])[0].astype(mx.float32)
        v = h[-1] if pooling == "last" else mx.mean(h, axis=0)
        v = normalize(v)
        if dims is not None and dims < v.shape[-1]:
            v = normalize(v[:dims])
        mx.eval(v)
        return np.array(v)

    cases = []
    for case in CASES:
        ids = [ids_of(x) for x in inputs_of(case["body"])]
        vecs = [embed(i, case["pooling"], case["body"].get("dimensions")) for i in ids]
        cases.append({**case, "ids": ids, "prompt_tokens": sum(map(len, ids)),
                      "embeddings_base64": [b64(v) for v in vecs]})
    out = golden_dir("serve") / "embeddings-mlx.json"
    return out, {"provenance": provenance("mlx-lm", "mlx-lm"), "generator": GENERATOR, "model": MODEL,
                 "notes": "each input alone through model.model (final norm, no head), float32, pooled, "
                          "v / sqrt(sum(v*v)); dimensions: the first d normalized again",
                 "cases": cases}


def st_oracle(model_dir: Path) -> dict:
    import importlib.metadata as md
    import datetime as dt

    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling

    torch.manual_seed(0)
    last = SentenceTransformer(str(model_dir), device="cpu")
    assert isinstance(last[1], Pooling) and last[1].pooling_mode == "lasttoken", last
    # The same Transformer module (as the dir's sentence_bert_config.json configures it).
    word = last[0]
    mean = SentenceTransformer(modules=[word, Pooling(word.get_embedding_dimension(), "mean"), Normalize()],
                               device="cpu")
    cases = []
    for case in CASES:
        texts = inputs_of(case["body"])
        if not all(isinstance(t, str) for t in texts):
            continue  # sentence-transformers encodes texts only
        st = mean if case["pooling"] == "mean" else last
        dims = case["body"].get("dimensions")
        vecs = st.encode(texts, convert_to_numpy=True, batch_size=8, truncate_dim=dims)
        ids = [st.preprocess([t])["input_ids"][0].tolist() for t in texts]
        cases.append({**case, "ids": ids, "embeddings_base64": [b64(v) for v in vecs]})
    versions = {n: md.version(n) for n in ("sentence-transformers", "torch", "transformers", "tokenizers")}
    prov = {"oracle": "sentence-transformers", "oracle_version": versions["sentence-transformers"],
            "versions": versions, "command": " ".join(["python", *sys.argv]),
            "created": dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()}
    # Compared by cosine (>= 0.9999), not bit for bit: one file for every machine.
    out = REPO / "goldens" / "serve" / "embeddings-st.json"
    return out, {"provenance": prov, "generator": GENERATOR, "model": MODEL,
                 "notes": "SentenceTransformer(dir).encode(texts) (lasttoken per 1_Pooling; truncate_dim "
                          "for dimensions); mean: the model's Transformer module -> Pooling('mean') -> Normalize",
                 "cases": cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--st", action="store_true", help="the sentence-transformers oracle")
    args = parser.parse_args()
    model_dir = REPO / "goldens" / "models" / MODEL
    out, golden = st_oracle(model_dir) if args.st else mlx_oracle(model_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"{out}: {len(golden['cases'])} cases")


if __name__ == "__main__":
    main()
