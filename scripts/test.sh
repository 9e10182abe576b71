#!/usr/bin/env bash
# The project's test command (README, .ci/run). It fetches the real-tokenizer fixtures
# (scripts/fetch_fixtures.sh; skipped when present and verified). MLX is not thread-safe, so
# every test binary runs its tests on one thread. The chat page's end-to-end test drives Debian's
# headless Chromium; it is installed here when missing (as root), or named by CHROMIUM.
# Then the desktop shell's smoke tests under Xvfb (desktop/run.sh test: it installs the
# webview's libraries as root on Debian; elsewhere, without them, it says what to install
# and those tests are reported as not run).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -z "${CHROMIUM:-}" ] && ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's chromium for the chat page's end-to-end test" >&2
    apt-get install -y -qq chromium >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }
  else
    echo "chromium is missing: install it (Debian: sudo apt-get install -y chromium) or set CHROMIUM" >&2
  fi
fi
# The real tokenizers the tokenization and detokenizer gates run on (cache dir, pinned sha256).
bash scripts/fetch_fixtures.sh
cargo test --workspace "$@" -- --test-threads=1
status=0
bash desktop/run.sh test || status=$?
if [ "$status" = 3 ]; then
  echo "desktop shell smoke tests: NOT RUN (system libraries missing, see above)" >&2
  exit 0
fi
exit "$status"
