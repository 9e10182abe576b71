"""What the tiny-model makers (oracles/make_*.py) share, and the one CLI that runs them.

    oracles/.venv/bin/python oracles/make_models.py [NAME ...] [--only NAME ...] [--out DIR] [--list]

goldens/models/manifest.json lists every tiny model under goldens/models/, one row each:
`name` (its dir), `maker` (`module:function` in oracles/), `seed` (the seed its weights are
drawn from, passed to the maker; null for a model derived from another one without drawing),
`model_type` (its config.json's), `needs` (the models it is made from, made first), `gates`
(the parity gates whose models it is: the harness's gate table reads its model lists from
here) and `fixture_of` (the gates that load it besides their models, e.g. a drafter). The CLI makes the rows it is
asked for (all of them without names) in that order, each into a fresh dir: under goldens/
as provenance.golden_dir places it, or under `--out DIR` (where the models it needs are read
from too, when they are there).

Imports go one way: provenance <- tinymodels <- make_<family>.py (the makers) <- make_models.py
(the CLI over every maker). A maker script run by itself (`make_rope.py [NAME ...]`) is the
same CLI over its own rows.

Shared here: the byte-level BPE tokenizer of the tiny models (vocab 1024, trained on
oracles/corpus.txt) and its two chat templates, the base configs other families derive theirs
from (llama, qwen3, gemma3_text, gemma4_text), seeded construction through mlx-lm's own
Model/ModelArgs classes, and the writers every maker ends with: `write_model` (weights,
config, tokenizer, generation config, provenance, then the maker's check of what it wrote) and
`write_quantized` (mlx-lm's save_model/save_config next to the source's tokenizer files).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.utils import quantize_model, save_config, save_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from provenance import GOLDENS, golden_dir, provenance, resolve, write_json

HERE = Path(__file__).resolve().parent
MANIFEST = GOLDENS / "models" / "manifest.json"
CORPUS = (HERE / "corpus.txt").read_text()
VOCAB = 1024
SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
           "<|im_start|>", "<|im_end|>"]
# What a derived model copies from the one it is made from.
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
# The generator a model's provenance names unless its maker says otherwise.
GENERATOR = "oracles/make_models.py"

# Llama-style turns: bos, then <|role|>\ncontent<|end|>\n per message.
LLAMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] | trim }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# ChatML-style turns (Qwen): no bos; a default system line when none is given.
QWEN_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful robot.<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ---- the shared tokenizer ----

def qa_pairs():
    for line in CORPUS.splitlines():
        if line.startswith("Question:") and " Answer: " in line:
            q, a = line.removeprefix("Question: ").split(" Answer: ")
            yield q.strip(), a.strip()


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    return tok


@functools.cache
def shared_tokenizer() -> Tokenizer:
    """Trained once per run, for every maker that asks (deterministic: the same each run)."""
    return train_tokenizer()


def write_tokenizer(tok: Tokenizer, dest: Path, style: str) -> dict:
    tok = Tokenizer.from_str(tok.to_str())
    if style == "llama":
        bos = tok.token_to_id("<|bos|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)]
        )
        cfg = {"bos_token": "<|bos|>", "eos_token": "<|end|>", "chat_template": LLAMA_TEMPLATE}
        eos = ["<|end|>", "<|eos|>"]
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        cfg = {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": QWEN_TEMPLATE}
        eos = ["<|im_end|>", "<|eos|>"]
    tok.save(str(dest / "tokenizer.json"))
    write_json(dest / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": "<|pad|>",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        **cfg,
    })
    return {"eos_token_id": [tok.token_to_id(t) for t in eos],
            "bos_token_id": tok.token_to_id("<|bos|>") if style == "llama" else None}


# ---- base configs (other families derive theirs from these) ----

def llama_config(hidden, layers, heads, kv_heads, inter, rope_scaling, tie) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "rope_theta": 500000.0 if rope_scaling else 10000.0, "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie, "attention_bias": False, "mlp_bias": False,
    }


def qwen3_config() -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 160,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "rope_theta": 1000000.0, "tie_word_embeddings": True,
    }


def gemma3_config() -> dict:
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 16,
        "sliding_window": 8, "sliding_window_pattern": 2,
    }


GEMMA4_ROPE = {
    "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
    "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0, "rope_type": "default"},
}


def gemma4_config(**over) -> dict:
    cfg = {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
        "hidden_size": 64, "num_hidden_layers": 6, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "global_head_dim": 32,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": 16, "num_kv_shared_layers": 3, "use_double_wide_mlp": True,
        "sliding_window": 8, "sliding_window_pattern": 3, "max_position_embeddings": 4096,
        "rope_parameters": GEMMA4_ROPE, "final_logit_softcapping": 10.0,
        "attention_k_eq_v": False, "enable_moe_block": False, "tie_word_embeddings": True,
    }
    cfg.update(over)
    # Spelled out, so every reader of config.json (mlx-lm, transformers, us) agrees.
    pattern = cfg["sliding_window_pattern"]
    cfg["layer_types"] = ["full_attention" if i % pattern == pattern - 1 else "sliding_attention"
                          for i in range(cfg["num_hidden_layers"])]
    return cfg


# Gemma 4 with K = V on full-attention layers (their own KV head count), no per-layer inputs,
# no KV sharing, layers s f s f, untied: the large Gemma 4s' text model (tiny-gemma4-keqv,
# tiny-gemma4-mm-mlx; tiny-gemma4-moe ties it again).
GEMMA4_KEQV = dict(num_hidden_layers=4, sliding_window_pattern=2, num_key_value_heads=2,
                   num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=0,
                   hidden_size_per_layer_input=0, use_double_wide_mlp=False,
                   final_logit_softcapping=30.0, tie_word_embeddings=False)


# ---- seeded models ----

def random_model(module, config: dict, seed: int, dtype):
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def randomize_scales(model, seed: int) -> None:
    """Norm weights and layer scalars initialise to ones; make them differ from one so a
    dropped or misplaced norm or scalar changes the logits."""
    params = tree_flatten(model.parameters())
    updates = []
    for i, (name, v) in enumerate(params):
        if name.endswith("norm.weight") or name.endswith("layer_scalar"):
            noise = mx.random.normal(v.shape, key=mx.random.key(seed * 1000 + i)) * 0.3
            updates.append((name, (1.0 + noise).astype(v.dtype)))
    model.load_weights(updates, strict=False)
    mx.eval(model.parameters())


def weights_of(model, drop: tuple = ()) -> dict:
    """The model's parameters by name, less `drop` (a tied head's lm_head.weight)."""
    return {k: v for k, v in tree_flatten(model.parameters()) if k not in drop}


# ---- one model's job ----

class Job:
    """One manifest row being made: its name, its seed, where it goes and what it reads."""

    def __init__(self, row: dict, out: Path | None) -> None:
        self.name = row["name"]
        self.seed = row["seed"]
        self.needs = row["needs"]
        self.out = out

    @property
    def tok(self) -> Tokenizer:
        return shared_tokenizer()

    def dest(self, reference: bool = False) -> Path:
        """A fresh empty dir for this model: under --out, else golden_dir's (or, with
        `reference`, always the reference set's: a model that is an input, not a golden)."""
        if self.out is not None:
            dest = self.out / self.name
        elif reference:
            dest = GOLDENS / "models" / self.name
        else:
            dest = golden_dir(f"models/{self.name}")
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        return dest

    def source(self, name: str) -> Path:
        """Where model `name` (one of this row's `needs`) is read from: --out when it was
        made there, else this machine's goldens."""
        assert name in self.needs, f"{self.name}: reads {name}, which its manifest row does not list in needs"
        if self.out is not None and (self.out / name).is_dir():
            return self.out / name
        return resolve(f"models/{name}")


