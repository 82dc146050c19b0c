"""The folder's tokenizer.json as llama.cpp's vocabulary keys.

Two kinds of tokenizer.json are written, each only where llama.cpp tokenizes text as transformers does:
* byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen2) -> `tokenizer.ggml.model = "gpt2"`, the merges, and
  `tokenizer.ggml.pre` naming llama.cpp's pre-tokenizer whose regexes match the file's pre_tokenizer;
* SentencePiece-style BPE with byte fallback (Gemma, Llama 2) -> `"llama"`, whose tokenizer merges the
  adjacent pair with the highest score: each token's score is minus the rank of the first merge that makes
  it, so merges happen in transformers' order.
Anything else is refused in one line rather than written with a guessed pre-tokenizer. Special-token ids,
add_bos/add_eos and the chat template come from gguf's SpecialVocab, as in llama.cpp's converter.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import gguf

from prunetool.errors import ModelSourceError, UnsupportedModelError

T = gguf.TokenType
SPACE = "\u2581"  # SentencePiece's visible space
BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
NO_SCORE = -1e9  # tokens no merge makes (specials, bytes, single characters) never win a merge
# tokenizer.json pre-tokenizers, as (kind, settings...) tuples, -> llama.cpp's name for the same regexes
LLAMA3_REGEX = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
                "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
QWEN2_REGEX = LLAMA3_REGEX.replace("\\p{N}{1,3}", "\\p{N}")
GPT2_BYTE_LEVEL = ("ByteLevel", True, False)  # (kind, use_regex, add_prefix_space)
MERGES_FIRST, WORDS_FIRST = ("ignore_merges", False), ("ignore_merges", True)  # llama.cpp sets it per name
KNOWN_PRE = {
    (GPT2_BYTE_LEVEL, MERGES_FIRST): "gpt-2",
    (("Digits", True), GPT2_BYTE_LEVEL, MERGES_FIRST): "smollm",
    (("Split", LLAMA3_REGEX, "Isolated", False), ("ByteLevel", False, False), WORDS_FIRST): "llama-bpe",
    (("Split", QWEN2_REGEX, "Isolated", False), ("ByteLevel", False, False), MERGES_FIRST): "qwen2",
}


@dataclass(frozen=True)
class Vocab:
    """What export writes about the tokenizer, before SpecialVocab adds merges and special tokens."""

    model: str  # "gpt2" or "llama"
    pre: str | None  # llama.cpp pre-tokenizer name (gpt2 only)
    tokens: tuple[str, ...]
    types: tuple[int, ...]
    scores: tuple[float, ...] | None  # llama only
    add_space_prefix: bool | None  # llama only

    def describe(self) -> str:
        return f"{self.model}" + (f" (pre-tokenizer {self.pre})" if self.pre else "") + f", {len(self.tokens)} tokens"


def read_tokenizer_json(folder: Path) -> dict:
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise ModelSourceError(f"{folder} has no tokenizer.json; export writes the vocabulary from it")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelSourceError(f"{path} is not valid JSON ({error})") from None


def pre_signature(pre: dict | None) -> tuple:
    """A pre_tokenizer as a flat tuple of comparable steps."""
    if not pre:
        return ()
    kind = pre.get("type")
    if kind == "Sequence":
        return tuple(step for inner in pre.get("pretokenizers", []) for step in pre_signature(inner))
    if kind == "ByteLevel":
        return (("ByteLevel", bool(pre.get("use_regex", True)), bool(pre.get("add_prefix_space", False))),)
    if kind == "Digits":
        return (("Digits", bool(pre.get("individual_digits", False))),)
    if kind == "Split":
        pattern = pre.get("pattern", {})
        return (("Split", pattern.get("Regex", pattern.get("String")), pre.get("behavior"), bool(pre.get("invert"))),)
    return ((kind,),)


def llama_cpp_pre(tokenizer: dict) -> str:
    """llama.cpp's pre-tokenizer for a byte-level BPE, or a one-line refusal (never a guess).

    The BPE model's ignore_merges (a whole word in the vocabulary is taken as it is) is part of the match,
    since llama.cpp turns it on for llama-bpe and off for the others.
    """
    signature = pre_signature(tokenizer.get("pre_tokenizer"))
    signature += (("ignore_merges", bool(tokenizer["model"].get("ignore_merges"))),)
    if signature in KNOWN_PRE:
        return KNOWN_PRE[signature]
    steps = ", ".join(step[0] + (f"({step[1]!r})" if step[0] in ("Split", "ignore_merges") else "")
                      for step in signature)
    raise UnsupportedModelError(f"tokenizer.json's byte-level pre-tokenizer [{steps}] is unknown to export; llama.cpp "
                                f"would split text differently (known: {', '.join(sorted(KNOWN_PRE.values()))})")


def id_to_token(tokenizer: dict, vocab_size: int) -> tuple[dict[int, str], dict[int, bool]]:
    """Every id's text (model vocab, then added tokens) and, for added tokens, whether they are special."""
    model_vocab = tokenizer["model"].get("vocab")
    if not isinstance(model_vocab, dict):
        raise UnsupportedModelError(f"tokenizer.json's {tokenizer['model'].get('type')} model has no vocab map")
    texts = {int(index): token for token, index in model_vocab.items()}
    added = {}
    for entry in tokenizer.get("added_tokens") or []:
        texts[int(entry["id"])] = entry["content"]
        added[int(entry["id"])] = bool(entry.get("special"))
    if texts and max(texts) >= vocab_size:
        raise ModelSourceError(f"tokenizer.json has token id {max(texts)}, beyond the model's vocab_size {vocab_size}")
    return texts, added


