"""Tokenization goldens for the real tokenizers (scripts/fetch_fixtures.sh puts them in the
cache dir): for each text, transformers' `tokenizer(text, add_special_tokens=True)` and
`(…, add_special_tokens=False)` ids, and `tokenizer.decode(ids)` of both (special tokens
kept, as transformers decodes by default).

    oracles/.venv/bin/python oracles/gen_tokenize.py [FIXTURE…] [--out DIR]

Texts (the same list for every tokenizer, plus a few with the tokenizer's own added tokens):
a hand-written list — scripts and languages (Latin with diacritics, Cyrillic, Greek, Arabic,
Hebrew, Devanagari, CJK, Thai, Korean), code in several languages, emoji with ZWJ sequences,
skin tones and flags, whitespace runs, tabs and newlines, special-token strings of several
families inside text, very long words, numbers, URLs, the empty string — and texts a seeded
generator composes from pools of those pieces. The golden pins the sha256 of the
tokenizer.json it was made from; the gate checks it first.

Output: goldens/tokenize/<fixture>/index.json (one case per line; no machine layer: ids and
text do not depend on the machine).
"""

import argparse
import hashlib
import json
import os
import random
from pathlib import Path

from transformers import AutoTokenizer

from provenance import GOLDENS, provenance, write_atomic

FIXTURES = [
    "qwen3", "gemma3", "llama3.1", "llama3.2", "mistral-v1", "mistral-v3", "deepseek-v3", "llama2",
    "gpt-oss", "deepseek-v3-model", "deepseek-v3-qwen2",
]
SEED = 20


def fixture_dir(name: str) -> Path:
    """Where scripts/fetch_fixtures.sh put tokenizer fixture `name` (harness::fixtures)."""
    cache = os.environ.get("ENGINE_CACHE_DIR")
    if not cache:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        cache = os.path.join(xdg, "mlx-engine")
    d = Path(cache) / "fixtures" / "tokenizers" / name
    if not (d / "tokenizer.json").is_file():
        raise SystemExit(f"the tokenizer fixture `{name}` is missing ({d}): run `bash scripts/fetch_fixtures.sh`")
    return d


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


SPECIALS = [
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>",
    "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<start_of_image>",
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|python_tag|>", "<s>", "</s>", "<unk>", "[INST]", "[/INST]", "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]", "<0x41>", "▁", "<|reserved_special_token_5|>",
]

