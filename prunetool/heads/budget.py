"""The per-layer KV-cache budgets `prunetool heads --kv-budget` writes (kv_budget.json). Pure functions.

A layer whose recent queries are alike attends predictably and needs little cache; one whose queries
differ (retrieval-like) needs more. The rule is `eval`'s `tappa-floor` schedule (prunetool/kv/schedules.py),
so the file and the per-prompt schedule cannot drift apart: with P_l = 1 - q-similarity of layer l's
post-RoPE queries over the last prompt tokens, layer l gets B_l proportional to P_l, no more than it can
attend to (the sequence length, or its sliding window), the excess going to the other layers. In a model
mixing sliding-window and full-attention layers, the full-attention layers (the only ones that see far
back) first get at least B: TAPPA's rule read literally gave them the least (docs/kv.md measures both).
"""

from prunetool.kv.schedules import RECENT_QUERIES, Schedule, check_average, layer_shares, whole_tokens

SCHEDULE = "tappa-floor"


def check_kv_budget(per_layer: int, caps: list[int]) -> None:
    """Refuse a budget no layer could use, before the slow probe runs."""
    check_average(per_layer, max(caps), str(per_layer), "the sequence length")


def kv_budgets(similarity: list[float], per_layer: int, caps: list[int], full_attention: list[bool]) -> dict:
    """The budget file: per layer P_l, the exact share, the whole-token budget; totals and the rule."""
    check_kv_budget(per_layer, caps)
    schedule = Schedule(f"{SCHEDULE}:{per_layer}", SCHEDULE, float(per_layer))
    shares = layer_shares(schedule, caps, q_similarity=similarity, full_attention=full_attention)
    budgets = whole_tokens(shares, caps)
    return {
        "format": "prunetool-kv-budget/1",
        "schedule": SCHEDULE,
        "rule": "P_l = 1 - mean post-RoPE query self-similarity over the last "
                f"{RECENT_QUERIES} prompt tokens; full-attention layers of a model that also has sliding-window "
                "layers get at least kv_budget first; the rest is shared in proportion to P_l, capped at the tokens "
                "each layer can attend to, excess redistributed; budgets sum to kv_budget x layers (or all the "
                "layers can hold)",
        "kv_budget": per_layer,
        "total": sum(budgets),
        "layers": [{"index": index, "q_similarity_recent": sim, "unpredictability": 1.0 - sim, "share": share,
                    "cap": cap, "full_attention": full, "budget": budget}
                   for index, (sim, share, cap, full, budget)
                   in enumerate(zip(similarity, shares, caps, full_attention, budgets))],
        "budgets": budgets,
    }
