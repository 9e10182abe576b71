"""tiny-qwen3-embedding: a model laid out as Qwen3-Embedding is, for `/v1/embeddings`.

    oracles/.venv/bin/python oracles/make_models.py tiny-qwen3-embedding
    (or oracles/make_embedding.py: its row of goldens/models/manifest.json)

Architecture qwen3 (tiny-qwen3's config), drawn through mlx-lm's own Model/ModelArgs from the
row's seed, f32, with the norm weights moved off one (`randomize_scales`: with unit weights the
final RMSNorm would vanish under the L2 normalization, and a dropped final norm would go
unseen), saved by mlx-lm's own writers (save_model, save_config).

Beside it, the sentence-transformers files Qwen3-Embedding ships, written here from their
documented schema: modules.json (Transformer → Pooling → Normalize),
config_sentence_transformers.json (query/document prompts, cosine similarity),
sentence_bert_config.json, 1_Pooling/config.json (last-token pooling) and 2_Normalize/.
The tokenizer is the tiny models' shared byte-level BPE with Qwen3-Embedding's post-processor:
after the ByteLevel step a TemplateProcessing appends the end-of-text token (`<|eos|>` here,
`<|endoftext|>` there) to every encoded text, and the padding side is left (so the last token
of every row is its appended end-of-text token).
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import qwen3
from mlx_lm.utils import save_config, save_model
from tokenizers import Tokenizer, processors

import tinymodels
from provenance import write_json
from tinymodels import Job, qwen3_config, random_model, randomize_scales, write_model

GENERATOR = "oracles/make_embedding.py"
END = "<|eos|>"
QUERY_PROMPT = "Instruct: Given a question, retrieve passages that answer it\nQuery:"


def embedding_tokenizer(dest: Path) -> None:
    """Rewrites the qwen-style tokenizer write_model left in `dest` as Qwen3-Embedding's:
    the end-of-text token appended by the post-processor, padding on the left."""
    tok = Tokenizer.from_file(str(dest / "tokenizer.json"))
    end = tok.token_to_id(END)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"$A:0 {END}:0", pair=f"$A:0 {END}:0 $B:1 {END}:1",
                                      special_tokens=[(END, end)]),
    ])
    tok.save(str(dest / "tokenizer.json"))
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg.update({"pad_token": END, "padding_side": "left", "model_max_length": 4096})
    write_json(dest / "tokenizer_config.json", cfg)
    ids = Tokenizer.from_file(str(dest / "tokenizer.json")).encode("a short text").ids
    assert ids[-1] == end and ids.count(end) == 1, ids


def sentence_transformers_files(dest: Path, hidden: int) -> None:
    write_json(dest / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ])
    write_json(dest / "config_sentence_transformers.json", {
        "prompts": {"query": QUERY_PROMPT, "document": ""},
        "default_prompt_name": None,
        "similarity_fn_name": "cosine",
    })
    write_json(dest / "sentence_bert_config.json", {"max_seq_length": 4096, "do_lower_case": False})
    (dest / "1_Pooling").mkdir()
    write_json(dest / "1_Pooling" / "config.json", {
        "word_embedding_dimension": hidden,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": True,
        "include_prompt": True,
    })
    (dest / "2_Normalize").mkdir()
    # sentence-transformers' Normalize has no parameters; an empty folder is what it saves.
    (dest / "2_Normalize" / ".gitkeep").write_text("")


def make_qwen3_embedding(job: Job) -> Path:
    """tiny-qwen3-embedding: random f32 qwen3, scales off one, Qwen3-Embedding's files."""
    cfg = qwen3_config()
    model = random_model(qwen3, cfg, job.seed, mx.float32)
    randomize_scales(model, job.seed)

    def save(dest: Path) -> None:
        save_model(dest, model)
        save_config(dict(cfg), dest / "config.json")

    def check(dest: Path) -> None:
        embedding_tokenizer(dest)
        sentence_transformers_files(dest, cfg["hidden_size"])

    return write_model(job, None, cfg, f"random weights (seed {job.seed}), norm scales off one, f32, "
                       "mlx_lm.utils.save_model; Qwen3-Embedding's tokenizer post-processor and "
                       "sentence-transformers files", style="qwen", generator=GENERATOR, save=save, check=check)


if __name__ == "__main__":
    tinymodels.main({"make_embedding": sys.modules[__name__]})
