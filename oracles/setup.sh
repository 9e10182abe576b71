#!/usr/bin/env bash
# Creates the oracle venv in oracles/.venv (git-ignored) from requirements.txt.
#   bash oracles/setup.sh           # Linux CPU (mlx-cpu), or macOS (mlx-metal)
#   bash oracles/setup.sh --cuda    # Linux + NVIDIA (mlx-cuda-13)
# The sentence-transformers oracle of /v1/embeddings needs torch, kept out of this venv:
# see oracles/requirements-embeddings.txt for its own venv.
# Re-running is cheap: pip only installs what is missing. ORACLE_VENV overrides the path.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${ORACLE_VENV:-$here/.venv}"
python="${PYTHON:-python3}"

extra=cpu
[ "${1:-}" = "--cuda" ] && extra=cuda13
[ "$(uname -s)" = "Darwin" ] && extra=""

if [ ! -x "$venv/bin/python" ]; then
  echo "creating oracle venv at $venv"
  "$python" -m venv "$venv"
fi
reqs="$(mktemp)"
trap 'rm -f "$reqs"' EXIT
if [ -n "$extra" ]; then
  sed "s/^mlx\[cpu\]/mlx[$extra]/" "$here/requirements.txt" >"$reqs"
else
  sed "s/^mlx\[cpu\]/mlx/" "$here/requirements.txt" >"$reqs"
fi
"$venv/bin/python" -m pip install --disable-pip-version-check --quiet --upgrade pip
"$venv/bin/python" -m pip install --disable-pip-version-check --quiet -r "$reqs"
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
for name in ["mlx", "mlx-cpu", "mlx-cuda-13", "mlx-metal", "mlx-lm", "mlx-optiq", "transformers"]:
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        pass
PY
echo "oracle venv ready: $venv"
