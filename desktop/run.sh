#!/usr/bin/env bash
# The desktop shell (Tauri 2) builds on its own, outside the cargo workspace: it needs the
# system webview's development files, which the engine does not.
#
#   bash desktop/run.sh check         can this machine build it? (says what to install)
#   bash desktop/run.sh build [ARGS]  cargo build of the shell (ARGS: e.g. --release)
#   bash desktop/run.sh start [ARGS]  build engine + shell and open the window
#                                     (ARGS go to engine-desktop; default model: the trained tiny one)
#   bash desktop/run.sh build-tests   compile the smoke tests only
#   bash desktop/run.sh test          smoke tests under Xvfb (target/e2e/desktop*.png)
#   bash desktop/run.sh lint          rustfmt --check and clippy -D warnings
#
# `test` installs what is missing with apt when run as root on Debian (as CI does);
# elsewhere it stops with exit code 3 and says what to install.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
manifest="$here/Cargo.toml"

linux_libs=(webkit2gtk-4.1 javascriptcoregtk-4.1 libsoup-3.0 gtk+-3.0)
apt_libs=(libwebkit2gtk-4.1-dev libgtk-3-dev librsvg2-dev libsoup-3.0-dev pkg-config)
apt_test=(xvfb xauth imagemagick)

missing_libs() {
  case "$(uname -s)" in
    Linux)
      if ! command -v pkg-config >/dev/null 2>&1; then
        echo "pkg-config"
        return
      fi
      local lib
      for lib in "${linux_libs[@]}"; do
        pkg-config --exists "$lib" || echo "$lib"
      done
      ;;
    Darwin)
      xcode-select -p >/dev/null 2>&1 || echo "xcode-command-line-tools"
      ;;
  esac
}

missing_test_tools() {
  local tool
  for tool in Xvfb import; do
    command -v "$tool" >/dev/null 2>&1 || echo "$tool"
  done
}

how_to_install() {
  cat >&2 <<EOF
The desktop shell needs the system webview's development files, missing here: $*
  Debian/Ubuntu: sudo apt-get install -y ${apt_libs[*]}
  Fedora:        sudo dnf install -y webkit2gtk4.1-devel gtk3-devel librsvg2-devel libsoup3-devel
  Arch:          sudo pacman -S --needed webkit2gtk-4.1 gtk3 librsvg libsoup3
  macOS:         xcode-select --install   (the webview is part of the system)
Its smoke test also needs Xvfb and ImageMagick (Debian: sudo apt-get install -y ${apt_test[*]}).
The engine and harness build and test without any of this.
EOF
}

can_apt() {
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1
}

apt_install() {
  echo "installing with apt: $*" >&2
  # One apt at a time (.ci/run lints the shell while scripts/test.sh may install chromium).
  (
    flock 9
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null 2>&1 \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null; }
  ) 9>"${TMPDIR:-/tmp}/mlx-engine-apt.lock"
}

# Makes sure the libraries (and with "test", the test tools) are there: installs them as
# root on Debian, else explains and exits 3.
ensure() {
  local want_tools="${1:-}"
  local libs tools
  libs="$(missing_libs | tr '\n' ' ')"
  tools=""
  [ -n "$want_tools" ] && tools="$(missing_test_tools | tr '\n' ' ')"
  if [ -z "${libs// }" ] && [ -z "${tools// }" ]; then
    return 0
  fi
  if can_apt; then
    local pkgs=()
    [ -n "${libs// }" ] && pkgs+=("${apt_libs[@]}")
    [ -n "${tools// }" ] && pkgs+=("${apt_test[@]}")
    apt_install "${pkgs[@]}"
    libs="$(missing_libs | tr '\n' ' ')"
    [ -n "$want_tools" ] && tools="$(missing_test_tools | tr '\n' ' ')"
    if [ -z "${libs// }" ] && [ -z "${tools// }" ]; then
      return 0
    fi
  fi
  how_to_install "$libs $tools"
  exit 3
}

cmd="${1:-check}"
shift || true
case "$cmd" in
  check)
    libs="$(missing_libs | tr '\n' ' ')"
    if [ -n "${libs// }" ]; then
      how_to_install "$libs"
      exit 3
    fi
    echo "desktop shell: system libraries present; build with: bash desktop/run.sh build"
    ;;
  build)
    ensure
    cargo build --manifest-path "$manifest" "$@"
    ;;
  start)
    ensure
    (cd "$repo" && cargo build -p engine --release)
    cargo build --manifest-path "$manifest" --release
    args=("$@")
    if ! printf '%s\n' "${args[@]}" | grep -q -- '^--model'; then
      args=(--model "$repo/goldens/models/tiny-llama-trained" "${args[@]}")
    fi
    exec "$here/target/release/engine-desktop" --engine "$repo/target/release/engine" "${args[@]}"
    ;;
  build-tests)
    # What `test` compiles, without running it (scripts/test.sh builds it at low priority
    # while the workspace's tests run).
    ensure tools
    cargo test --manifest-path "$manifest" --no-run "$@"
    ;;
  test)
    ensure tools
    # The engine binary as the workspace's tests build it (a no-op after scripts/test.sh's
    # cargo test; `cargo build -p engine` would rebuild it with other features).
    (cd "$repo" && cargo test --workspace --no-run -q)
    ENGINE_BIN="$repo/target/debug/engine" \
      cargo test --manifest-path "$manifest" "$@" -- --test-threads=1
    ;;
  lint)
    ensure
    cargo fmt --manifest-path "$manifest" --check
    cargo clippy --manifest-path "$manifest" --all-targets -- -D warnings
    ;;
  *)
    sed -n '2,13p' "${BASH_SOURCE[0]}" >&2
    exit 2
    ;;
esac
