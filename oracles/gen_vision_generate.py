"""`mlx_vlm.generate --image` as its CLI runs it, on the tiny vision fixtures: the prompt string
its `apply_chat_template` builds, the ids its processor makes of it with the images, and the ids
its `stream_generate` produces greedily (engine generate --image; engine::vision::prompt).

    /work/vision-venv/bin/python oracles/gen_vision_generate.py [FIXTURE ...]
    (the venv: oracles/requirements-vision.txt; needs goldens/models/tiny-gemma3-vl,
    tiny-qwen3-vl-vision, tiny-gemma4-vl, tiny-qwen3-5-vl, and goldens/vision/images)

With fixture names, only those are regenerated: their cases replaced in generate.json (every
other case kept byte for byte) and their run's provenance under `added`.

The tiny fixtures' tokenizers have no multimodal tokens (their goldens are ids), so each case
is the fixture with an overlay: config.json with the image ids moved to new added tokens
(gemma3: <start_of_image>, <end_of_image>, <image_soft_token>, and the turn markers;
qwen3_vl and qwen3_5: <|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|>; gemma4:
<|image>, <image|>, <|image|>, <|audio|>, and <|turn>, <turn|>, <|video|>), tokenizer.json with
those tokens added after the vocabulary (the rest up to the model's 1024 ids as plain
`<extra_N>` tokens, so every generated id decodes), and tokenizer_config.json with a chat template of the
family's shape (gemma3's turns and string content; Qwen3-VL's content lists with image entries;
Qwen3.5's the same with an empty think block when thinking is off; gemma4's <|turn> turns with
content lists). The overlay is written to goldens/vision/generate/<fixture>/; the weights, the
processor's config (gemma4: processor_config.json) and the generation config are the fixture's. The tests assemble the same directory.

For each fixture, 1 and 2 images: dispatch.main's path (prompt_utils.apply_chat_template with
num_images and enable_thinking=False), then generate's own prepare_inputs (the processor) and
stream_generate with temperature 0 and max_tokens 8; the token of every chunk.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from provenance import provenance, write_json  # noqa: E402

GENERATOR = "oracles/gen_vision_generate.py"
OUT = REPO / "goldens" / "vision" / "generate"
IMAGES = ["rgb_64x64.png", "rgb_97x61.png"]
PROMPT = "Describe this."
MAX_TOKENS = 8

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
QWEN_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful robot.<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Gemma 4's shape: <|turn>role … <turn|>, content lists with image entries (mlx-vlm's
# LIST_WITH_IMAGE_TYPE_TEXT), an assistant's content a string.
GEMMA4_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "<|turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
# Qwen3.5's shape: Qwen3-VL's, and an empty think block when thinking is off.
QWEN35_TEMPLATE = QWEN_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}",
)

# Qwen3-VL's and Qwen3.5's vision tokens and the config ids naming them (one tokenizer family).
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_IDS = {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
            "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"}
CASES = {
    "tiny-gemma3-vl": {
        "tokens": ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"],
        "ids": {"boi_token_index": "<start_of_image>", "eoi_token_index": "<end_of_image>",
                "image_token_index": "<image_soft_token>"},
        "template": GEMMA_TEMPLATE,
        "extra": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                  "image_token": "<image_soft_token>"},
        # Gemma3Processor takes image_seq_length from here (else 256), as the real checkpoints.
        "processor": {"image_seq_length": 4, "processor_class": "Gemma3Processor"},
    },
    "tiny-qwen3-vl-vision": {
        "tokens": QWEN_TOKENS,
        "ids": QWEN_IDS,
        "template": QWEN_TEMPLATE,
        "extra": {},
    },
    "tiny-gemma4-vl": {
        # <|video|> is in the vocabulary so that Gemma4Processor does not add it itself.
        "tokens": ["<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>", "<|audio|>", "<|video|>"],
        "ids": {"boi_token_id": "<|image>", "eoi_token_id": "<image|>", "image_token_id": "<|image|>",
                "audio_token_id": "<|audio|>"},
        "template": GEMMA4_TEMPLATE,
        "extra": {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>"},
        "files": ("model.safetensors", "processor_config.json", "generation_config.json"),
    },
    "tiny-qwen3-5-vl": {
        "tokens": QWEN_TOKENS,
        "ids": QWEN_IDS,
        "template": QWEN35_TEMPLATE,
        "extra": {},
    },
}
# The fixtures' files the tests copy under the overlay (unless a case names its own).
FILES = ("model.safetensors", "preprocessor_config.json", "generation_config.json")


def overlay(name: str, case: dict, out: Path) -> None:
    """The fixture's config and tokenizer files with the multimodal tokens added."""
    src = REPO / "goldens" / "models" / name
    tok = json.loads((src / "tokenizer.json").read_text())
    next_id = max(max(tok["model"]["vocab"].values()), max(t["id"] for t in tok["added_tokens"])) + 1
    ids = {}
    for t in case["tokens"]:
        ids[t] = next_id
        tok["added_tokens"].append({"id": next_id, "content": t, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
        next_id += 1
    # The model's vocabulary is 1024 and random weights pick any id: fill the rest with plain
    # added tokens, so that every id decodes (mlx-vlm's detokenizer indexes its token map).
    for i in range(next_id, 1024):
        tok["added_tokens"].append({"id": i, "content": f"<extra_{i}>", "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": False})
    cfg = json.loads((src / "config.json").read_text())
    for key, t in case["ids"].items():
        cfg[key] = ids[t]
    tc = json.loads((src / "tokenizer_config.json").read_text())
    tc["chat_template"] = case["template"]
    if case["extra"]:
        tc["extra_special_tokens"] = case["extra"]
    out.mkdir(parents=True, exist_ok=True)
    if "processor" in case:
        write_json(out / "processor_config.json", case["processor"])
    write_json(out / "config.json", cfg)
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False) + "\n")
    write_json(out / "tokenizer_config.json", tc)


