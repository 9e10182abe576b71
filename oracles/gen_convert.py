"""Convert golden: what `mlx_lm convert` 0.32.2 writes, as sha256 per file and per tensor.

    HARNESS_WRITE_REFERENCE=1 oracles/.venv/bin/python oracles/gen_convert.py [--out DIR] [--only NAME,...]

`--only` reruns the named cases and keeps the others' records from the index as it is.

Sources (Hugging Face layout):
- `tiny-llama-hf` (committed under goldens/convert/): goldens/models/tiny-llama's weights
  in float32 with `torch_dtype: float32`, plus the `self_attn.rotary_emb.inv_freq` tables
  transformers checkpoints carry (llama's sanitize drops them);
- goldens/models/tiny-qwen3 and tiny-gemma4 as they are (mlx_lm.convert accepts them;
  gemma4_text's sanitize drops the KV-shared layers' k/v projections, absent already);
- the hybrids' tiny models as they are, each in Hugging Face's layout
  (oracles/make_hybrids.py): tiny-qwen3-5, -qwen3-5-mm (the multimodal layout) and
  -qwen3-5-moe (conv kernels [C, 1, K], (1 + w) norms stored as w, the MoE's fused
  experts), tiny-qwen3-next (per-expert tensors), tiny-lfm2 (short-conv kernels [C, 1, K]),
  tiny-nemotron-h and tiny-mamba2 (conv kernels [C, 1, K]; mamba2's config has
  `Infinity`), tiny-lfm2-moe (w1/w3/w2 and per-expert tensors), tiny-granite-h (fused
  `input_linear` experts), tiny-falcon-h1 (unfolded µP multipliers) and tiny-nemotron-h-moe
  (Nemotron 3's `E` blocks, per-expert tensors; its bf16 stacks do not run on the CPU, so its
  q4 case's weights are committed as tiny-nemotron-h-moe-q4 for the L1 gate): their sanitizes,
  `cast_predicate`s (A_log, expert_bias, e_score_correction_bias kept) and
  `quant_predicate`s (8-bit routers) all act.

Each case runs `python -m mlx_lm convert --hf-path SRC --mlx-path OUT ARGS...` in a
subprocess and records every output file's sha256 and size, the config.json object, and
for each safetensors file each tensor's dtype, shape and sha256 of its bytes (so the gate
names the first differing tensor); for the cases in GENERATE_CASES also mlx_lm.generate's
greedy text on the converted model. The outputs themselves are not stored.

Output: goldens/convert/index.json (+ goldens/convert/tiny-llama-hf/)
"""

import argparse
import hashlib
import json
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from provenance import golden_dir, provenance, resolve, write_json

HF_NAME = "tiny-llama-hf"

