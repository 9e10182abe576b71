#!/bin/sh
''''exec "$(dirname "$0")/.venv/bin/python" "$0" "$@" # '''
# (The line above lets mlx.launch exec this file directly: sh re-runs it under the venv's python.)
"""Distributed L1 goldens: mlx-lm 0.32.2 greedy generation on 2 ranks (ring backend), sharded by
mlx-lm itself (`mlx_lm.utils.sharded_load`), logits included.

    oracles/.venv/bin/python oracles/gen_l1_dist.py --launch --mode tp|pp [MODEL ...] [--out DIR]
    oracles/.venv/bin/mlx.launch --backend ring -n 2 -p PORT oracles/gen_l1_dist.py --mode tp|pp MODEL ...

--mode tp: `sharded_load(tensor_group=group)` (Model.shard: attention heads and MLP columns split,
one all_sum per row-parallel linear). --mode pp: `sharded_load(pipeline_group=group)`
(PipelineMixin: rank 0 runs the last layers, the hidden state goes down by send/recv, then an
all_gather). PP reads model.safetensors.index.json; a model dir without one is loaded from a
temporary copy (files linked) with a one-file index written in.

Every rank runs gen_l1's cases the same way (same prompts, same generate_step calls, so the
collectives match); rank 0 alone writes goldens/l1-dist/<mode>/<model>/index.json + logits.bin,
in gen_l1's format (the cases, prompts, logit steps and greedy steps are gen_l1's).

--launch (when not already a rank, i.e. no MLX_RANK): re-runs this script through mlx.launch once
per model, on a free port, each run bounded by --timeout seconds (killed past it). mlx.launch
exits 0 even when a rank fails, so each rank leaves a status file (ok or the error) and a model
counts as done only when both ranks said ok and rank 0's golden files exist.
"""

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import mlx.core as mx
from transformers import AutoTokenizer

from gen_l1 import CHATS, GREEDY_STEPS, LOGIT_STEPS, RAW_PROMPTS, prompt_cases, run  # patches gather_qmm
from make_rope import oracle_view
from provenance import TensorFile, golden_dir, provenance, resolve, write_json
from tinymodels import load_manifest

# The models of each mode: the manifest's rows naming `l1-dist-tp` / `l1-dist-pp` (the harness
# reads the same rows). L1 models left out because mlx-lm's sharded_load refuses them on 2 ranks (a
# quantized row-parallel linear whose in/2 is no multiple of its group size): tiny-qwen3-q8,
# tiny-llama-trained-q4, tiny-gpt-oss-mxfp4 (ValueError: [quantize] The last dimension ...), and in
# TP tiny-qwen3-moe-q4, tiny-qwen3-moe-mxfp4 (ValueError: Array split does not result in sub
# arrays with equal size ...). PP is in qwen2, qwen3_moe and the gated-delta-net hybrids qwen3_5,
# qwen3_5_moe, qwen3_next; TP in the hybrids is qwen3_5's Model.shard (qwen3_5 and qwen3_5_moe, the
# multimodal tiny-qwen3-5-mm too): sharded_load takes every hybrid tiny model it is asked for on 2
# ranks (2 key / 4 value heads, 4 query / 2 KV heads, vocab 1024 all divide). qwen3_next has no
# Model.shard in mlx-lm 0.32.2, so it is a PP row only.
# deepseek_v3 (tiny-deepseek-v3: multi-head latent attention, 4 heads, grouped experts + a shared
# expert) is a row of both: its Model.shard and PipelineMixin take it on 2 ranks.
# So are mlx-lm's other MLA models, each its own copy of deepseek_v3's split: glm4_moe_lite
# (tiny-glm4-moe-lite), deepseek_v32 (tiny-deepseek-v32: its shard leaves the indexer whole) and
# kimi_k25 (tiny-kimi-k25: the wrapper's shard is deepseek_v3's on its language_model, and
# sharded_load pipelines it through the wrapper's `model` property, the text model).
def mode_models(mode: str) -> list[str]:
    return [row["name"] for row in load_manifest() if f"l1-dist-{mode}" in row["gates"]]


# Rows whose distributed goldens are kept short, as the 2-rank runs are among the slowest tests:
# one raw prompt (10 or 11 ids) and 12 steps, every step's logits stored (ministral3's window of 8 is
# passed within them, and its query scale grows every 3 positions). ministral3 (tp, pp) and
# minimax (tp: its ShardedRMSNorm q/k norms, the narrowed experts) need no more than this.
SHORT = {"tiny-ministral3", "tiny-minimax"}
SHORT_CASES = ["raw1"]
SHORT_STEPS = 12


