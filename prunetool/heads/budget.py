"""Per-layer KV-cache budgets from query self-similarity (TAPPA's allocation). Pure functions.

A layer whose recent queries are alike attends predictably and needs little cache; one whose queries
differ (retrieval-like) needs more. With P_l = 1 - q-similarity of layer l's post-RoPE queries over the
last prompt tokens, layer l gets B_l proportional to P_l, no more than it can attend to (the sequence
length, or its sliding window), the excess going to the other layers, and all budgets summing to
B times the number of layers.
"""

from prunetool.errors import OptionError
from prunetool.kv.schedules import RECENT_QUERIES, water_fill, whole_tokens


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
