"""Slow, explicit reference for two lm-eval accuracies: LAMBADA (OpenAI) and ARC.

Deliberately independent of both `prunetool` and `lm_eval`: prunetool runs these tasks through
lm-eval's batched, length-sorted HFLM harness on local data files; this module reads the same
files itself and scores one sequence at a time with plain forward passes, so an agreement
between the two checks the task wiring (data, prompts, targets, metric) rather than repeating it.

Definitions follow lm-eval's `lambada_openai.yaml` and `arc_easy.yaml`:

* LAMBADA: context = text without its last space-separated word, target = " " + that word;
  a document is correct iff the greedy (argmax) token equals the target token at every target
  position, teacher-forced.
* ARC: context = "Question: {stem}\\nAnswer:", each choice is scored by the summed
  log-probability of " {choice}"; correct iff the best choice (first on ties) is the answer.

One difference in tokenization is intentional and small: lm-eval encodes context + target as one
string and splits the ids, here context and target are encoded separately and concatenated.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _read_jsonl(path: Path, limit: int | None) -> list[dict]:
    """The first `limit` records (all when None) of a JSON-lines file."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(records) >= limit:
                break
            if line.strip():
                records.append(json.loads(line))
    return records


def read_lambada(data_dir: str | Path, limit: int | None) -> list[str]:
    """The `text` of the first `limit` records of lambada_openai_test.jsonl (the last word is the target)."""
    return [r["text"] for r in _read_jsonl(Path(data_dir) / "lambada_openai_test.jsonl", limit)]


def read_arc(data_dir: str | Path, limit: int | None, name: str = "ARC-Easy") -> list[dict]:
    """The first `limit` records of `{name}-Test.jsonl` as {"stem", "choices": [text, ...], "answer": index}.

    The answer index comes from the position of `answerKey` among the choice labels, which are
    letters for most questions and digits for a few.
    """
    docs = []
    for r in _read_jsonl(Path(data_dir) / f"{name}-Test.jsonl", limit):
        choices = r["question"]["choices"]
        labels = [c["label"] for c in choices]
        docs.append({
            "stem": r["question"]["stem"],
            "choices": [c["text"] for c in choices],
            "answer": labels.index(r["answerKey"]),
        })
    return docs


def _special_prefix(tokenizer) -> list[int]:
    """The special ids the tokenizer puts before plain text (e.g. [bos] for Gemma, [] for SmolLM2).

    Detected by encoding "a" with and without special tokens, so a tokenizer that has a BOS token
    but does not add it (SmolLM2) gets none, as it would in ordinary use and in lm-eval.
    """
    with_special = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start:start + len(plain)] == plain:
            return list(with_special[:start])
    raise ValueError(f"cannot find {plain} inside {with_special}; unexpected tokenizer")


def _encode(tokenizer, context: str, target: str) -> tuple[list[int], list[int]]:
    """(context ids with the tokenizer's leading special tokens, target ids without any)."""
    ctx = _special_prefix(tokenizer) + tokenizer(context, add_special_tokens=False)["input_ids"]
    tgt = tokenizer(target, add_special_tokens=False)["input_ids"]
    if not ctx or not tgt:
        raise ValueError(f"empty context or target ids for {context[-40:]!r} / {target!r}")
    return ctx, tgt


@torch.no_grad()
def _target_logprobs(model, ctx: list[int], tgt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 log-probabilities over the vocabulary at the positions that predict each target token.

    Returns (logprobs [len(tgt), vocab], target ids [len(tgt)]); the logits at position i predict
    token i + 1, so the target rows start at the last context position.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([ctx + tgt], device=device)
    logits = model(ids).logits[0, len(ctx) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1), ids[0, len(ctx):]


def lambada_accuracy(model, tokenizer, texts: list[str]) -> float:
    """Fraction of texts whose last word is the greedy continuation at every one of its tokens."""
    correct = 0
    for text in texts:
        words = text.split(" ")
        ctx, tgt = _encode(tokenizer, " ".join(words[:-1]), " " + words[-1])
        logprobs, target = _target_logprobs(model, ctx, tgt)
        correct += bool((logprobs.argmax(dim=-1) == target).all())
    return correct / len(texts)


def arc_accuracy(model, tokenizer, docs: list[dict]) -> float:
    """Fraction of questions whose answer has the highest summed log-probability (first index on ties)."""
    correct = 0
    for doc in docs:
        context = f"Question: {doc['stem']}\nAnswer:"
        scores = []
        for choice in doc["choices"]:
            ctx, tgt = _encode(tokenizer, context, " " + choice)
            logprobs, target = _target_logprobs(model, ctx, tgt)
            scores.append(logprobs.gather(1, target[:, None]).sum().item())
        correct += scores.index(max(scores)) == doc["answer"]  # index() gives the first on ties
    return correct / len(docs)
