"""Per-layer KV-cache budgets from query self-similarity (TAPPA's allocation). Pure functions.

A layer whose recent queries are alike attends predictably and needs little cache; one whose queries
differ (retrieval-like) needs more. With P_l = 1 - q-similarity of layer l's post-RoPE queries over the
last prompt tokens, layer l gets B_l proportional to P_l, no more than it can attend to (the sequence
length, or its sliding window), the excess going to the other layers, and all budgets summing to
B times the number of layers.
"""

import math

from prunetool.errors import OptionError

RECENT_QUERIES = 32  # TAPPA scores the last 32 prompt tokens' queries


def water_fill(weights: list[float], total: float, caps: list[float]) -> list[float]:
    """Shares proportional to `weights` summing to `total`, none above its cap; the excess is redistributed.

    Layers whose proportional share would pass their cap are pinned to it and the rest is shared again
    among the others, until no share passes its cap. Zero weights share equally if nothing else is left.
    """
    if total > sum(caps) + 1e-9:
        raise OptionError(f"a total budget of {total:g} tokens exceeds what the layers can hold ({sum(caps):g})")
    shares = [0.0] * len(weights)
    open_layers = set(range(len(weights)))
    remaining = total
    while open_layers:
        weight = sum(max(0.0, weights[i]) for i in open_layers)
        proposal = {i: remaining * (max(0.0, weights[i]) / weight if weight > 0 else 1 / len(open_layers))
                    for i in open_layers}
        over = [i for i in open_layers if proposal[i] > caps[i]]
        if not over:
            for i in open_layers:
                shares[i] = proposal[i]
            break
        for i in over:
            shares[i] = caps[i]
            remaining -= caps[i]
            open_layers.remove(i)
    return shares


def whole_tokens(shares: list[float], caps: list[int]) -> list[int]:
    """Round to integers with the same (integer) sum: floors, then +1 by largest remainder below the cap."""
    floors = [min(cap, math.floor(share + 1e-9)) for share, cap in zip(shares, caps)]
    missing = round(sum(shares)) - sum(floors)
    order = sorted(range(len(shares)), key=lambda i: shares[i] - floors[i], reverse=True)
    for i in order:
        if missing <= 0:
            break
        if floors[i] < caps[i]:
            floors[i] += 1
            missing -= 1
    return floors


def check_kv_budget(per_layer: int, caps: list[int]) -> None:
    """Refuse a budget no layer could use, before the slow probe runs."""
    if per_layer < 1:
        raise OptionError(f"--kv-budget must be at least 1 token per layer, got {per_layer}")
    if per_layer > max(caps):
        raise OptionError(f"--kv-budget {per_layer} exceeds the sequence length ({max(caps)}); "
                          "no layer can use more cache than the tokens it attends to")


def kv_budgets(similarity: list[float], per_layer: int, caps: list[int]) -> dict:
    """The budget file: per layer P_l, the exact share, the whole-token budget; totals and the rule."""
    check_kv_budget(per_layer, caps)
    unpredictability = [1.0 - value for value in similarity]
    total = per_layer * len(similarity)
    shares = water_fill(unpredictability, total, caps)
    budgets = whole_tokens(shares, caps)
    return {
        "format": "prunetool-kv-budget/1",
        "rule": "P_l = 1 - mean post-RoPE query self-similarity over the last "
                f"{RECENT_QUERIES} prompt tokens; budget_l proportional to P_l, capped at the tokens the layer can "
                "attend to, excess redistributed; budgets sum to kv_budget x layers",
        "kv_budget": per_layer,
        "total": total,
        "layers": [{"index": index, "q_similarity_recent": sim, "unpredictability": p, "share": share,
                    "cap": cap, "budget": budget}
                   for index, (sim, p, share, cap, budget)
                   in enumerate(zip(similarity, unpredictability, shares, caps, budgets))],
        "budgets": budgets,
    }
