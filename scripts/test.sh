#!/usr/bin/env bash
# The project's test command (README, .ci/run). It fetches the real-tokenizer fixtures
# (scripts/fetch_fixtures.sh; skipped when present and verified). MLX is not thread-safe, so
# every test binary runs its tests on one thread. The chat page's end-to-end test drives Debian's
# headless Chromium; it is installed here when missing (as root), or named by CHROMIUM.
# Once either lane of tests is done, the desktop shell's smoke tests under Xvfb
# (desktop/run.sh test: it installs the webview's libraries as root on Debian; elsewhere,
# without them, it says what to install and those tests are reported as not run).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# MLX's CPU JIT shares one kernel directory between processes and loads a library another
# process may still be writing; the wrapper makes each library appear whole (see its
# header). Every test process and the engines they start inherit this PATH.
export PATH="$PWD/scripts/jit-cxx:$PATH"
if [ "$(command -v g++ || true)" != "$PWD/scripts/jit-cxx/g++" ]; then
  echo "scripts/jit-cxx/g++ is not the g++ the tests will find: MLX's JIT could race" >&2
  exit 1
fi
# Build every test binary once, then run them in two lanes side by side: MLX work stays on
# one thread inside each binary (--test-threads=1), and separate processes share nothing
# but the disk. One lane: the engine's integration tests less some in-process modules, then
# the harness's binaries — every test that takes a loopback port free-then-bound (distributed
# ranks: engine/tests/it/dist, harness/tests/it/l1_dist, the harness's launch tests) is
# in it, so no two of them run at once; servers bind port 0 themselves. The other lane:
# every other binary, and those engine modules. Each line of output is prefixed with its
# lane; each lane runs all its binaries and the script fails if any test failed. `cargo test` alone still runs them all
# one after another.
artifacts="$(mktemp)"
trap 'kill "${build:-}" 2>/dev/null || true; rm -f "$artifacts" "$artifacts".* "${desktop_log:-}"' EXIT
# Every target, benches included (criterion's, built as plain binaries and not run here): a
# bench that stops compiling fails the test command, and where .ci/run lints through this
# build (clippy-driver as the workspace's rustc wrapper) it lints what `cargo clippy
# --all-targets` would.
#
# The build starts first, in the background, and what the tests need besides it is fetched
# while it compiles (Debian's chromium, the real tokenizers, the desktop shell's libraries):
# on a fresh machine those are downloads and installs, which held the build back
# when they ran before it.
cargo test --workspace --all-targets --no-run --message-format=json-render-diagnostics "$@" >"$artifacts" &
build=$!
if [ -z "${CHROMIUM:-}" ] && ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's chromium for the chat page's end-to-end test" >&2
    (
      flock 9 # one apt at a time (desktop/run.sh may install the webview's libraries)
      apt-get install -y -qq chromium >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }
    ) 9>"${TMPDIR:-/tmp}/mlx-engine-apt.lock"
  else
    echo "chromium is missing: install it (Debian: sudo apt-get install -y chromium) or set CHROMIUM" >&2
  fi
fi
# The desktop shell's smoke tests compile in the background at the lowest priority: the
# workspace's build and tests come first, and the shell's build takes what CPU they leave
# (the test lanes below wait on sockets and browsers much of the time). Its own cargo
# target dir (desktop/target) keeps it off the workspace's lock.
desktop_log="$(mktemp)"
nice -n 19 bash desktop/run.sh build-tests >"$desktop_log" 2>&1 &
desktop_build=$!
# The real tokenizers the tokenization and detokenizer gates run on (cache dir, pinned sha256).
bash scripts/fetch_fixtures.sh
if ! wait "$build"; then
  echo "the test build failed (cargo's errors above)" >&2
  exit 1