def assemble(name: str, overlay_dir: Path, into: Path) -> None:
    src = REPO / "goldens" / "models" / name
    for f in CASES[name].get("files", FILES):
        shutil.copy(src / f, into / f)
    for f in overlay_dir.iterdir():
        shutil.copy(f, into / f.name)


HOW = ("mlx_vlm.generate CLI path: prompt_utils.apply_chat_template(processor, model.config, prompt, "
       "num_images=N, num_audios=0, enable_thinking=False); utils.prepare_inputs for the prompt ids; "
       f"stream_generate(temperature=0.0, max_tokens={MAX_TOKENS}) for the generated ids (its last chunk's "
       "token_ids: an EOS that stopped it included)")


def run_cases(name: str, case: dict, images: list[str]) -> list[dict]:
    """The 1- and 2-image cases of one fixture (its overlay rewritten first)."""
    import mlx.core as mx
    from mlx_vlm import load
    from mlx_vlm.generate import stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs, load_image

    out_cases = []
    odir = OUT / name
    overlay(name, case, odir)
    with tempfile.TemporaryDirectory() as tmp:
        assemble(name, odir, Path(tmp))
        model, processor = load(tmp)
        config = model.config
        for n in (1, 2):
            chosen = images[:n]
            # dispatch.main: prompt → apply_chat_template(processor, config, prompt,
            # num_images=…, num_audios=0, enable_thinking=False)
            prompt = apply_chat_template(processor, config, PROMPT, num_images=n, num_audios=0,
                                         enable_thinking=False)
            itok = getattr(model.config, "image_token_index", None) or getattr(model.config, "image_token_id", None)
            inputs = prepare_inputs(processor, images=[load_image(p) for p in chosen], prompts=prompt,
                                    image_token_index=itok)
            ids = inputs["input_ids"].reshape(-1).tolist()
            text = ""
            for chunk in stream_generate(model, processor, prompt, chosen, max_tokens=MAX_TOKENS,
                                         temperature=0.0):
                text += chunk.text
                prompt_tokens = chunk.prompt_tokens
                if chunk.finish_reason is not None:
                    # The last chunk: every generated id (an EOS that stopped it included).
                    out, finish = list(chunk.token_ids), chunk.finish_reason
            assert prompt_tokens == len(ids), (prompt_tokens, len(ids))
            out_cases.append({"model": name, "images": [f"images/{Path(p).name}" for p in chosen],
                              "prompt": PROMPT, "templated": prompt, "prompt_ids": ids, "generated": out,
                              "finish_reason": finish, "text": text})
            print(name, n, repr(prompt), len(ids), out)
            mx.clear_cache()
    return out_cases


def main() -> None:
    """All fixtures (generate.json written afresh), or only those named on the command line:
    their cases and overlays replaced, every other case kept as it is, and the run's
    provenance recorded under `added` for each named fixture."""
    only = sys.argv[1:]
    unknown = [m for m in only if m not in CASES]
    if unknown:
        sys.exit(f"unknown fixture(s) {unknown}: pick from {list(CASES)}")
    images = [str(REPO / "goldens" / "vision" / "images" / f) for f in IMAGES]
    path = OUT / "generate.json"
    if not only:
        cases = []
        for name, case in CASES.items():
            cases.extend(run_cases(name, case, images))
        write_json(path, {
            "provenance": provenance("mlx-vlm", "mlx-vlm"),
            "generator": GENERATOR,
            "how": HOW,
            "overlay": "each model dir is goldens/models/<model> (model.safetensors, the processor's config "
                       "(preprocessor_config.json, or gemma4's processor_config.json), generation_config.json) "
                       "with generate/<model>/ (config.json, tokenizer.json, tokenizer_config.json, gemma3's "
                       "processor_config.json) over it",
            "cases": cases,
        })
        return
    doc = json.loads(path.read_text())
    doc["cases"] = [c for c in doc["cases"] if c["model"] not in only]
    added = doc.setdefault("added", {})
    for name in only:
        doc["cases"].extend(run_cases(name, CASES[name], images))
        added[name] = {
            "provenance": provenance("mlx-vlm", "mlx-vlm"),
            "how": HOW,
            "overlay": "goldens/models/<model> (" + ", ".join(CASES[name].get("files", FILES))
                       + ") with generate/<model>/ (config.json, tokenizer.json, tokenizer_config.json) over it",
        }
    write_json(path, doc)


if __name__ == "__main__":
    main()