HAND = [
    "", " ", "  ", "\n", "\t", "\r\n", "a", "A", "Hello", " Hello", "Hello ", "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "many     spaces    between\t\ttabs\t and\n\n\nnewlines\n",
    "\n\n\n\n", "\t\t\t", "    indented\n        more\n", " \n \n ", "a\u00a0b\u2003c\u200bd",
    "Héllo wörld, naïve café, façade, résumé, Ångström, Øresund, œuvre, straße",
    "Zażółć gęślą jaźń. Příliš žluťoučký kůň úpěl ďábelské ódy.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. Καλημέρα κόσμε!",
    "مرحبا بالعالم. هذا نص عربي مع أرقام ١٢٣٤٥ و 12345.",
    "שלום עולם! זהו טקסט בעברית עם ניקוד: שָׁלוֹם.",
    "नमस्ते दुनिया। यह हिंदी में एक वाक्य है। क्षत्रिय ज्ञान",
    "你好，世界！这是一个中文句子，包含标点符号。",
    "日本語のテキスト、ひらがな・カタカナ・漢字を含む。東京都",
    "สวัสดีชาวโลก นี่คือประโยคภาษาไทย",
    "안녕하세요 세계! 한국어 문장입니다. 갑니다",
    "Mixed: English, русский, 中文, العربية, हिन्दी, 한국어, ไทย, ελληνικά.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!(\"{v:?}\");\n}\n",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }\n",
    "const f = async (x) => { await fetch(`/api/${x}`); return x ?? null; };",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC LIMIT 10;",
    "<html><body><div class=\"a\">Hi &amp; bye</div></body></html>",
    "{\"key\": [1, 2.5, -3e10, true, null], \"nested\": {\"a\": \"b\"}}",
    "if [ -f \"$HOME/.bashrc\" ]; then source ~/.bashrc; fi",
    "x = [i**2 for i in range(100) if i % 3 == 0]  # comment",
    "😀😃😄😁 🙂🚀🔥 ❤️ 👍🏽 👋🏿",
    "👨‍👩‍👧‍👦 family, 👩🏽‍💻 coder, 🏳️‍🌈 flag, 🧑‍🤝‍🧑 people",
    "🇺🇸🇬🇧🇯🇵🇩🇪🇫🇷 flags 🇺🇳",
    "✔︎ ✅ ☑️ ©® ™ § ¶ † ‡ • … ‰ ′ ″ € £ ¥ ₹ ₿",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙 𝒮𝒸𝓇𝒾𝓅𝓉 and 𐍈 gothic",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_start|>inside<|im_end|>words",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<s>[INST] What is 2+2? [/INST] 4</s>",
    "[INST]no spaces[/INST]",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "<think>\nreasoning here\n</think>\n\nanswer",
    "<bos><eos><pad> and <unk> tokens, < s > not a token, <s > neither",
    "<0x41><0x42> byte tokens as text",
    "▁▁ metaspace chars ▁ in text▁",
    "Pneumonoultramicroscopicsilicovolcanoconiosis",
    "Rindfleischetikettierungsüberwachungsaufgabenübertragungsgesetz",
    "a" * 300, "ab" * 150, "xyz" * 100 + " " + "Z" * 80, "😀" * 40, "中" * 120,
    "1234567890", "3.14159265358979323846", "-0.000001", "1e-10 2E+30", "1,000,000.00",
    "0x1F 0b1010 0o777", "12:30:45 2024-01-31T23:59:59Z", "$1,234.56 €99,99 ¥10000",
    "https://example.com/path/to/page?query=1&other=two#fragment",
    "mailto:someone@example.org and ftp://files.example.net/pub/",
    "www.some-site.co.uk/index.html?a=%20b",
    "C:\\Users\\name\\Documents\\file.txt",
    "It's a dog's life, isn't it? We'll see, they'd say, you're right.",
    "Don't stop! Won't stop... Can't stop?!",
    "Hello , world . What ? Yes ! a , b",
    "\"quoted\" 'single' «guillemets» „German“ 「Japanese」",
    "(parentheses) [brackets] {braces} <angles>",
    "~!@#$%^&*()_+`-={}|[]\\:\";'<>?,./",
    "\u0000\u0001\u0007\u001b[31mred\u001b[0m",
    "e\u0301 vs é, A\u030a vs Å, ﬁ ligature, Ⅻ, ①, ｆｕｌｌｗｉｄｔｈ",
    "ZWJ\u200dZWNJ\u200cWJ\u2060BOM\ufeff",
    "end with space ", " start with space", "   ", "\n\nHello\n\n",
    # Where a rebuilt tokenizer differs from its tokenizer.json (issue 38): leading spaces
    # (Metaspace's prepend scheme), digit runs (a pre-tokenizer's digit split), tabs, CJK and
    # emoji (byte fallback, or no token at all without an unk), at the start of the text.
    " 1", "  2", " 12", "123", "1234", "12345678901234567890", " 2024年3月9日", "v1.2.3-rc4",
    "x1y22z333w4444", "\t1\t22\t333", "\tTab first", " \tspace then tab", "\t\t 中文",
    "  two leading", "   three leading", " 你好", " 😀", "😀 first", " ö", "ÿþý", "\u0080\u00ff",
    "\U0001f9ea\U0001fae0 rare emoji", "\u2581 lone metaspace", " \u2581x", "\x7f del",
]

