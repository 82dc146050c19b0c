"""Long-context tasks under compressed KV caches: one prefill per document, every schedule judged from it.

For each document the prompt (all but its last token) is prefilled once; the full cache and each schedule's
compressed cache are then built from that prefill, and the document is scored through each cache: greedy
generation of the target's length (right when it is exactly the target) or, for multiple choice, the
choice with the highest log-likelihood. The cache column says how many positions each layer kept on
average, as a share of what the full cache holds for the same prompts.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prunetool.model.architecture import inspect_decoder
from prunetool.evaluation.long_context import LongTask, documents_for
from prunetool.kv import snapkv
from prunetool.kv.schedules import Schedule, layer_budgets

FULL = "full"


def encode_pair(tokenizer, prompt: str, choice: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: the prompt's tokens, then whatever the choice adds to the prompt's tokenisation."""
    context = tokenizer(prompt)["input_ids"]
    whole = tokenizer(prompt + choice)["input_ids"]
    return context, whole[len(context):]


def document_inputs(tokenizer, document: dict) -> tuple[list[int], dict]:
    """The prompt's tokens and what to score: {"target": tokens} or {"choices": [tokens], "answer": i}."""
    if "target" in document:
        context, target = encode_pair(tokenizer, document["prompt"], document["target"])
        return context, {"target": target}
    pairs = [encode_pair(tokenizer, document["prompt"], choice) for choice in document["choices"]]
    return pairs[0][0], {"choices": [continuation for _, continuation in pairs], "answer": document["answer"]}


STACK_ELEMENTS = 2**26  # keys + values of the caches decoded together: 256 MiB in float32


def rows_right(model, cache: snapkv.KeptCache, last_token: int, scoring: dict) -> list[bool]:
    """Per cache row: greedy generation equals the target, or the right choice is the most likely one."""
    if "target" in scoring:
        target = scoring["target"]
        return [generated == target for generated in snapkv.greedy_generate(model, cache, last_token, len(target))]
    choices = scoring["choices"]
    if all(len(choice) == 1 for choice in choices):
        logprobs = snapkv.next_token_logprobs(model, cache, last_token)[:, [choice[0] for choice in choices]]
        return (logprobs.argmax(dim=-1) == scoring["answer"]).tolist()
    if cache.rows != 1:
        raise ValueError("multi-token choices are scored one cache at a time")
    logprobs = snapkv.continuation_logprobs(model, cache, last_token, choices)
    return [max(range(len(logprobs)), key=logprobs.__getitem__) == scoring["answer"]]


def stack_groups(caches: dict[str, snapkv.KeptCache], scoring: dict) -> list[list[str]]:
    """Labels decoded together: as many caches as fit STACK_ELEMENTS once padded (one each for multi-token choices)."""
    labels = list(caches)
    if "choices" in scoring and any(len(choice) > 1 for choice in scoring["choices"]):
        return [[label] for label in labels]
    groups, current, longest = [], [], None
    for label in labels:
        sizes = [2 * keys[0].numel() for keys in caches[label].keys]  # keys and values, one row
        grown = sizes if longest is None else [max(a, b) for a, b in zip(longest, sizes)]
        if current and sum(grown) * (len(current) + 1) > STACK_ELEMENTS:
            groups.append(current)
            current, grown = [], sizes
        current.append(label)
        longest = grown
    return groups + [current]


def evaluate_long_context(model, tokenizer, tasks: list[LongTask], schedules: list[Schedule], *, window: int,
                          haystack: str, limit: int | None = None,
                          on_document: Callable[[str, int, int], None] | None = None) -> dict:
    """{task: accuracy per cache, documents, prompt tokens}, cache sizes per schedule, and the seconds spent."""
    columns = [FULL] + [schedule.text for schedule in schedules]
    kept = {label: 0 for label in columns}
    held = 0  # positions the full cache holds, summed over documents and layers
    seconds = {"prefill": 0.0, "compress": 0.0, "score": 0.0}
    results = {}
    for task in tasks:
        documents = documents_for(task, tokenizer, haystack, limit)
        right = {label: 0 for label in columns}
        tokens = 0
        for number, document in enumerate(documents, 1):
            context, scoring = document_inputs(tokenizer, document)
            tokens += len(context)
            prefilled = snapkv.prefill(model, context, window=window)
            seconds["prefill"] += prefilled.seconds
            caches = {FULL: snapkv.full_cache(prefilled)}
            for schedule in schedules:
                budgets = layer_budgets(schedule, prefilled.caps, q_similarity=prefilled.q_similarity,
                                        preference=prefilled.preference, full_attention=prefilled.full_attention)
                caches[schedule.text] = snapkv.compress(prefilled, budgets)
                seconds["compress"] += caches[schedule.text].seconds
            held += sum(caches[FULL].kept)
            for label, cache in caches.items():
                kept[label] += sum(cache.kept)
            clock = time.perf_counter()
            for group in stack_groups(caches, scoring):
                stacked = snapkv.stack([caches[label] for label in group]) if len(group) > 1 else caches[group[0]]
                for label, correct in zip(group, rows_right(model, stacked, prefilled.last_token, scoring)):
                    right[label] += correct
            seconds["score"] += time.perf_counter() - clock
            if on_document is not None:
                on_document(task.name, number, len(documents))
        results[task.name] = {"documents": len(documents), "mean_prompt_tokens": tokens / max(1, len(documents)),
                              "accuracy": {label: right[label] / max(1, len(documents)) for label in columns}}
    layers = len(inspect_decoder(model).attentions)
    documents_seen = sum(result["documents"] for result in results.values())
    cache = {label: {"mean_tokens_per_layer": kept[label] / max(1, documents_seen * layers),
                     "share_of_full": kept[label] / held if held else None} for label in columns}
    return {"window": window, "columns": columns, "tasks": results, "cache": cache,
            "mean_accuracy": {label: sum(r["accuracy"][label] for r in results.values()) / max(1, len(results))
                              for label in columns},
            "seconds": seconds}
