"""CLI golden: what `mlx_lm.generate` 0.32.2 prints for the flags `engine generate` mirrors.

    oracles/.venv/bin/python oracles/gen_cli.py [--out DIR]

Each case runs `python -m mlx_lm generate --model M ARGS...` (verbose, greedy) in a
subprocess and records the response text (between the two `==========` lines) and the
prompt token count from its footer. The models are goldens/models/tiny-llama-trained and
two derived copies that engine/tests/it/cli.rs rebuilds the same way from the recipe stored
in the golden ("derived"):

- `kwargs`: the chat template moved to chat_template.jinja (chat_template dropped from
  tokenizer_config.json) behind a prefix that prints `enable_thinking` (defined or not,
  true or false) and a `persona` variable, so the template kwargs show in the prompt;
- `thinking`: `kwargs` plus `<think>` / `</think>` added tokens (ids in the padded
  embedding), which make mlx-lm's TokenizerWrapper pass enable_thinking=True by default.

Output: goldens/cli/index.json
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from provenance import golden_dir, provenance, resolve, write_json

BASE = "tiny-llama-trained"
PREFIX = (
    "{%- if enable_thinking is defined -%}[thinking={{ 'on' if enable_thinking else 'off' }}]"
    "{%- else -%}[thinking=undefined]{%- endif -%}"
    "{%- if persona is defined -%}[persona={{ persona }}]{%- endif -%}"
)
THINK_TOKENS = [[1000, "<think>"], [1001, "</think>"]]
SKY = "What color is the sky?"


def derive(base: Path, out: Path, think: bool) -> None:
    shutil.copytree(base, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    template = config.pop("chat_template")
    config_path.write_text(json.dumps(config))
    (out / "chat_template.jinja").write_text(PREFIX + template)
    if think:
        tok_path = out / "tokenizer.json"
        tok = json.loads(tok_path.read_text())
        for token_id, content in THINK_TOKENS:
            tok["added_tokens"].append({
                "id": token_id, "content": content, "single_word": False, "lstrip": False,
                "rstrip": False, "normalized": False, "special": False,
            })
        tok_path.write_text(json.dumps(tok))


def cases(is_token: str) -> list[dict]:
    c = lambda name, model, args, stdin=None: {"name": name, "model": model, "args": args, "stdin": stdin}
    return [
        c("default-chat", BASE, ["--prompt", SKY]),
        c("ignore-chat-template", BASE, ["--ignore-chat-template", "--prompt", "The little robot"]),
        c("system-prompt", BASE, ["--system-prompt", "You answer in one sentence.", "--prompt", SKY]),
        c("prefill-response", BASE, ["--prefill-response", "The sky", "--prompt", SKY]),
        c("max-tokens-short", BASE, ["-m", "3", "--prompt", "Tell me a story about the robot."]),
        c("escaped-newline", BASE, ["--prompt", "Question:\\nWhat color is the grass?"]),
        c("stdin", BASE, ["--prompt", "-"], stdin="What color is the grass?"),
        c("extra-eos-token", BASE, ["--extra-eos-token", is_token, "--prompt", SKY]),
        c("kwargs-default", "kwargs", ["--prompt", SKY]),
        c("kwargs-config", "kwargs",
          ["--chat-template-config", '{"enable_thinking": true, "persona": "pirate"}', "--prompt", SKY]),
        c("thinking-default", "thinking", ["--prompt", SKY]),
        c("thinking-config-off", "thinking",
          ["--chat-template-config", '{"enable_thinking": false}', "--prompt", SKY]),
        c("qwen3-default-chat", "tiny-qwen3", ["-m", "12", "--prompt", SKY]),
        c("gemma3-system-prompt", "tiny-gemma3",
          ["-m", "12", "--system-prompt", "You answer in one sentence.", "--prompt", SKY]),
        # transformers 5's layout: chat_template.jinja, two shards with an index, and
        # thinking markers in the vocabulary (enable_thinking on by default, then off).
        c("transformers5-layout", "tiny-qwen3-tools", ["-m", "40", "--prompt", "What is the weather like?"]),
        c("transformers5-layout-no-thinking", "tiny-qwen3-tools",
          ["-m", "40", "--chat-template-config", '{"enable_thinking": false}',
           "--prompt", "What is the weather like?"]),
    ]


def run(model_dir: Path, case: dict) -> dict:
    cmd = [sys.executable, "-m", "mlx_lm", "generate", "--model", str(model_dir), *case["args"]]
    out = subprocess.run(cmd, input=case["stdin"] or "", capture_output=True, text=True, check=True)
    lines = out.stdout.split("\n")
    first = lines.index("==========")
    second = lines.index("==========", first + 1)
    text = "\n".join(lines[first + 1:second])
    footer = lines[second + 1]
    assert footer.startswith("Prompt: "), out.stdout
    return {**case, "text": text, "prompt_tokens": int(footer.split()[1])}


def main(out_root: Path | None) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    base = resolve(f"models/{BASE}")
    tokenizer = load_tokenizer(base)
    is_token = tokenizer._tokenizer.convert_ids_to_tokens(tokenizer.encode(" is", add_special_tokens=False))[-1]
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"kwargs": Path(tmp) / "kwargs", "thinking": Path(tmp) / "thinking"}
        derive(base, dirs["kwargs"], think=False)
        derive(base, dirs["thinking"], think=True)
        results = [run(dirs.get(c["model"]) or resolve(f"models/{c['model']}"), c) for c in cases(is_token)]
    out = (out_root or golden_dir("cli"))
    write_json(out / "index.json", {
        "provenance": provenance("mlx_lm.generate", "mlx-lm"),
        "generator": "oracles/gen_cli.py",
        "derived": {"base": BASE, "template_prefix": PREFIX, "think_tokens": THINK_TOKENS},
        "cases": results,
    })
    for r in results:
        print(f"{r['name']}: {r['prompt_tokens']} prompt tokens, {r['text']!r}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    main(parser.parse_args().out)