def token_table(texts: dict[int, str], added: dict[int, bool], vocab_size: int, normal_type) -> tuple[list, list]:
    """Tokens and types for ids 0..vocab_size-1; ids the tokenizer lacks become unused [PADn] tokens."""
    tokens, types = [], []
    for index in range(vocab_size):
        if index not in texts:
            tokens.append(f"[PAD{index}]")
            types.append(T.UNUSED)
        elif index in added:
            tokens.append(texts[index])
            types.append(T.CONTROL if added[index] else T.USER_DEFINED)
        else:
            tokens.append(texts[index])
            types.append(normal_type(texts[index]))
    return tokens, types


def byte_level_vocab(tokenizer: dict, vocab_size: int) -> Vocab:
    pre = llama_cpp_pre(tokenizer)
    normalizer = tokenizer.get("normalizer")
    if normalizer and normalizer.get("type") != "NFC":
        raise UnsupportedModelError(f"tokenizer.json's normalizer {normalizer.get('type')} has no llama.cpp "
                                    "counterpart for a byte-level BPE")
    texts, added = id_to_token(tokenizer, vocab_size)
    tokens, types = token_table(texts, added, vocab_size, lambda text: T.NORMAL)
    return Vocab("gpt2", pre, tuple(tokens), tuple(types), None, None)


def space_prefix(tokenizer: dict) -> bool:
    """Whether the SentencePiece-style tokenizer puts a space before the text (llama.cpp's add_space_prefix)."""
    normalizer, pre = tokenizer.get("normalizer") or {}, tokenizer.get("pre_tokenizer") or {}
    steps = normalizer.get("normalizers", [normalizer]) if normalizer.get("type") == "Sequence" else [normalizer]
    kinds = [(step.get("type"), step.get("prepend"), (step.get("pattern") or {}).get("String"), step.get("content"))
             for step in steps if step]
    harmless_pre = not pre or pre_signature(pre) == (("Split", " ", "MergedWithPrevious", False),)
    if kinds == [("Replace", None, " ", SPACE)] and harmless_pre:
        return False
    if kinds == [("Prepend", SPACE, None, None), ("Replace", None, " ", SPACE)] and harmless_pre:
        return True
    if not kinds and pre.get("type") == "Metaspace" and not pre.get("split", True) and pre.get("replacement") == SPACE:
        return pre.get("prepend_scheme", "always") != "never"
    raise UnsupportedModelError("tokenizer.json's SentencePiece-style normalizer/pre-tokenizer is unknown to export; "
                                "llama.cpp would split text differently")