# ---- writers ----

def write_provenance(dest: Path, notes: str, generator: str = GENERATOR, oracle: str = "mlx-lm") -> None:
    write_json(dest / "provenance.json", {"provenance": provenance(oracle, oracle),
                                          "generator": generator, "notes": notes})


def write_model(job: Job, weights: dict | None, config: dict, notes: str, style: str = "llama",
                generator: str = GENERATOR, check: Callable[[Path], None] | None = None,
                save: Callable[[Path], None] | None = None) -> Path:
    """A model dir as the tiny models are laid out: model.safetensors (`weights`, MLX's
    metadata) and config.json, or what `save` writes in their place (mlx-lm's own writers);
    the shared tokenizer in `style` ("llama" or "qwen": its special tokens and chat
    template), generation_config.json and provenance.json; then `check` of the written dir,
    if any (it raises when the dir is not what was meant)."""
    dest = job.dest()
    if save is None:
        mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
        write_json(dest / "config.json", config)
    else:
        save(dest)
    tok_info = write_tokenizer(job.tok, dest, style)
    write_json(dest / "generation_config.json", {
        "bos_token_id": tok_info["bos_token_id"], "eos_token_id": tok_info["eos_token_id"],
        "do_sample": False,
    })
    write_provenance(dest, notes, generator)
    if check is not None:
        check(dest)
    return dest


def load_source(job: Job, name: str):
    """mlx_lm.load of model `name`: (model, config)."""
    model, _, config = load(str(job.source(name)), return_config=True)
    return model, config