POOLS = {
    "latin": ["the", "of", "and", "machine", "learning", "Zürich", "naïve", "été", "Łódź", "piñata"],
    "cyrillic": ["привет", "мир", "язык", "модель", "Ёлка", "щука"],
    "greek": ["γεια", "κόσμος", "λόγος", "Ψ", "ωμέγα"],
    "arabic": ["مرحبا", "كتاب", "السلام", "عليكم"],
    "hebrew": ["שלום", "ספר", "עולם"],
    "devanagari": ["नमस्ते", "भारत", "ज्ञान", "क्षमा"],
    "cjk": ["中文", "漢字", "東京", "学习", "ひらがな", "カタカナ"],
    "thai": ["สวัสดี", "ภาษา", "ไทย"],
    "korean": ["안녕", "한국어", "세계", "똠방각하"],
    "code": ["fn", "let", "x+=1;", "->", "=>", "::", "{}", "()", "[]", "&&", "||", "!=", "==", "#[derive(Debug)]",
             "print(", "return;", "</div>", "${x}", "@decorator", "0xff"],
    "emoji": ["😀", "🚀", "👍🏻", "👨‍💻", "🏳️‍⚧️", "🇫🇷", "❤️‍🔥", "🫠", "✨"],
    "number": ["0", "7", "42", "1000", "3.5", "-17", "2024", "99999999", "1/2", "½"],
    "url": ["https://a.io", "http://x.org/y?z=1", "a@b.com", "/usr/local/bin", "../up"],
    "special": SPECIALS,
}
SEPARATORS = [" ", " ", " ", "", "  ", "\t", "\n", "\n\n", " \n", ",", ". ", "   ", "\r\n"]


def generated(rng: random.Random, count: int) -> list[str]:
    names = sorted(POOLS)
    out = []
    for _ in range(count):
        picks = rng.sample(names, rng.randint(1, 4))
        parts = []
        for _ in range(rng.randint(1, 14)):
            parts.append(rng.choice(POOLS[rng.choice(picks)]))
            parts.append(rng.choice(SEPARATORS))
        text = "".join(parts)
        if rng.random() < 0.2:
            text = rng.choice(SEPARATORS) + text
        if rng.random() < 0.3:
            text = text.rstrip()
        out.append(text)
    return out


def texts_for(tokenizer) -> list[str]:
    rng = random.Random(SEED)
    texts = list(HAND) + generated(rng, 240)
    # The tokenizer's own added tokens (a seeded sample), alone and inside text.
    added = sorted(t.content for t in tokenizer.added_tokens_decoder.values())
    own = random.Random(SEED + 1).sample(added, min(12, len(added)))
    for k, tok in enumerate(own):
        texts.append(tok if k % 3 == 0 else f"word{tok}word {tok} {tok}{tok}\n{tok}")
    return texts


def main(name: str, out_root: str | None) -> None:
    src = fixture_dir(name)
    tokenizer = AutoTokenizer.from_pretrained(src)
    cases = []
    for text in texts_for(tokenizer):
        with_special = tokenizer(text, add_special_tokens=True)["input_ids"]
        plain = tokenizer(text, add_special_tokens=False)["input_ids"]
        cases.append({
            "text": text,
            "ids": with_special,
            "ids_plain": plain,
            "decoded": tokenizer.decode(with_special),
            "decoded_plain": tokenizer.decode(plain),
        })
    # Ids and text are the same on every machine: one reference golden, no machine layer.
    dest = Path(out_root) / name if out_root else GOLDENS / "tokenize" / name
    header = {
        "provenance": provenance("transformers", "transformers"),
        "generator": "oracles/gen_tokenize.py",
        "fixture": name,
        "settings": {
            "tokenizer_json_sha256": sha256(src / "tokenizer.json"),
            "tokenizer_class": type(tokenizer).__name__,
            "tokenizer_len": len(tokenizer),
            "seed": SEED,
        },
    }
    head = json.dumps(header, indent=1, ensure_ascii=False)[:-2]
    lines = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in cases)
    write_atomic(dest / "index.json", f"{head},\n \"cases\": [\n{lines}\n ]\n}}\n")
    print(f"tokenize/{name}: {len(cases)} texts -> {dest}")


def fixture_main(main, fixtures) -> None:
    """The command line of a per-fixture golden generator: `[FIXTURE ...] [--out DIR]`,
    calling main(fixture, out) for each (every fixture by default)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("fixtures", nargs="*", default=fixtures)
    ap.add_argument("--out", help="write <out>/<fixture>/ instead of the goldens (live diffs)")
    args = ap.parse_args()
    for fixture in args.fixtures:
        main(fixture, args.out)


if __name__ == "__main__":
    fixture_main(main, FIXTURES)