def merge_scores(tokenizer: dict, texts: dict[int, str]) -> dict[int, float]:
    """Minus the rank of the first merge that makes each token: llama.cpp's SPM merges highest score first."""
    ids = {text: index for index, text in texts.items()}
    scores: dict[int, float] = {}
    for rank, merge in enumerate(tokenizer["model"].get("merges") or []):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        index = ids.get(left + right)
        if index is not None and index not in scores:
            scores[index] = -float(rank)
    return scores


def sentencepiece_vocab(tokenizer: dict, vocab_size: int) -> Vocab:
    prefix = space_prefix(tokenizer)
    texts, added = id_to_token(tokenizer, vocab_size)
    unknown = tokenizer["model"].get("unk_token")

    def kind(text: str) -> int:
        return T.BYTE if BYTE_TOKEN.match(text) else T.UNKNOWN if text == unknown else T.NORMAL

    tokens, types = token_table(texts, added, vocab_size, kind)
    scores = merge_scores(tokenizer, texts)
    return Vocab("llama", None, tuple(tokens), tuple(types), tuple(scores.get(i, NO_SCORE) for i in range(vocab_size)),
                 prefix)


def read_vocab(folder: Path, vocab_size: int) -> Vocab:
    """The vocabulary llama.cpp needs, padded to the model's vocab_size, or a one-line refusal."""
    tokenizer = read_tokenizer_json(folder)
    model = tokenizer.get("model") or {}
    decoder = (tokenizer.get("decoder") or {}).get("type")
    if model.get("type") == "BPE" and not model.get("byte_fallback") and decoder == "ByteLevel":
        return byte_level_vocab(tokenizer, vocab_size)
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        return sentencepiece_vocab(tokenizer, vocab_size)
    raise UnsupportedModelError(f"tokenizer.json holds a {model.get('type')} model (decoder {decoder}); export writes "
                                "byte-level BPE and SentencePiece-style BPE vocabularies only")


def vocab_calls(vocab: Vocab) -> list[tuple[str, object]]:
    """GGUFWriter calls for the token list (SpecialVocab adds merges and special tokens afterwards)."""
    calls: list[tuple[str, object]] = [("add_tokenizer_model", vocab.model)]
    if vocab.pre:
        calls.append(("add_tokenizer_pre", vocab.pre))
    calls += [("add_token_list", list(vocab.tokens)), ("add_token_types", [int(t) for t in vocab.types])]
    if vocab.scores is not None:
        calls.append(("add_token_scores", list(vocab.scores)))
    if vocab.add_space_prefix is not None:
        calls.append(("add_add_space_prefix", vocab.add_space_prefix))
    return calls


def special_vocab(folder: Path, vocab: Vocab) -> gguf.SpecialVocab:
    """Special-token ids, add_bos/add_eos, chat template and (for gpt2) merges, read by gguf itself.

    Its log warnings (e.g. about a pair template's separator) say nothing about what llama.cpp computes
    for one sequence, so they are kept off the terminal. add_bos/add_eos are always written.
    """
    log = logging.getLogger("gguf")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        special = gguf.SpecialVocab(folder, load_merges=vocab.model == "gpt2", n_vocab=len(vocab.tokens))
    finally:
        log.setLevel(level)
    for kind in ("bos", "eos"):  # unsaid means "not added" in transformers; llama.cpp's default may differ
        special.add_special_token.setdefault(kind, False)
    return special
