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
carry. Run by `make_models.py NAME` (needs tiny-gemma4-assistant).
"""

import copy
import json
import shutil

import mlx.core as mx
from mlx.utils import tree_flatten
from optiq.runtime.spec import GemmaAssistantDrafter
from optiq.runtime.spec.drafters.gemma_assistant import GemmaAssistantConfig, _rename_weights

from provenance import golden_dir, provenance, resolve, write_json

BASE = "tiny-gemma4-assistant"
CENTROIDS, TOP_K = 32, 4
HF_NAMES = {"model_embed_tokens.weight": "model.embed_tokens.weight",
            "model_norm.weight": "model.norm.weight", "centroid_weight": "masked_embedding.centroids.weight",
            "token_ordering": "masked_embedding.token_ordering"}


def base():
    """The committed drafter's config and its tensors (HF names)."""
    src = resolve(f"models/{BASE}")
    return json.loads((src / "config.json").read_text()), mx.load(str(src / "model.safetensors"))


def set_tied(cfg: dict, tied: bool) -> dict:
    cfg = copy.deepcopy(cfg)
    cfg["tie_word_embeddings"] = tied
    cfg["text_config"]["tie_word_embeddings"] = tied
    return cfg


def save(name: str, cfg: dict, drafter: GemmaAssistantDrafter, extra: dict, notes: str) -> None:
    """`drafter`'s parameters (plus `extra`, HF-named tensors its class has no slot for) under
    the HF names optiq's loader reads, with `cfg` as config.json."""
    dest = golden_dir(f"models/{name}")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    weights = {HF_NAMES.get(k, "model." + k if k.startswith("layers.") else k): v
               for k, v in tree_flatten(drafter.parameters())}
    weights.update(extra)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_json(dest / "config.json", cfg)
    write_json(dest / "provenance.json", {
        "provenance": provenance("mlx-optiq", "mlx-optiq"), "generator": "oracles/make_assistants.py",
        "notes": notes})


def built(cfg: dict, weights: dict) -> GemmaAssistantDrafter:
    """optiq's drafter for `cfg` with `weights` (HF names) loaded as from_pretrained does."""
    drafter = GemmaAssistantDrafter(GemmaAssistantConfig.from_dict(cfg))
    drafter.load_weights(list(_rename_weights(weights).items()), strict=False)
    mx.eval(drafter.parameters())
    return drafter


def make_centroid(_tok=None) -> None:
    cfg, weights = base()
    cfg = copy.deepcopy(cfg)
    cfg.update(use_ordered_embeddings=True, num_centroids=CENTROIDS, centroid_intermediate_top_k=TOP_K)
    embed = weights["model.embed_tokens.weight"]
    vocab = embed.shape[0]
    mx.random.seed(25)
    ordering = mx.random.permutation(vocab).astype(mx.int64)
    groups = embed.astype(mx.float32)[ordering].reshape(CENTROIDS, vocab // CENTROIDS, -1)
    weights = dict(weights, **{"masked_embedding.token_ordering": ordering,
                               "masked_embedding.centroids.weight": groups.mean(axis=1).astype(embed.dtype)})
    drafter = built(cfg, weights)
    assert drafter.cfg.use_ordered_embeddings and drafter.cfg.vocab_per_centroid == vocab // CENTROIDS
    name = f"{BASE}-centroid"
    save(name, cfg, drafter, {}, f"{BASE} with optiq's centroid head: {CENTROIDS} centroids x "
         f"{vocab // CENTROIDS} tokens (token_ordering: mx.random.permutation, seed 25), each centroid the "
         f"mean of its tokens' embeddings, top {TOP_K}, bf16")
    GemmaAssistantDrafter.from_pretrained(str(golden_dir(f"models/{name}")))   # nothing missing


def make_lm_head(_tok=None) -> None:
    cfg, weights = base()
    embed = weights["model.embed_tokens.weight"]
    mx.random.seed(26)
    noise = mx.random.normal(embed.shape) * embed.astype(mx.float32).std()
    head = (embed.astype(mx.float32) + noise).astype(embed.dtype)
    drafter = built(set_tied(cfg, False), dict(weights, **{"lm_head.weight": head}))
    save(f"{BASE}-lm-head", set_tied(cfg, True), drafter, {},
         f"{BASE} with its own lm_head (the embedding plus N(0, std(embedding)) noise, seed 26, bf16) "
         "while config.json says tie_word_embeddings true: optiq 0.7.7 drafts with the embedding here")


def make_no_lm_head(_tok=None) -> None:
    cfg, weights = base()
    drafter = built(cfg, weights)
    save(f"{BASE}-no-lm-head", set_tied(cfg, False), drafter, {},
         f"{BASE}'s tensors (no lm_head: the tied embedding is the head) while config.json says "
         "tie_word_embeddings false: optiq 0.7.7 refuses it (lm_head missing from the checkpoint)")


ONLY = {f"{BASE}-centroid": make_centroid, f"{BASE}-lm-head": make_lm_head,
        f"{BASE}-no-lm-head": make_no_lm_head}

if __name__ == "__main__":
    import sys
    mx.set_default_device(mx.cpu)
    for n in sys.argv[1:] or ONLY:
        ONLY[n]()
