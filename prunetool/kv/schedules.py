"""Per-layer KV-cache budgets at an equal average: uniform, PyramidKV, TAPPA, a file. Pure functions.

A schedule names an average budget B (tokens kept per layer and KV head); every schedule shares the total
B x layers among the layers, never giving a layer more than it can hold (its cap: the prompt length, or
its sliding window), the excess going to the others, and the whole-token budgets summing exactly to the
total whenever the layers can hold it.

- `uniform:B`: every layer the same.
- `pyramid:B`: PyramidKV's linear decrease with depth (Cai et al., 2024, arXiv 2406.02069): the last
  layer gets B / beta, the first 2B - B / beta, the layers between on a straight line; beta = 20 as there.
- `tappa:B`: TAPPA's rule: layer l's share is proportional to 1 - q_l, q_l the mean pairwise cosine of
  its post-RoPE queries over the prompt's last 32 tokens (stable queries, predictable attention: less cache).
- `tappa-floor:B`: the same, except that in a model mixing sliding-window and full-attention layers the
  full-attention layers (the only ones that see the whole prompt) get at least B; the rest is shared by
  the TAPPA rule.
- `tappa-cake:B`: CAKE's layer preference (Qin et al., 2025, arXiv 2503.12491: the entropy of the window's
  attention rows times the variance of each position's attention across the window) plus TAPPA's 1 - q_l,
  as TAPPA's KV code combines them; each term is divided by its mean over the layers, so both weigh the same.
- a JSON file: fixed budgets per layer, as `prunetool heads --kv-budget` writes them (kv_budget.json) or
  a plain list.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from prunetool.errors import OptionError

KINDS = ("uniform", "pyramid", "tappa", "tappa-floor", "tappa-cake")
PYRAMID_BETA = 20  # PyramidKV's default
RECENT_QUERIES = 32  # TAPPA scores the last 32 prompt tokens' queries


@dataclass(frozen=True)
class Schedule:
    text: str  # as the user wrote it: the column header
    kind: str  # one of KINDS, or "file"
    budget: float  # average tokens per layer
    fixed: tuple[int, ...] | None = None  # a file's budgets


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


def parse_schedule(text: str, *, num_layers: int, max_context: int) -> Schedule:
    """`uniform:128`, `pyramid:128`, `tappa:128`, `tappa-floor:128` or a JSON file; one-line errors otherwise."""
    kind, colon, value = text.partition(":")
    if colon and kind in KINDS:
        try:
            budget = int(value)
        except ValueError:
            raise OptionError(f"--kv-budget {text!r}: the budget after ':' must be a whole number of tokens") from None
        check_average(budget, max_context, text)
        return Schedule(text, kind, float(budget))
    path = Path(text)
    if not path.is_file():
        raise OptionError(f"--kv-budget {text!r} is neither {', '.join(k + ':B' for k in KINDS)} nor a JSON file")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise OptionError(f"--kv-budget {text}: not a readable JSON file ({error})") from None
    budgets = data.get("budgets") if isinstance(data, dict) else data
    if not (isinstance(budgets, list) and budgets and all(isinstance(b, int) and not isinstance(b, bool)
                                                          for b in budgets)):
        raise OptionError(f"--kv-budget {text}: expected a list of whole-token budgets per layer, or an object with "
                          "one under \"budgets\" (as `prunetool heads --kv-budget` writes)")
    if len(budgets) != num_layers:
        raise OptionError(f"--kv-budget {text} has budgets for {len(budgets)} layers; this model has {num_layers}")
    for budget in budgets:
        check_average(budget, max_context, text)
    return Schedule(text, "file", sum(budgets) / len(budgets), tuple(budgets))


def check_average(budget: int, limit: int, text: str, limit_name: str = "the model's context") -> None:
    """Refuse a per-layer budget no layer could use (eval's schedules and heads' --kv-budget alike)."""
    if budget < 1:
        raise OptionError(f"--kv-budget {text}: a layer must keep at least 1 token, got {budget}")
    if budget > limit:
        raise OptionError(f"--kv-budget {text}: {budget} tokens is more than {limit_name} ({limit})")


def pyramid_weights(num_layers: int, beta: float = PYRAMID_BETA) -> list[float]:
    """PyramidKV's straight line: 2 - 1/beta at the first layer down to 1/beta at the last (mean 1)."""
    top, bottom = 1.0 / beta, 2.0 - 1.0 / beta
    if num_layers == 1:
        return [1.0]
    return [bottom - index * (bottom - top) / (num_layers - 1) for index in range(num_layers)]


def _unit_mean(values: list[float]) -> list[float]:
    """Values divided by their mean (all equal when the mean is not positive)."""
    mean = sum(values) / len(values)
    return [value / mean for value in values] if mean > 0 else [1.0] * len(values)


def layer_budgets(schedule: Schedule, caps: list[int], *, q_similarity: list[float] | None = None,
                  preference: list[float] | None = None, full_attention: list[bool] | None = None) -> list[int]:
    """Whole-token budgets per layer for one prompt; sum = budget x layers unless the caps hold less.

    `caps`: what each layer can hold for this prompt (its length, or the sliding window). `q_similarity`:
    the prompt's recent post-RoPE query self-similarity per layer (tappa schedules); `preference`: CAKE's
    per-layer preference (tappa-cake); `full_attention`: which layers see the whole prompt (tappa-floor).
    """
    if schedule.kind == "file":
        return [min(budget, cap) for budget, cap in zip(schedule.fixed, caps)]
    shares = layer_shares(schedule, caps, q_similarity=q_similarity, preference=preference,
                          full_attention=full_attention)
    return whole_tokens(shares, caps)


def layer_shares(schedule: Schedule, caps: list[int], *, q_similarity: list[float] | None = None,
                 preference: list[float] | None = None, full_attention: list[bool] | None = None) -> list[float]:
    """The exact (fractional) shares behind `layer_budgets`: what `prunetool heads` records beside the budgets."""
    layers = len(caps)
    total = schedule.budget * layers
    if total >= sum(caps):
        return [float(cap) for cap in caps]
    floors = [0.0] * layers
    if schedule.kind == "uniform":
        weights = [1.0] * layers
    elif schedule.kind == "pyramid":
        weights = pyramid_weights(layers)
    else:
        if q_similarity is None or len(q_similarity) != layers:
            raise ValueError("tappa schedules need the prompt's query self-similarity for every layer")
        weights = [1.0 - value for value in q_similarity]
        if schedule.kind == "tappa-cake":
            if preference is None or len(preference) != layers:
                raise ValueError("tappa-cake needs CAKE's preference for every layer")
            weights = [a + b for a, b in zip(_unit_mean(preference), _unit_mean(weights))]
        if schedule.kind == "tappa-floor" and full_attention is not None and not all(full_attention):
            floors = [min(schedule.budget, cap) if full else 0.0 for full, cap in zip(full_attention, caps)]
    rest = water_fill(weights, total - sum(floors), [cap - floor for cap, floor in zip(caps, floors)])
    return [floor + share for floor, share in zip(floors, rest)]