def run_short(model, prompt_ids, prefill_step):
    """gen_l1's `run` with SHORT_STEPS greedy steps, each one's logits kept."""
    from mlx_lm.generate import generate_step

    captured = []

    def capture(tokens, logits):
        captured.append(logits)
        return logits

    ids = [int(token) for token, _ in generate_step(
        mx.array(prompt_ids), model, max_tokens=SHORT_STEPS, logits_processors=[capture],
        prefill_step_size=prefill_step)]
    logits = [l.astype(mx.float32).reshape(-1) for l in captured[:SHORT_STEPS]]
    mx.eval(logits)
    return ids, logits


RANKS = 2
PREFILL_STEP = 2048  # mlx-lm's default, as gen_l1


# ---- rank side -------------------------------------------------------------------------------

def pp_view(path: Path) -> tuple[Path, str]:
    """The dir PP loads from, and how its index came to be: the model dir itself when it has
    model.safetensors.index.json, else a temporary copy (files linked) with a one-file index."""
    if (path / "model.safetensors.index.json").exists():
        return path, "from the model dir"
    files = sorted(path.glob("*.safetensors"))
    if [f.name for f in files] != ["model.safetensors"]:
        raise ValueError(f"{path}: no index and not a single model.safetensors: {[f.name for f in files]}")
    view = Path(tempfile.mkdtemp(prefix=f"{path.name}-pp-"))
    for f in path.iterdir():
        (view / f.name).symlink_to(f.resolve())
    weight_map = {key: "model.safetensors" for key in sorted(mx.load(str(files[0])))}
    (view / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return view, "written to a temp copy"


def layers_by_rank(model, group) -> dict[str, list[int]]:
    """[start, end) of each rank's layers, as PipelineMixin set them (gathered from every rank)."""
    mine = mx.array([[model.model.start_idx, model.model.end_idx]], dtype=mx.int32)
    every = mx.distributed.all_gather(mine, group=group, stream=mx.cpu).tolist()
    return {str(r): pair for r, pair in enumerate(every)}


def load_sharded(name: str, mode: str, group):
    """mlx-lm's sharded model on this rank, plus the settings that describe how it was made."""
    from mlx_lm.utils import sharded_load

    view = oracle_view(resolve(f"models/{name}"))  # rope_parameters flattened where mlx-lm ignores them
    settings = {"mode": mode, "ranks": group.size(), "backend": "ring", "launcher": "mlx.launch"}
    if mode == "tp":
        model, _ = sharded_load(str(view), tensor_group=group)
    else:
        view, index = pp_view(view)
        model, _ = sharded_load(str(view), pipeline_group=group)
        settings["index_json"] = index
        settings["layers_by_rank"] = layers_by_rank(model, group)
    return model, settings


def generate_one(name: str, mode: str, group, out_root: str | None, command: str) -> None:
    model, dist = load_sharded(name, mode, group)
    path = resolve(f"models/{name}")
    hf = AutoTokenizer.from_pretrained(str(path))
    out = TensorFile()
    cases = prompt_cases(hf, RAW_PROMPTS, CHATS)
    short = name in SHORT
    if short:
        cases = [c for c in cases if c["name"] in SHORT_CASES]
    steps = (SHORT_STEPS, SHORT_STEPS) if short else (LOGIT_STEPS, GREEDY_STEPS)
    for case in cases:  # every rank: the same calls, so the same collectives
        greedy, logits = (run_short if short else run)(model, case["prompt_ids"], PREFILL_STEP)
        case["greedy_ids"] = greedy
        case["logits"] = [out.add(f"{case['name']}/{s}", l) for s, l in enumerate(logits)]
    if group.rank() != 0:
        return
    dest = Path(out_root) / mode / name if out_root else golden_dir(f"l1-dist/{mode}/{name}", portable=True)
    out.write(dest / "logits.bin")
    write_json(dest / "index.json", {
        "provenance": {**provenance("mlx-lm", "mlx-lm"), "command": command},
        "generator": "oracles/gen_l1_dist.py",
        "model": f"models/{name}",
        "data": "logits.bin",
        "settings": {"sampler": "greedy", "prefill_step_size": PREFILL_STEP, "cache": "KVCache",
                     "logit_steps": steps[0], "greedy_steps": steps[1], **dist},
        "cases": cases,
    })
    print(f"l1-dist/{mode}/{name}: {len(cases)} cases -> {dest}", flush=True)


def rank_main(args) -> None:
    mx.set_default_device(mx.cpu)
    group = mx.distributed.init()
    rank = group.rank()
    status = Path(args.status_dir) / f"rank{rank}" if args.status_dir else None
    try:
        if group.size() != RANKS:
            raise RuntimeError(f"expected {RANKS} ranks, got {group.size()} (run under mlx.launch -n {RANKS})")
        # provenance: the command a person ran (the launcher's, or mlx.launch around this rank's argv)
        argv = ["oracles/gen_l1_dist.py", *sys.argv[1:]]
        command = args.invoked_as or shlex.join(["mlx.launch", "--backend", "ring", "-n", str(RANKS), *argv])
        for name in args.models:
            generate_one(name, args.mode, group, args.out, command)
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))  # leave together
    except BaseException as e:  # noqa: BLE001 - recorded for the launcher, then a non-zero exit
        if status:
            status.with_suffix(".err").write_text(f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}")
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # non-zero: mlx.launch then stops the other rank (which may wait in a collective)
    if status:
        status.with_suffix(".ok").write_text("ok\n")