CASES = [
    ("llama-bf16", HF_NAME, ["--dtype", "bfloat16"]),
    ("llama-f32", HF_NAME, []),
    ("llama-q4-g64", HF_NAME, ["-q"]),
    ("llama-q8-g32", HF_NAME, ["-q", "--q-bits", "8", "--q-group-size", "32", "--dtype", "bfloat16"]),
    ("llama-mixed-3-6", HF_NAME, ["-q", "--quant-predicate", "mixed_3_6"]),
    ("llama-mixed-2-6-g32", HF_NAME, ["-q", "--quant-predicate", "mixed_2_6", "--q-group-size", "32"]),
    ("llama-mxfp4", HF_NAME, ["-q", "--q-mode", "mxfp4", "--dtype", "bfloat16"]),
    ("llama-nvfp4", HF_NAME, ["-q", "--q-mode", "nvfp4"]),
    ("llama-mxfp8", HF_NAME, ["-q", "--q-mode", "mxfp8", "--dtype", "float16"]),
    ("qwen2-q4-g32", "models/tiny-qwen2", ["-q", "--q-group-size", "32"]),
    ("gemma3-mixed-4-6", "models/tiny-gemma3", ["-q", "--quant-predicate", "mixed_4_6", "--q-group-size", "64"]),
    # tiny-llama-hf with config overrides (the case's "config_overrides"): a mistral
    # model_type (mlx-lm's llama class) with a tied head, so sanitize drops lm_head.
    ("mistral-tied-q4", HF_NAME, ["-q"]),
    ("qwen3-q4-g32", "models/tiny-qwen3", ["-q", "--q-group-size", "32"]),
    ("qwen3-f16", "models/tiny-qwen3", ["--dtype", "float16"]),
    ("gemma4-q8", "models/tiny-gemma4", ["-q", "--q-bits", "8"]),
    # The hybrids (no torch_dtype in their configs: no cast without --dtype).
    ("qwen3-5-bf16", "models/tiny-qwen3-5", []),
    ("qwen3-5-f16", "models/tiny-qwen3-5", ["--dtype", "float16"]),
    ("qwen3-5-q4", "models/tiny-qwen3-5", ["-q"]),
    ("qwen3-5-mixed-3-6", "models/tiny-qwen3-5", ["-q", "--quant-predicate", "mixed_3_6"]),
    # The multimodal checkpoint: `text_config`, a vision tensor dropped, `vision_config` too.
    ("qwen3-5-mm-q4", "models/tiny-qwen3-5-mm", ["-q"]),
    ("qwen3-5-moe-q4", "models/tiny-qwen3-5-moe", ["-q"]),
    ("qwen3-5-moe-f32", "models/tiny-qwen3-5-moe", []),
    ("qwen3-next-q4", "models/tiny-qwen3-next", ["-q"]),
    ("qwen3-next-bf16", "models/tiny-qwen3-next", ["--dtype", "bfloat16"]),
    ("qwen3-next-f32", "models/tiny-qwen3-next", []),
    ("lfm2-q4", "models/tiny-lfm2", ["-q"]),
    ("lfm2-f32", "models/tiny-lfm2", ["--dtype", "float32"]),
    ("nemotron-h-q4", "models/tiny-nemotron-h", ["-q"]),
    ("nemotron-h-f16", "models/tiny-nemotron-h", ["--dtype", "float16"]),
    # tiny-mamba2's config carries `"time_step_limit": [0.0, Infinity]`.
    ("mamba2-q4", "models/tiny-mamba2", ["-q"]),
    ("mamba2-f16", "models/tiny-mamba2", ["--dtype", "float16"]),
    # lfm2_moe: expert_bias stays float32 under --dtype (its cast_predicate), the routers
    # `feed_forward.gate` at 8 bits (its quant_predicate).
    ("lfm2-moe-q4", "models/tiny-lfm2-moe", ["-q"]),
    ("lfm2-moe-f32", "models/tiny-lfm2-moe", []),
    ("lfm2-moe-bf16", "models/tiny-lfm2-moe", ["--dtype", "bfloat16"]),
    # granitemoehybrid: fused experts split, the routers `router.layer` at 8 bits.
    ("granite-h-q4", "models/tiny-granite-h", ["-q"]),
    ("granite-h-f32", "models/tiny-granite-h", []),
    # falcon_h1: the µP multipliers folded into the weights in bf16 (as stored), then cast.
    ("falcon-h1-bf16", "models/tiny-falcon-h1", []),
    ("falcon-h1-f16", "models/tiny-falcon-h1", ["--dtype", "float16"]),
    ("falcon-h1-q4", "models/tiny-falcon-h1", ["-q"]),
    # nemotron_h with `E` blocks: experts stacked into switch_mlp.fc1 / fc2, the router a
    # plain module (not quantized), e_score_correction_bias kept float32.
    ("nemotron-h-moe-q4", "models/tiny-nemotron-h-moe", ["-q"]),
    ("nemotron-h-moe-f16", "models/tiny-nemotron-h-moe", ["--dtype", "float16"]),
    # olmo2: post-norm layers and whole-projection q/k norms (kept in the norms' cast).
    ("olmo2-q4", "models/tiny-olmo2", ["-q"]),
    ("olmo2-f16", "models/tiny-olmo2", ["--dtype", "float16"]),
    # gemma2: (1 + w) sandwich norms (declared input, pre-ff, post-ff, post-attention), tied.
    ("gemma2-q4", "models/tiny-gemma2", ["-q"]),
    ("gemma2-f32", "models/tiny-gemma2", ["--dtype", "float32"]),
    # smollm3: llama's sanitize (tied head dropped), its NoPE flags kept in the config.
    ("smollm3-q4", "models/tiny-smollm3", ["-q"]),
    ("smollm3-f16", "models/tiny-smollm3", ["--dtype", "float16"]),
    # Issue 38's families, each from its tiny model as it is (the MoEs in Hugging Face's
    # per-expert layout where their makers write one), in groups of 32 so that the expert
    # and latent projections narrower than 64 are quantized too.
    # deepseek_v3: experts stacked, kv_b_proj split into embed_q / unembed_out (MultiLinears,
    # quantized), the MoEGate router left as it is, e_score_correction_bias kept float32.
    ("deepseek-v3-q4-g32", "models/tiny-deepseek-v3", ["-q", "--q-group-size", "32"]),
    ("deepseek-v3-bf16", "models/tiny-deepseek-v3", ["--dtype", "bfloat16"]),
    # glm4_moe: experts stacked, the MTP layer (model.layers.{num_hidden_layers}) dropped.
    ("glm4-moe-q4-g32", "models/tiny-glm4-moe", ["-q", "--q-group-size", "32"]),
    ("glm4-moe-bf16", "models/tiny-glm4-moe", ["--dtype", "bfloat16"]),
    ("ministral3-q4", "models/tiny-ministral3", ["-q"]),
    # The multimodal wrappers: text weights under language_model., the towers dropped.
    ("mistral3-q4", "models/tiny-mistral3", ["-q"]),
    ("qwen3-vl-q4", "models/tiny-qwen3-vl", ["-q"]),
    ("olmo3-q4", "models/tiny-olmo3", ["-q"]),
    ("seed-oss-q4", "models/tiny-seed-oss", ["-q"]),
    ("exaone4-q4", "models/tiny-exaone4", ["-q"]),
    ("hunyuan-q4", "models/tiny-hunyuan", ["-q"]),
    # minicpm: an untied checkpoint without lm_head gets the embedding as its head.
    ("minicpm-q4", "models/tiny-minicpm", ["-q"]),
    ("cohere2-q4", "models/tiny-cohere2", ["-q"]),
    # ernie4_5_moe: MTP tensors and e_score_correction_bias dropped, experts stacked.
    ("ernie4-5-moe-q4-g32", "models/tiny-ernie4-5-moe", ["-q", "--q-group-size", "32"]),
    # minimax_m2: w1/w2/w3 stacked, the router block_sparse_moe.gate at 8 bits (its
    # quant_predicate), e_score_correction_bias kept float32 (its cast_predicate).
    ("minimax-q4-g32", "models/tiny-minimax", ["-q", "--q-group-size", "32"]),
    ("minimax-bf16", "models/tiny-minimax", ["--dtype", "bfloat16"]),
    ("phimoe-q4-g32", "models/tiny-phimoe", ["-q", "--q-group-size", "32"]),
    ("llama4-text-q4", "models/tiny-llama4-text", ["-q"]),
    # qwen3_moe: the router mlp.gate at 8 bits (its quant_predicate).
    ("qwen3-moe-q4-g32", "models/tiny-qwen3-moe", ["-q", "--q-group-size", "32"]),
    ("mixtral-q4-g32", "models/tiny-mixtral", ["-q", "--q-group-size", "32"]),
    ("qwen2-moe-q4-g32", "models/tiny-qwen2-moe", ["-q", "--q-group-size", "32"]),
    ("phi3-q4", "models/tiny-phi3", ["-q"]),
    # The latent-attention successors: experts stacked, kv_b_proj split, every layer past
    # num_hidden_layers dropped; deepseek_v32's indexer (wq_b, wk, weights_proj quantized).
    ("glm4-moe-lite-q4-g32", "models/tiny-glm4-moe-lite", ["-q", "--q-group-size", "32"]),
    ("deepseek-v32-q4-g32", "models/tiny-deepseek-v32", ["-q", "--q-group-size", "32"]),
    # kimi_k25: deepseek_v3's sanitize under language_model., the towers dropped.
    ("kimi-k25-q4-g32", "models/tiny-kimi-k25", ["-q", "--q-group-size", "32"]),
    # minicpm3: latent attention without absorption (kv_b_proj kept and quantized).
    ("minicpm3-q4-g32", "models/tiny-minicpm3", ["-q", "--q-group-size", "32"]),
    # gemma3: the towers dropped; its args write text_config's vocab_size and head counts.
    ("gemma3-mm-q4", "models/tiny-gemma3-mm", ["-q"]),
    # gemma4: Hugging Face's layout (model.language_model.), towers and embedders dropped,
    # gemma4_text's sanitize (KV-shared layers' k/v dropped); audio_config kept.
    ("gemma4-mm-q4", "models/tiny-gemma4-mm", ["-q"]),
    # llama4: the vision model dropped, the fused experts split and transposed into
    # SwitchGLU's layout; the router an nn.Linear.
    ("llama4-q4-g32", "models/tiny-llama4", ["-q", "--q-group-size", "32"]),
    # gpt_oss in SwitchGLU's layout (its sanitize a no-op): sinks first, the router at 8 bits.
    ("gpt-oss-q4-g32", "models/tiny-gpt-oss", ["-q", "--q-group-size", "32"]),
    # gemma3n: the towers and embedders dropped; AltUp's and Laurel's linears (the lists
    # altup_projections / altup_unembed_projections too) quantized where g32 divides them.
    ("gemma3n-q4-g32", "models/tiny-gemma3n", ["-q", "--q-group-size", "32"]),
    # `minimax`, the model_type mlx-lm's MODEL_REMAPPING sends minimax_m2 to: tiny-minimax
    # with it as its model_type (the case's "config_overrides"). deepseek_v3's aliases
    # (kimi_k2, joyai_llm_flash) have no case: mlx_lm.convert fails on such a tiny model
    # (transformers 5.12.1 has no config class for them, so the tokenizer does not load).
    ("minimax-alias-q4-g32", "models/tiny-minimax", ["-q", "--q-group-size", "32"]),
]


