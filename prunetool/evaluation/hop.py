"""Hop probes: one positional and one symbolic retrieval task, at growing context lengths.

After the positional-vs-symbolic study, a model can find a token either by offset ("3 back") or by
content ("the partner of B"). The two probes isolate each route:

* `hop_number`: a row of random capital letters, then `| k back:`; the answer is the letter k places
  from the end of the row (k = 1 is the last one, k <= 3). Only the offset says where the answer is.
* `hop_name`: pairs such as `B-D` scattered at random places among lower-case filler letters, then
  `B-` on a new line; the answer is D. Only the content says where the answer is.

Each probe is generated at several lengths (items in the row: one letter or pair each, about one token
per filler letter), from a seed, so every run and every model sees the same documents. Four short
solved examples (8 items, the same k) come first so that small models pick up the format. Scored as lm-eval multiple choice
over the 26 capital letters: accuracy per length, chance 1/26.
"""

from __future__ import annotations

import random
import string

KINDS = ("hop_number", "hop_name")
LENGTHS = (16, 64, 256, 1024)
DOCS_PER_LENGTH = 100
SHOTS = 4
SHOT_LENGTH = 8
MAX_BACK = 3
PAIRS = 4
SEED = 1234
LETTERS = list(string.ascii_uppercase)


def task_name(kind: str, length: int) -> str:
    return f"{kind}_{length}"


def parse_task_name(name: str) -> tuple[str, int] | None:
    """`hop_number_256` -> ("hop_number", 256); None for anything that is not a hop probe."""
    kind, _, length = name.rpartition("_")
    if kind in KINDS and length.isdigit() and int(length) >= 8:
        return kind, int(length)
    return None


def expand(name: str) -> list[str]:
    """`hop_number` or `hop` stand for every default length; `hop_name_512` for itself."""
    if name == "hop":
        return [task_name(kind, n) for kind in KINDS for n in LENGTHS]
    if name in KINDS:
        return [task_name(name, n) for n in LENGTHS]
    return [name] if parse_task_name(name) else []


def number_example(rng: random.Random, length: int, back: int) -> tuple[str, str]:
    """A row of `length` letters, then `| k back:`; letters next to the answer differ from it, so off-by-one is wrong."""
    row = [rng.choice(LETTERS) for _ in range(length)]
    target = length - back
    for neighbour in (target - 1, target + 1):
        if 0 <= neighbour < length:
            row[neighbour] = rng.choice([letter for letter in LETTERS if letter != row[target]])
    return f"{' '.join(row)} | {back} back:", " " + row[target]


def name_example(rng: random.Random, length: int, back: int) -> tuple[str, str]:
    """`PAIRS` pairs with all-distinct capitals at random places among filler letters, then `B-` asks for B's partner."""
    del back  # content, not offset, finds the answer here
    pairs = min(PAIRS, max(2, length // 4))
    capitals = rng.sample(LETTERS, 2 * pairs)
    items = [rng.choice(string.ascii_lowercase) for _ in range(length - pairs)]
    for slot, index in enumerate(sorted(rng.sample(range(length), pairs))):
        items.insert(index, f"{capitals[2 * slot]}-{capitals[2 * slot + 1]}")
    asked = rng.randrange(pairs)
    return f"Items: {' '.join(items)}\n{capitals[2 * asked]}-", capitals[2 * asked + 1]


EXAMPLES = {"hop_number": number_example, "hop_name": name_example}


def make_documents(kind: str, length: int, count: int = DOCS_PER_LENGTH, seed: int = SEED) -> list[dict]:
    """`count` prompts with their solved examples, the same for every model and every run."""
    example = EXAMPLES[kind]
    documents = []
    for index in range(count):
        rng = random.Random(f"{kind}/{length}/{seed}/{index}")
        back = rng.randint(1, MAX_BACK)  # the examples ask the same offset as the question
        shots = [example(rng, SHOT_LENGTH, back) for _ in range(SHOTS)]
        question, answer = example(rng, length, back)
        solved = "".join(f"{text}{reply}\n\n" for text, reply in shots)
        documents.append({"prompt": solved + question, "answer": LETTERS.index(answer.strip()), "length": length})
    return documents


def _dataset(kind: str, length: int, documents: int, seed: int, **_):
    """lm-eval's `custom_dataset` hook: called with the task's metadata as keyword arguments."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(make_documents(kind, length, documents, seed))})


def task_config(name: str, count: int = DOCS_PER_LENGTH, seed: int = SEED) -> dict:
    """An lm-eval task config (a dict, passed to simple_evaluate as is) for one probe at one length."""
    kind, length = parse_task_name(name)
    return {
        "task": name,
        "custom_dataset": _dataset,
        "output_type": "multiple_choice",
        "test_split": "test",
        "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{answer}}",
        "doc_to_choice": [(" " if kind == "hop_number" else "") + letter for letter in LETTERS],
        "target_delimiter": "",
        "num_fewshot": 0,
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0, "kind": kind, "length": length, "documents": count, "seed": seed},
    }