fi
build=""
# One line per test binary (the profile's "test": true; the plain binaries the tests run
# are artifacts too): its executable, the package directory cargo runs it in (with
# CARGO_MANIFEST_DIR set), and its source as a label.
field() { sed -nE "s/.*\"$1\":\"([^\"]*)\".*/\1/p" <<<"$2"; }
engine_it=() other=()
split_off=(train_families:: orpo_prefix:: segmented:: constrained:: constrained_fuzz:: compiled_decode:: chat_e2e:: embeddings:: serve_metrics:: serve_budget:: serve_adapters:: vision_preprocess:: lookup:: batch_draft:: train_grpo::)
harness=()
while IFS= read -r line; do
  exe="$(field executable "$line")"
  [ -n "$exe" ] || continue
  [[ "$line" != *'"kind":["bench"]'* ]] || continue # criterion's benches: `cargo bench` runs them
  dir="$(dirname "$(field manifest_path "$line")")"
  src="$(field src_path "$line")"
  entry="$exe|$dir|${src#"$PWD"/}"
  if [ "$src" = "$PWD/engine/tests/it/main.rs" ]; then
    # Some of its in-process modules (MLX, temp dirs only: the training families,
    # constrained decoding and its fuzz, the compiled step, image preprocessing), the
    # chat page's browser tests and the embeddings, /metrics, memory-budget and adapter
    # servers (their servers bind port 0 themselves) go to the other lane, to balance the
    # two (measured in a fresh-clone CI run of b5de748: 650 s and
    # 618 s before the last two moves; the served lookup and draft gates moved after the
    # batch lane's distributed gates joined the first lane; GRPO's training moved when the
    # allocator sped the second lane's in-process gates up more than the first lane's
    # servers and ranks: first / second lane 700 / 722 s became 660 / 635 s; the SSD store's
    # gates (~28 s) came back when the test build linted by clippy and MLX's kernels compiled
    # from an empty directory left the lanes at 764 / 816 s in a fresh-clone run of
    # 01f91f1); libtest's filters and --skips match the same names.
    engine_it+=("$entry|${split_off[*]/#/--skip }")
    other+=("$entry|${split_off[*]}")
  elif [[ "$src" == "$PWD/harness/"* ]]; then
    harness+=("$entry|")
  else
    other+=("$entry|")
  fi
done < <(grep -E '"profile":\{[^}]*"test":true\}' "$artifacts")
# The harness's binaries go last in their lane: l1_dist's two rank processes then have the
# machine to themselves once the other lane is done.
engine_it+=(${harness[@]+"${harness[@]}"})
if [ "${#engine_it[@]}" -eq 0 ] && [ "${#other[@]}" -eq 0 ]; then
  echo "cargo built no test binaries" >&2
  exit 1
fi
run_lane() { # LANE ENTRY...: runs each binary, prints `LANE: failed …` per failure
  local lane="$1"
  shift
  (
    failed=0
    for entry in "$@"; do
      IFS='|' read -r exe dir label filter <<<"$entry"
      echo "     Running $label${filter:+ ($filter)} (${exe#"$PWD"/})"
      # shellcheck disable=SC2086 # the filter is words: a name, or --skip and a name
      if ! (cd "$dir" && CARGO_MANIFEST_DIR="$dir" "$exe" --test-threads=1 $filter); then
        echo "FAILED: $label"
        failed=1
      fi
    done
    exit "$failed"
  ) 2>&1 | sed -u "s/^/[$lane] /"
  return "${PIPESTATUS[0]}"
}
run_lane_status() { # the lane's exit status goes to a file: `wait` on a pipeline is murky
  local lane="$1"
  shift
  local rc=0
  run_lane "$lane" "$@" || rc=$?
  echo "$rc" >"$artifacts.$lane"
}
run_lane_status engine-it "${engine_it[@]}" &
lane_a=$!
run_lane_status rest "${other[@]}" &
lane_b=$!
# The desktop shell's smoke tests (~20 s, mostly waiting on its window and server) run as
# soon as either lane is done, beside the other one's last tests, not after both.
wait -n "$lane_a" "$lane_b" || true
desktop_built=0
wait "$desktop_build" || desktop_built=$?
echo "desktop shell smoke tests, built in the background (exit $desktop_built):"
cat "$desktop_log"
rm -f "$desktop_log"
desktop=0
bash desktop/run.sh test 2>&1 | sed -u "s/^/[desktop] /" || desktop="${PIPESTATUS[0]}"
wait "$lane_a" "$lane_b" 2>/dev/null || true # their statuses are in the files below
status=0
for lane in engine-it rest; do
  if [ "$(cat "$artifacts.$lane" 2>/dev/null)" != 0 ]; then
    echo "tests failed in lane $lane (its FAILED lines above name the binaries)" >&2
    status=1
  fi
done
if [ "$desktop" = 3 ]; then
  echo "desktop shell smoke tests: NOT RUN (system libraries missing, see above)" >&2
elif [ "$desktop" != 0 ]; then
  echo "desktop shell smoke tests failed (exit $desktop, the [desktop] lines above)" >&2
  status=1
fi
exit "$status"
