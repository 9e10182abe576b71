"""Small deterministic training sets, in mlx-lm's jsonl shapes, under goldens/data/:

    oracles/.venv/bin/python oracles/make_train_data.py

- sft-chat/        {"messages": [...]} from the corpus's question/answer lines
                   (train: all 7; valid: 3 of them) — an SFT smoke set.
- uppercase/       ORPO {"prompt", "chosen", "rejected"}: "Shout: <phrase>" → the phrase in
                   capitals (chosen) vs as written (rejected); 12 train / 4 validation pairs
                   with disjoint phrases — the positive control (a preference the base model
                   does not have and can learn).
- brevity/         ORPO: "Tell me about <thing>." → one short sentence (chosen) vs the same
                   sentence padded with filler clauses (rejected); 12 train / 4 validation.

Under goldens/data/study/, the dynamic-λ study's two preference sets, where the rejected
response is the chosen one cut short (its first half): complete answers over truncated
ones. ORPO's log-odds use the mean per-token log-probability, so lowering the shared
prefix lowers the shorter rejected mean more than the chosen one — a lever that widens the
margin by making the chosen response less likely (displacement), which a high λ pulls:
- complete/        "Count from three to seven." / "List the days from Tuesday to Saturday." /
                   "List the rainbow colours from red to blue." → the whole run of numbers,
                   days or colours (at least four; the corpus has all three sequences) vs its
                   first half; 36 train / 12 validation pairs.
- shout/           "Shout: <4–6 corpus words>" → all the words in capitals vs the first half
                   of them in capitals; 48 train / 12 validation pairs.

    oracles/.venv/bin/python oracles/make_train_data.py [study]   (study: only those two)
"""

import json
import random
import sys
from pathlib import Path

from provenance import golden_dir

PHRASES = [
    "the sky is blue", "the grass is green", "fix the clock", "open the window",
    "the lamp is warm", "count the birds", "paint the fence", "sort the bolts",
    "read a book", "the robot rests", "oil the arms", "clean the table",
    "the sun is yellow", "the apple is red", "play a song", "build something",
]


def qa_pairs():
    corpus = (Path(__file__).parent / "corpus.txt").read_text()
    for line in corpus.splitlines():
        if line.startswith("Question:") and " Answer: " in line:
            q, a = line.removeprefix("Question: ").split(" Answer: ")
            yield q.strip(), a.strip()


def write(dest: Path, name: str, rows) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def study_sets() -> None:
    rng = random.Random(7)
    runs = [
        ("Count from", "one two three four five six seven eight nine ten"),
        ("List the days from", "Monday Tuesday Wednesday Thursday Friday Saturday Sunday"),
        ("List the rainbow colours from", "red orange yellow green blue indigo violet"),
    ]
    rows = []
    for ask, words in runs:
        seq = words.split()
        for a in range(len(seq)):
            for b in range(a + 3, len(seq)):
                full = seq[a:b + 1]
                rows.append({"prompt": f"{ask} {seq[a]} to {seq[b]}.",
                             "chosen": ", ".join(full) + ".",
                             "rejected": ", ".join(full[:len(full) // 2]) + ","})
    rng.shuffle(rows)
    dest = golden_dir("data/study/complete", portable=True)
    write(dest, "train.jsonl", rows[:-12])
    write(dest, "valid.jsonl", rows[-12:])
    words = ("the sky is blue grass green fix clock open window lamp warm count birds paint "
             "fence sort bolts read book robot rests oil arms clean table sun yellow apple red "
             "play song build something cat tree boat market bread water garden").split()
    rows, seen = [], set()
    while len(rows) < 60:
        phrase = " ".join(rng.choice(words) for _ in range(rng.randint(4, 6)))
        if phrase in seen:
            continue
        seen.add(phrase)
        caps = phrase.upper().split()
        rows.append({"prompt": f"Shout: {phrase}", "chosen": " ".join(caps),
                     "rejected": " ".join(caps[:len(caps) // 2])})
    dest = golden_dir("data/study/shout", portable=True)
    write(dest, "train.jsonl", rows[:48])
    write(dest, "valid.jsonl", rows[48:])
    print("wrote goldens/data/study/{complete,shout}")


def main() -> None:
    study_sets()
    if sys.argv[1:] == ["study"]:
        return
    qa = list(qa_pairs())
    chat = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in qa]
    dest = golden_dir("data/sft-chat")
    write(dest, "train.jsonl", chat)
    write(dest, "valid.jsonl", chat[:3])

    rng = random.Random(5)
    phrases = PHRASES[:]
    rng.shuffle(phrases)
    pairs = [{"prompt": f"Shout: {p}", "chosen": p.upper(), "rejected": p} for p in phrases]
    dest = golden_dir("data/uppercase")
    write(dest, "train.jsonl", pairs[:12])
    write(dest, "valid.jsonl", pairs[12:])
    things = ["the sky", "the grass", "the clock", "the lamp", "the robot", "the tree",
              "the birds", "the spring", "the window", "the table", "the book", "the market",
              "the song", "the gear", "the fence", "the apple"]
    facts = ["it is blue", "it is green", "it ticks", "it is warm", "it fixes things", "it is tall",
             "they sing", "it is new", "it is open", "it is long", "it is old", "it is busy",
             "it is soft", "it is bent", "it is white", "it is red"]
    order = list(range(len(things)))
    rng.shuffle(order)
    brevity = []
    for i in order:
        short = f"{things[i].capitalize()}: {facts[i]}."
        long = (f"{things[i].capitalize()}: well, you see, as I was saying, {facts[i]}, "
                f"and so on and so forth, and that is more or less that.")
        brevity.append({"prompt": f"Tell me about {things[i]}.", "chosen": short, "rejected": long})
    dest = golden_dir("data/brevity")
    write(dest, "train.jsonl", brevity[:12])
    write(dest, "valid.jsonl", brevity[12:])
    print("wrote goldens/data/{sft-chat,uppercase,brevity}")


if __name__ == "__main__":
    main()