# ---- launcher side ---------------------------------------------------------------------------

def free_port_pair() -> int:
    """A port P with P and P+1 free on loopback (mlx.launch's ring uses P for rank 0, P+1 for rank 1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free pair of loopback ports")


def launch_one(name: str, args) -> tuple[bool, str, float]:
    """One model through mlx.launch on 2 ranks: (done, what happened, seconds)."""
    status_dir = Path(tempfile.mkdtemp(prefix="gen_l1_dist-"))
    out = ["--out", str(Path(args.out).resolve())] if args.out else []
    invoked_as = shlex.join(["python", "oracles/gen_l1_dist.py", "--launch", "--mode", args.mode,
                             *(["--out", args.out] if args.out else []), name])
    launcher = Path(sys.executable).with_name("mlx.launch")
    cmd = [str(launcher), "--backend", "ring", "-n", str(RANKS), "-p", str(free_port_pair()),
           "--python", sys.executable, "--", str(Path(__file__).resolve()), "--mode", args.mode,
           "--status-dir", str(status_dir), "--invoked-as", invoked_as, *out, name]
    start = time.monotonic()
    # stdin: a pipe left open and empty (the launcher polls stdin; /dev/null would make it spin)
    proc = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.PIPE)
    try:
        proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks share its session
        proc.wait()
        shutil.rmtree(status_dir, ignore_errors=True)
        return False, f"timed out after {args.timeout} s", time.monotonic() - start
    seconds = time.monotonic() - start
    errors = [f"rank {r}: {(status_dir / f'rank{r}.err').read_text().splitlines()[0]}"
              for r in range(RANKS) if (status_dir / f"rank{r}.err").exists()]
    missing = [r for r in range(RANKS) if not (status_dir / f"rank{r}.ok").exists()]
    dest = Path(args.out) / args.mode / name if args.out else golden_dir(f"l1-dist/{args.mode}/{name}", portable=True)
    written = all((dest / f).exists() and (dest / f).stat().st_mtime >= time.time() - seconds - 1
                  for f in ("index.json", "logits.bin"))
    shutil.rmtree(status_dir, ignore_errors=True)
    problems = errors or ([f"ranks {missing} left no status (launcher rc {proc.returncode})"] if missing else [])
    if not written:
        problems.append("rank 0 wrote no golden")
    if problems:
        return False, "; ".join(problems), seconds
    return True, f"-> {dest}", seconds


def launch_main(args) -> int:
    failed = []
    for name in args.models:
        done, what, seconds = launch_one(name, args)
        print(f"[{args.mode}] {name}: {'done' if done else 'FAILED'} in {seconds:.1f} s {what}", flush=True)
        if not done:
            failed.append(name)
    if failed:
        print(f"[{args.mode}] failed: {' '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*")
    ap.add_argument("--mode", choices=["tp", "pp"], required=True)
    ap.add_argument("--launch", action="store_true",
                    help="not under mlx.launch: run each model through mlx.launch on 2 ranks")
    ap.add_argument("--timeout", type=float, default=300, help="--launch: seconds per model before it is killed")
    ap.add_argument("--out", help="write <out>/<mode>/<model>/ instead of the goldens (live diffs)")
    ap.add_argument("--status-dir", help=argparse.SUPPRESS)  # set by --launch: per-rank ok/err files
    ap.add_argument("--invoked-as", help=argparse.SUPPRESS)  # set by --launch: the command for provenance
    args = ap.parse_args()
    args.models = args.models or mode_models(args.mode)
    if "MLX_RANK" in os.environ:
        rank_main(args)
    elif args.launch:
        sys.exit(launch_main(args))
    else:
        ap.error("not a rank (no MLX_RANK): pass --launch, or run under mlx.launch --backend ring -n 2")
