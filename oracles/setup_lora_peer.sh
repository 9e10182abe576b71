#!/usr/bin/env bash
# Installs mlx-lm-lora (the train bench's peer) into oracles/.lora-peer, without its
# dependencies: it asks for mlx 0.32.4, and the oracle venv keeps the pinned 0.32.2 (one
# libmlx for engine and oracle). Its ORPO step runs on 0.32.2 (checked 2026-11-29).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
"$here/.venv/bin/python" -m pip install --disable-pip-version-check --quiet --no-deps \
  --target "$here/.lora-peer" "mlx-lm-lora==5.10.2"