CONFIG_OVERRIDES = {
    "mistral-tied-q4": {"model_type": "mistral", "tie_word_embeddings": True},
    "minimax-alias-q4-g32": {"model_type": "minimax"},
}


def with_overrides(src: Path, overrides: dict, out: Path) -> Path:
    """A copy of `src` whose config.json has `overrides` set."""
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config.update(overrides)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_hf(out: Path) -> None:
    """tiny-llama as a transformers checkpoint: float32 weights and rotary tables."""
    import mlx.core as mx

    base = resolve("models/tiny-llama")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    config = json.loads((base / "config.json").read_text())
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        shutil.copy(base / f, out / f)
    weights = {k: v.astype(mx.float32) for k, v in sorted(mx.load(str(base / "model.safetensors")).items())}
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    inv_freq = 1.0 / (config["rope_theta"] ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim))
    for i in range(config["num_hidden_layers"]):
        weights[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = inv_freq
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    write_json(out / "provenance.json", {
        "provenance": provenance("mlx_lm.convert (source of)", "mlx-lm"),
        "generator": "oracles/gen_convert.py",
        "base": "models/tiny-llama",
    })


def tensors(path: Path) -> dict:
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    out = {}
    for k in sorted(header):
        if k == "__metadata__":
            continue
        v = header[k]
        a, b = v["data_offsets"]
        out[k] = {"dtype": v["dtype"], "shape": v["shape"], "sha256": sha(body[a:b])}
    return out


def record(out: Path) -> dict:
    """A written model dir as the gates compare it: every file's sha256 and size, each
    safetensors file's tensors, and the config.json object."""
    files = {}
    tensor_map = {}
    for f in sorted(out.iterdir()):
        data = f.read_bytes()
        files[f.name] = {"sha256": sha(data), "size": len(data)}
        if f.suffix == ".safetensors":
            tensor_map[f.name] = tensors(f)
    config = json.loads((out / "config.json").read_text())
    return {"files": files, "tensors": tensor_map, "config": config}


def run(name: str, src: Path, args: list[str], tmp: Path) -> dict:
    out = tmp / name
    cmd = [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(src), "--mlx-path", str(out), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    result = {"name": name, "args": args, **record(out)}
    if name in GENERATE_CASES:
        result["generate"] = {"args": GENERATE_ARGS, "text": generate(out)}
    return result


GENERATE_ARGS = ["--ignore-chat-template", "--prompt", "The little robot", "-m", "12"]
GENERATE_CASES = ["llama-q4-g64", "llama-q8-g32", "llama-mixed-3-6", "llama-mixed-2-6-g32", "llama-mxfp4", "llama-bf16", "mistral-tied-q4",
                  # The MoEs in float32 only: mlx-lm 0.32.2's QuantizedSwitchLinear passes
                  # `global_scale` to this MLX's gather_qmm, which refuses it (TypeError), and
                  # a bf16 expert stack does not run on the CPU.
                  "qwen3-5-bf16", "qwen3-5-q4", "qwen3-5-mm-q4", "qwen3-5-moe-f32", "qwen3-next-f32", "lfm2-f32", "lfm2-q4",
                  "nemotron-h-q4", "nemotron-h-f16", "mamba2-q4", "mamba2-f16", "lfm2-moe-f32", "granite-h-f32",
                  "falcon-h1-bf16", "falcon-h1-q4", "smollm3-q4"]


def generate(model_dir: Path) -> str:
    """mlx_lm.generate's greedy text on the converted model (between its `==========` lines)."""
    cmd = [sys.executable, "-m", "mlx_lm", "generate", "--model", str(model_dir), *GENERATE_ARGS]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    lines = out.stdout.split("\n")
    first = lines.index("==========")
    second = lines.index("==========", first + 1)
    return "\n".join(lines[first + 1:second])


def main(out_root: Path | None, only: list[str] | None) -> None:
    out = out_root or golden_dir("convert")
    hf = out / HF_NAME
    kept = {}
    if only:
        unknown = set(only) - {c[0] for c in CASES}
        if unknown:
            raise SystemExit(f"unknown cases: {sorted(unknown)}")
        kept = {c["name"]: c for c in json.loads((out / "index.json").read_text())["cases"]}
    else:
        make_hf(hf)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, source, args in CASES:
            if only and name not in only:
                if name not in kept:
                    raise SystemExit(f"{name} is not in the index yet: run it too")
                results.append(kept[name])
                continue
            src = hf if source == HF_NAME else resolve(source)
            overrides = CONFIG_OVERRIDES.get(name)
            if overrides:
                src = with_overrides(src, overrides, Path(tmp) / f"src-{name}")
            r = run(name, src, args, Path(tmp))
            r["source"] = f"convert/{HF_NAME}" if source == HF_NAME else source
            if overrides:
                r["config_overrides"] = overrides
            results.append(r)
            print(f"{name}: {len(r['files'])} files, "
                  f"{sum(len(t) for t in r['tensors'].values())} tensors")
    write_json(out / "index.json", {
        "provenance": provenance("mlx_lm.convert", "mlx-lm"),
        "generator": "oracles/gen_convert.py",
        "cases": results,
    })


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", type=lambda s: s.split(","))
    a = parser.parse_args()
    main(a.out, a.only)
