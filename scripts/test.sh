#!/usr/bin/env bash
# The project's test command (README, .ci/run). MLX is not thread-safe, so every test
# binary runs its tests on one thread.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec cargo test --workspace "$@" -- --test-threads=1
