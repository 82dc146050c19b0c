"""Long-context retrieval tasks that run offline: needle in a haystack, RULER-style multi-key, long hop probes.

Retrieval documents `{"prompt", "target"}` are scored by greedy generation: right when the model's next
tokens are exactly the target's (RULER's metric, Hsieh et al., 2024, arXiv 2404.06654). Probe documents
`{"prompt", "choices", "answer"}` are scored by the log-likelihood of each choice (the highest wins), as
lm-eval scores them. Either way a compressed KV cache is judged exactly like the full one.

- `needle_N` (20 documents, every depth in turn, so the first 5k cover all depths): one sentence "The
  special magic number for KEY is VALUE." (VALUE six digits) placed at a depth of 0, 25, 50, 75 or 100%
  of an N-token haystack, then asked for at the end.
- `multikey_N` (20 documents): four such sentences with different keys at random depths; one is asked
  for, so the model must match the key, not just recall a number (RULER's multi-key needle).
- `hop_number_N` and `hop_name_N` (N items): the positional and symbolic hop probes of `hop.py`.

The haystack is WikiText-2's test text when the data folder has it (newlines normalised), otherwise
sentences generated from a fixed seed. Every document comes from a seed, so runs and models compare.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass
from pathlib import Path

from prunetool.evaluation import hop

KINDS = ("needle", "multikey")
LENGTHS = (512, 1024, 2048)  # tokens
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DOCS_PER_DEPTH = 4
MULTIKEY_DOCS = 20
KEYS_IN_MULTIKEY = 4
DIGITS = 6
SEED = 4321
HAYSTACK_FILE = "wikitext2-test.raw"
INTRO = "Read the text below and remember the special magic numbers hidden in it.\n\n"
ADJECTIVES = ("amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
              "lively", "misty", "noble", "odd", "proud", "quiet", "rapid", "silver", "tidy")
NOUNS = ("harbor", "falcon", "meadow", "lantern", "orchard", "glacier", "violin", "compass", "canyon", "teapot",
         "beacon", "thistle", "anchor", "pebble", "comet", "willow", "garnet", "ferry", "quarry", "saddle")
_SUBJECTS = ("The farmer", "A small boat", "The old clock", "Our neighbour", "The river", "A tired student",
             "The committee", "The baker", "A gray cat", "The museum")
_VERBS = ("carried", "watched", "painted", "forgot", "repaired", "described", "visited", "counted", "followed",
          "measured")
_OBJECTS = ("the wooden fence", "a bright kite", "the northern road", "three apples", "the quiet library",
            "a long letter", "the summer market", "an empty bottle", "the stone bridge", "a new song")
_PLACES = ("before dawn", "near the station", "after the storm", "in the valley", "during the festival",
           "by the lake", "at noon", "on the hill", "under the trees", "in the city")


@dataclass(frozen=True)
class LongTask:
    name: str
    kind: str  # needle, multikey, hop_number, hop_name
    length: int  # tokens (needle, multikey) or items (hop)


def parse_name(name: str) -> LongTask | None:
    """`needle_1024` / `multikey_2048` / `hop_name_512`; None for anything else."""
    kind, _, length = name.rpartition("_")
    if kind in KINDS and length.isdigit() and int(length) >= 64:
        return LongTask(name, kind, int(length))
    parsed = hop.parse_task_name(name)
    return LongTask(name, parsed[0], parsed[1]) if parsed else None


def expand(name: str) -> list[str]:
    """`needle` / `multikey` stand for every default length; a sized name for itself."""
    if name in KINDS:
        return [f"{name}_{length}" for length in LENGTHS]
    return [name] if parse_name(name) and name.split("_")[0] in KINDS else []


def generated_haystack(sentences: int = 4000, seed: int = SEED) -> str:
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}."
                    for _ in range(sentences))


def load_haystack(data_dir: Path | None) -> tuple[str, str]:
    """(text, where it came from)."""
    if data_dir is not None and (Path(data_dir) / HAYSTACK_FILE).is_file():
        raw = (Path(data_dir) / HAYSTACK_FILE).read_bytes().decode("utf-8")
        return raw.replace("\r\n", "\n"), HAYSTACK_FILE
    return generated_haystack(), f"generated sentences (seed {SEED})"


def _key(rng: random.Random, taken: set[str]) -> str:
    while True:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in taken:
            taken.add(key)
            return key


def _number(rng: random.Random, taken: set[str]) -> str:
    while True:
        value = str(rng.randrange(10 ** (DIGITS - 1), 10 ** DIGITS))
        if value not in taken:
            taken.add(value)
            return value


def _line_and_sentence_starts(haystack: str) -> list[int]:
    """Offsets where a haystack slice may begin: 0, after a newline, after ". " (ascending)."""
    return [0] + [i + 1 for i, char in enumerate(haystack) if char == "\n" or (char == " " and haystack[i - 1] == ".")]


def _haystack_slice(haystack: str, starts: list[int], tokenizer, tokens: int, rng: random.Random) -> str:
    """About `tokens` tokens of the haystack from a random line or sentence start, cut at a token boundary."""
    span = tokens * 8  # characters: more than `tokens` tokens of English for any tokenizer here
    last = max(1, len(haystack) - span)
    start = rng.choice(starts[:bisect.bisect_right(starts, last)])
    chunk = haystack[start:start + span]
    offsets = tokenizer(chunk, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return chunk[:offsets[min(tokens, len(offsets)) - 1][1]]


def _insert(text: str, sentences: list[tuple[float, str]]) -> str:
    """Put each sentence at its depth (a fraction of the haystack), moved back to the nearest space or newline.

    Every position is found on the haystack itself, then the sentences go in from the last position back,
    so one sentence never lands inside another.
    """
    placed = []
    for depth, sentence in sentences:
        at = int(len(text) * depth)
        while 0 < at < len(text) and text[at - 1] not in " \n":
            at -= 1
        placed.append((at, sentence))
    for at, sentence in sorted(placed, key=lambda item: item[0], reverse=True):
        before = "" if at == 0 or text[at - 1] in " \n" else " "
        text = text[:at] + before + sentence + (" " if at < len(text) else "") + text[at:]
    return text


def needle_documents(kind: str, length: int, tokenizer, haystack: str, seed: int = SEED) -> list[dict]:
    """Needle or multi-key documents of about `length` tokens for this tokenizer."""
    documents = []
    starts = _line_and_sentence_starts(haystack)  # once per task, not per document
    plan = ([(depth, index) for index in range(DOCS_PER_DEPTH) for depth in DEPTHS] if kind == "needle"
            else [(None, index) for index in range(MULTIKEY_DOCS)])
    for depth, index in plan:
        rng = random.Random(f"{kind}/{length}/{seed}/{depth}/{index}")
        keys, values = set(), set()
        count = 1 if kind == "needle" else KEYS_IN_MULTIKEY
        pairs = [(_key(rng, keys), _number(rng, values)) for _ in range(count)]
        depths = [depth] if kind == "needle" else [rng.random() for _ in pairs]
        asked = rng.randrange(count)
        key, value = pairs[asked]
        question = (f"\n\nWhat is the special magic number for {key} mentioned in the text above? "
                    f"The special magic number for {key} is")
        overhead = len(tokenizer(INTRO + question, add_special_tokens=False)["input_ids"]) + 20 * count
        text = _haystack_slice(haystack, starts, tokenizer, max(16, length - overhead), rng)
        text = _insert(" " + text.strip(), [(d, f"The special magic number for {k} is {v}.")
                                            for d, (k, v) in zip(depths, pairs)])
        documents.append({"prompt": INTRO + text.strip() + question, "target": " " + value, "depth": depth,
                          "keys": [k for k, _ in pairs]})
    return documents


def hop_documents(kind: str, length: int, seed: int = hop.SEED) -> list[dict]:
    """The hop probe's documents with their 26 letter choices."""
    prefix = " " if kind == "hop_number" else ""
    return [{"prompt": doc["prompt"], "choices": [prefix + letter for letter in hop.LETTERS], "answer": doc["answer"]}
            for doc in hop.make_documents(kind, length, seed=seed)]


def documents_for(task: LongTask, tokenizer, haystack: str, limit: int | None = None) -> list[dict]:
    if task.kind in KINDS:
        documents = needle_documents(task.kind, task.length, tokenizer, haystack)
    else:
        documents = hop_documents(task.kind, task.length)
    return documents[:limit] if limit else documents
