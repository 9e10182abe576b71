"""The head variants of the tiny Gemma 4 assistant drafter, made from tiny-gemma4-assistant
with optiq 0.7.7's own classes (`GemmaAssistantDrafter`, `GemmaAssistantConfig`):

- tiny-gemma4-assistant-centroid   the centroid output head of the small E2B/E4B drafters:
                                   32 centroids of 32 tokens (a seeded permutation of the
                                   vocab, seed 25), each centroid the mean embedding of its
                                   tokens, top-4 expanded; use_ordered_embeddings true
- tiny-gemma4-assistant-lm-head    its own lm_head (the tied embedding plus seeded noise,
                                   seed 26) while config.json says tie_word_embeddings true
                                   (optiq drafts with the embedding and never reads it)
- tiny-gemma4-assistant-no-lm-head no lm_head (the tied embedding is the head) while
                                   config.json says tie_word_embeddings false (optiq refuses
                                   it: a parameter missing from the checkpoint)

The two whose flags lie are the head-detection gate's pair: the head is the one the tensors
carry. Run by `make_models.py NAME`, or `make_assistants.py [NAME ...]` for its rows of
goldens/models/manifest.json (needs tiny-gemma4-assistant).
"""

import copy
import json
import sys
from pathlib import Path

import mlx.core as mx
from optiq.runtime.spec import GemmaAssistantDrafter
from optiq.runtime.spec.drafters.gemma_assistant import GemmaAssistantConfig, _rename_weights

import tinymodels
from provenance import write_json
from tinymodels import Job, weights_of, write_provenance

BASE = "tiny-gemma4-assistant"
CENTROIDS, TOP_K = 32, 4
HF_NAMES = {"model_embed_tokens.weight": "model.embed_tokens.weight",
            "model_norm.weight": "model.norm.weight", "centroid_weight": "masked_embedding.centroids.weight",
            "token_ordering": "masked_embedding.token_ordering"}


def base(job: Job):
    """The drafter's config and its tensors (HF names)."""
    src = job.source(BASE)
    return json.loads((src / "config.json").read_text()), mx.load(str(src / "model.safetensors"))


def set_tied(cfg: dict, tied: bool) -> dict:
    cfg = copy.deepcopy(cfg)
    cfg["tie_word_embeddings"] = tied
    cfg["text_config"]["tie_word_embeddings"] = tied
    return cfg


def save(job: Job, cfg: dict, drafter: GemmaAssistantDrafter, notes: str) -> Path:
    """`drafter`'s parameters under the HF names optiq's loader reads, with `cfg` as
    config.json."""
    dest = job.dest()
    weights = {HF_NAMES.get(k, "model." + k if k.startswith("layers.") else k): v
               for k, v in weights_of(drafter).items()}
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_json(dest / "config.json", cfg)
    write_provenance(dest, notes, "oracles/make_assistants.py", oracle="mlx-optiq")
    return dest


def built(cfg: dict, weights: dict) -> GemmaAssistantDrafter:
    """optiq's drafter for `cfg` with `weights` (HF names) loaded as from_pretrained does."""
    drafter = GemmaAssistantDrafter(GemmaAssistantConfig.from_dict(cfg))
    drafter.load_weights(list(_rename_weights(weights).items()), strict=False)
    mx.eval(drafter.parameters())
    return drafter


def make_centroid(job: Job) -> Path:
    cfg, weights = base(job)
    cfg = copy.deepcopy(cfg)
    cfg.update(use_ordered_embeddings=True, num_centroids=CENTROIDS, centroid_intermediate_top_k=TOP_K)
    embed = weights["model.embed_tokens.weight"]
    vocab = embed.shape[0]
    mx.random.seed(job.seed)
    ordering = mx.random.permutation(vocab).astype(mx.int64)
    groups = embed.astype(mx.float32)[ordering].reshape(CENTROIDS, vocab // CENTROIDS, -1)
    weights = dict(weights, **{"masked_embedding.token_ordering": ordering,
                               "masked_embedding.centroids.weight": groups.mean(axis=1).astype(embed.dtype)})
    drafter = built(cfg, weights)
    assert drafter.cfg.use_ordered_embeddings and drafter.cfg.vocab_per_centroid == vocab // CENTROIDS
    dest = save(job, cfg, drafter, f"{BASE} with optiq's centroid head: {CENTROIDS} centroids x "
                f"{vocab // CENTROIDS} tokens (token_ordering: mx.random.permutation, seed {job.seed}), each centroid "
                f"the mean of its tokens' embeddings, top {TOP_K}, bf16")
    GemmaAssistantDrafter.from_pretrained(str(dest))   # nothing missing
    return dest


def make_lm_head(job: Job) -> Path:
    cfg, weights = base(job)
    embed = weights["model.embed_tokens.weight"]
    mx.random.seed(job.seed)
    noise = mx.random.normal(embed.shape) * embed.astype(mx.float32).std()
    head = (embed.astype(mx.float32) + noise).astype(embed.dtype)
    drafter = built(set_tied(cfg, False), dict(weights, **{"lm_head.weight": head}))
    return save(job, set_tied(cfg, True), drafter,
                f"{BASE} with its own lm_head (the embedding plus N(0, std(embedding)) noise, seed {job.seed}, "
                "bf16) while config.json says tie_word_embeddings true: optiq 0.7.7 drafts with the embedding here")


def make_no_lm_head(job: Job) -> Path:
    cfg, weights = base(job)
    drafter = built(cfg, weights)
    return save(job, set_tied(cfg, False), drafter,
                f"{BASE}'s tensors (no lm_head: the tied embedding is the head) while config.json says "
                "tie_word_embeddings false: optiq 0.7.7 refuses it (lm_head missing from the checkpoint)")


if __name__ == "__main__":
    tinymodels.main({"make_assistants": sys.modules[__name__]})