def write_quantized(job: Job, src: str, model, qconfig: dict, notes: str, generator: str) -> Path:
    """A quantized model as mlx_lm.convert writes one (save_model, save_config) next to
    copies of `src`'s tokenizer files."""
    dest = job.dest()
    save_model(dest, model)
    save_config(qconfig, dest / "config.json")
    for f in TOKENIZER_FILES:
        shutil.copy(job.source(src) / f, dest / f)
    write_provenance(dest, notes, generator)
    return dest


def quantize(job: Job, src: str, notes: str, generator: str, group_size: int | None = None,
             bits: int | None = None, mode: str = "affine", predicate=None, dtype=None,
             dense: str | None = None) -> Path:
    """`src` (cast to `dtype` first, if given) through mlx_lm.utils.quantize_model, written by
    write_quantized. `dense`, a module `predicate` keeps unquantized, is recorded with an
    explicit `false` (mlx-lm records only the quantized paths), so that the per-module `false`
    form is exercised too."""
    model, config = load_source(job, src)
    if dtype is not None:
        model.set_dtype(dtype)
    model, qconfig = quantize_model(model, config, group_size, bits, mode=mode, quant_predicate=predicate)
    if dense is not None:
        qconfig["quantization"][dense] = False
        qconfig["quantization_config"] = qconfig["quantization"]
    return write_quantized(job, src, model, qconfig, notes, generator)


def loads_back(saved: dict) -> Callable[[Path], None]:
    """A check for write_model: mlx_lm.load of the dir gives back exactly `saved` (names as
    the model names them, after mlx-lm's sanitize)."""
    def check(dest: Path) -> None:
        loaded, _ = load(str(dest))
        for k, v in tree_flatten(loaded.parameters()):
            assert mx.array_equal(v, saved[k]).item(), k
    return check


# ---- the manifest and the CLI ----

def load_manifest() -> list[dict]:
    rows = json.loads(MANIFEST.read_text())
    names = [r["name"] for r in rows]
    assert names == sorted(set(names)), f"{MANIFEST}: rows not sorted by name, or a name twice"
    for r in rows:
        for n in r["needs"]:
            assert n in names, f"{MANIFEST}: {r['name']} needs {n}, which has no row"
    dirs = sorted(p.name for p in MANIFEST.parent.iterdir() if p.is_dir())
    unlisted = [d for d in dirs if d not in names]
    assert not unlisted, f"{MANIFEST}: no row for goldens/models/{unlisted}"
    return rows


def maker_of(row: dict, modules: dict[str, ModuleType]) -> Callable[[Job], None] | None:
    """The row's maker function, when its module is one of `modules`."""
    module, function = row["maker"].split(":")
    if module not in modules:
        return None
    maker = getattr(modules[module], function, None)
    assert callable(maker), f"{MANIFEST}: {row['name']}'s maker {row['maker']} does not exist"
    return maker


def build_order(rows: list[dict], chosen: list[str]) -> list[dict]:
    """`chosen` in manifest order, each after those of its `needs` that are chosen too."""
    by_name = {r["name"]: r for r in rows}
    order: list[dict] = []

    def visit(name: str) -> None:
        row = by_name[name]
        if row in order:
            return
        for n in row["needs"]:
            if n in chosen:
                visit(n)
        order.append(row)

    for r in rows:
        if r["name"] in chosen:
            visit(r["name"])
    return order


def main(modules: dict[str, ModuleType], argv: list[str] | None = None) -> None:
    """The CLI over the manifest rows whose makers are in `modules` (name -> module)."""
    parser = argparse.ArgumentParser(description="Make tiny models listed in goldens/models/manifest.json.")
    parser.add_argument("names", nargs="*", help="models to make (default: every row this script makes)")
    parser.add_argument("--only", nargs="+", default=[], metavar="NAME", help="the same as NAME ...")
    parser.add_argument("--out", type=Path, help="write the models under DIR (default: goldens/)")
    parser.add_argument("--list", action="store_true", help="print the rows this script makes, and stop")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    rows = load_manifest()
    makers = {r["name"]: maker_of(r, modules) for r in rows}
    mine = [n for n, m in makers.items() if m is not None]
    asked = args.names + args.only
    unknown = [n for n in asked if n not in makers]
    if unknown:
        parser.error(f"not in {MANIFEST}: {', '.join(unknown)}")
    elsewhere = [n for n in asked if n not in mine]
    if elsewhere:
        parser.error(f"made by another script (oracles/make_models.py makes every row): {', '.join(elsewhere)}")
    order = build_order(rows, asked or mine)
    if args.list:
        for r in order:
            print(f"{r['name']:34} {r['maker']:44} seed {r['seed']}  needs {r['needs']}")
        return

    mx.set_default_device(mx.cpu)
    out = args.out.resolve() if args.out else None
    for row in order:
        job = Job(row, out)
        dest = makers[row["name"]](job)
        size = sum(f.stat().st_size for f in dest.iterdir())
        print(f"{dest}: {size / 1e6:.2f} MB")
