"""Shared helpers for oracle scripts: the machine key, provenance records and golden writers.

Every golden this project commits carries a provenance block saying which oracle made it,
with which versions, by which command, on which machine and when. The machine key rule
matches `harness` (docs/goldens.md): backend + device name, lowercased, runs of
non-alphanumerics turned into '-'; HARNESS_MACHINE overrides it.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as _md
import json
import os
import platform
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOLDENS = REPO / "goldens"


def _slug(text: str) -> str:
    text = re.sub(r"\((r|tm|c)\)", "", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key() -> str:
    if os.environ.get("HARNESS_MACHINE"):
        return os.environ["HARNESS_MACHINE"]
    import mlx.core as mx

    if mx.cuda.is_available():
        import subprocess

        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, check=False,
        ).stdout.splitlines()
        return _slug("cuda " + (gpu[0] if gpu else "gpu"))
    if mx.metal.is_available():
        import subprocess

        chip = subprocess.run(
            ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, check=False
        ).stdout.strip()
        return _slug(chip or "apple")
    return _slug("cpu " + _cpu_name())


def versions(*names: str) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = _md.version(name)
        except _md.PackageNotFoundError:
            pass
    return out


def provenance(oracle: str, oracle_package: str) -> dict:
    import mlx.core as mx

    return {
        "oracle": oracle,
        "oracle_version": versions(oracle_package).get(oracle_package, "unknown"),
        "mlx_version": mx.__version__,
        "versions": versions("mlx", "mlx-cpu", "mlx-cuda-13", "mlx-metal", "mlx-lm", "mlx-optiq", "transformers"),
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        "machine_key": machine_key(),
        "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
    }


class TensorFile:
    """Collects arrays into one raw little-endian .bin plus an index of where each lies."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.offset = 0

    def add(self, name: str, array) -> dict:
        import mlx.core as mx
        import numpy as np

        mx.eval(array)
        dtype = str(array.dtype).removeprefix("mlx.core.")
        if array.dtype == mx.bfloat16:
            raw = np.array(array.view(mx.uint16), copy=False).astype("<u2").tobytes()
        else:
            raw = np.array(array, copy=False).astype(np.array(array, copy=False).dtype.newbyteorder("<")).tobytes()
        entry = {"name": name, "dtype": dtype, "shape": list(array.shape), "offset": self.offset, "bytes": len(raw)}
        self.chunks.append(raw)
        self.offset += len(raw)
        return entry

    def write(self, path: Path) -> None:
        write_atomic(path, b"".join(self.chunks))


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write to a temporary sibling, then rename: a reader never sees half a golden."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def golden_dir(name: str, portable: bool = False) -> Path:
    """Where a golden is written: the flat reference set, or this machine's override dir
    when this is not the reference machine (goldens/REFERENCE names the reference key).
    `portable` goldens go to the reference set from any machine: text and ids that no
    backend changes (tokenizers, templates), and with HARNESS_WRITE_REFERENCE=1 a numeric
    golden whose gate was checked to reproduce the reference set's goldens bit for bit on
    this machine (its provenance still names the machine that made it)."""
    ref_file = GOLDENS / "REFERENCE"
    reference = ref_file.read_text().strip() if ref_file.exists() else machine_key()
    key = machine_key()
    if portable or key == reference or os.environ.get("HARNESS_WRITE_REFERENCE") == "1":
        return GOLDENS / name
    return GOLDENS / key / name


def resolve(name: str) -> Path:
    """Where golden `name` is read from here: this machine's override, else the reference."""
    override = GOLDENS / machine_key() / name
    return override if override.is_dir() else GOLDENS / name


def write_json(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=1) + "\n")
