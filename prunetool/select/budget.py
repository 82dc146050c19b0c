"""Budgets instead of counts: `--target params=0.85,kv=0.75,decode=1.2x` and the cut that meets them.

Targets are parsed here, checked against a cut's exact costs (costs.py) and measured speed, and solved for
exactly: each layer takes one of four variants (kept, attention removed, MLP removed, whole block removed),
costs and the measured damage of each variant add up over layers, and the least total damage that meets
every target is an integer program of 4 x layers binaries. scipy's `milp` (HiGHS) solves it exactly in
milliseconds at these sizes, and scipy is already installed with torch's stack, so nothing new is needed.
Damage does not add up (EvoPress; the searches in search.py measure whole cuts), so the solution is a
starting point that a measured local search refines.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from prunetool.errors import OptionError
from prunetool.select.costs import LayerCosts
from prunetool.cut import ATTENTION, BLOCK, KEPT, MLP, STATES, Cut

TARGETS = ("params", "kv", "memory", "decode", "prefill")
WORKLOAD_KEYS = ("ctx", "batch")
COUNT_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
BYTE_SUFFIX = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30,
               "tib": 2 ** 40}
HELP = ("params=0.85 or params=110M, kv=0.75 or kv=16KiB (per token), memory=2GiB@ctx=4096,batch=8 (weights plus "
        "KV), decode=1.2x, prefill=1.3x")


@dataclass(frozen=True)
class Target:
    """One thing the user asked for. Sizes are upper bounds (relative to the base, or absolute); speeds are
    lower bounds on the speed-up over the base."""

    name: str
    value: float
    relative: bool
    text: str
    context: int | None = None
    batch: int | None = None

    @property
    def is_speed(self) -> bool:
        return self.name in ("decode", "prefill")

    def limit(self, base: float) -> float:
        """The most the pruned model may have (sizes), or the most time it may take (speeds)."""
        if self.is_speed:
            return base / self.value
        return base * self.value if self.relative else self.value

    def met(self, base: float, value: float) -> bool:
        return value <= self.limit(base) * (1 + 1e-12)

    def to_json(self) -> dict:
        return {"target": self.text, "name": self.name, "value": self.value, "relative": self.relative,
                "context": self.context, "batch": self.batch}


def _number(text: str, suffixes: dict[str, float], target: str) -> tuple[float, bool]:
    """(value, relative) of '0.85', '85%', '110M' or '16KiB'."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(%|[a-z]*)\s*", text.lower())
    if not match:
        raise OptionError(f"--target {target}={text}: not a number; {HELP}")
    value, unit = float(match[1]), match[2]
    if unit == "%":
        return value / 100, True
    if unit == "" and value <= 1:
        return value, True
    if unit not in suffixes:
        raise OptionError(f"--target {target}={text}: unknown unit {unit!r}; use one of "
                          f"{', '.join(u for u in suffixes if u) or 'none'}")
    return value * suffixes[unit], False


def parse_targets(text: str) -> list[Target]:
    """'params=0.9,kv=0.8' -> Targets. A workload (`@ctx=4096,batch=8`) belongs to the target before it."""
    if not text or not text.strip():
        raise OptionError(f"--target is empty; give one or more of {HELP}")
    targets: list[dict] = []
    for item in text.split(","):
        key, equals, value = item.strip().partition("=")
        key = key.strip().lower()
        if not equals:
            raise OptionError(f"--target {item.strip()!r} has no '='; give one or more of {HELP}")
        if key in WORKLOAD_KEYS:
            if not targets or "workload" not in targets[-1]:
                raise OptionError(f"--target {item.strip()!r}: a workload follows a target's '@', as in "
                                  "memory=2GiB@ctx=4096,batch=8")
            targets[-1]["workload"][key] = value.strip()
            continue
        if key not in TARGETS:
            raise OptionError(f"--target: unknown target {key!r}; targets are {', '.join(TARGETS)} ({HELP})")
        if any(t["name"] == key for t in targets):
            raise OptionError(f"--target names {key} twice")
        amount, at, workload = value.partition("@")
        entry = {"name": key, "amount": amount.strip(), "text": item.strip()}
        if at:
            first_key, first_eq, first_value = workload.partition("=")
            if first_key.strip().lower() not in WORKLOAD_KEYS or not first_eq:
                raise OptionError(f"--target {item.strip()!r}: after '@' give ctx=N and/or batch=N")
            entry["workload"] = {first_key.strip().lower(): first_value.strip()}
        targets.append(entry)
    return [_target(entry) for entry in targets]


def _target(entry: dict) -> Target:
    name, amount = entry["name"], entry["amount"]
    workload = {}
    for key, value in entry.get("workload", {}).items():
        if not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
            raise OptionError(f"--target {name}: {key}={value} must be a whole number >= 1")
        workload[key] = int(value)
    text = entry["text"] + "".join(f",{k}={v}" for k, v in entry.get("workload", {}).items()
                                   if f"{k}=" not in entry["text"])
    if name in ("decode", "prefill"):
        match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*x?", amount.lower())
        if not match or float(match[1]) < 1:
            raise OptionError(f"--target {name}={amount}: give a speed-up of at least 1, such as {name}=1.2x")
        return Target(name, float(match[1]), True, text, workload.get("ctx"), workload.get("batch"))
    if name == "memory" and "ctx" not in workload:
        raise OptionError(f"--target memory={amount}: memory counts the KV cache at a workload; add @ctx=N "
                          "(and ,batch=N), as in memory=2GiB@ctx=4096,batch=8")
    value, relative = _number(amount, COUNT_SUFFIX if name == "params" else BYTE_SUFFIX, name)
    if value <= 0:
        raise OptionError(f"--target {name}={amount} must be above 0")
    if relative and value >= 1:
        raise OptionError(f"--target {name}={amount} asks for no saving; give a fraction below 1 such as 0.85")
    if not relative and value != int(value):
        raise OptionError(f"--target {name}={amount}: a count of parameters or bytes is a whole number (a fraction of "
                          "the base is written 0.85 or 85%)")
    return Target(name, value, relative, text, workload.get("ctx"), workload.get("batch"))


# ------------------------------------------------------------------ costs of a cut against the targets


@dataclass(frozen=True)
class Timing:
    """Seconds per forward of each variant's removable part, per layer, measured once per model, device and
    dtype (speed.py); `rest` is what no cut removes (embedding, head, norms, scheduling)."""

    attention: tuple[float, ...]
    mlp: tuple[float, ...]
    rest: float

    def seconds(self, cut: Cut) -> float:
        return (self.rest + sum(t for i, t in enumerate(self.attention) if i not in cut.attention)
                + sum(t for i, t in enumerate(self.mlp) if i not in cut.mlp))


@dataclass
class Meter:
    """What a cut costs under each target: exact sizes from LayerCosts, predicted speed from Timings."""

    costs: LayerCosts
    timings: dict[str, Timing] = field(default_factory=dict)  # "decode"/"prefill" -> Timing

    def value(self, target: Target, cut: Cut) -> float:
        if target.name == "params":
            return float(self.costs.params(cut))
        if target.name == "kv":
            return self.costs.kv(cut)
        if target.name == "memory":
            return self.costs.memory(cut, target.context, target.batch or 1)
        return self.timings[target.name].seconds(cut)

    def base(self, target: Target) -> float:
        return self.value(target, Cut(self.costs.num_layers))

    def report(self, target: Target, cut: Cut) -> dict:
        """The target, the base's value, the cut's (as a ratio too, or a speed-up), and whether it is met."""
        base, value = self.base(target), self.value(target, cut)
        record = {"target": target.text, "base": base, "cut": value, "limit": target.limit(base),
                  "met": target.met(base, value)}
        if target.is_speed:
            record["speedup"] = base / value if value else math.inf
        else:
            record["ratio"] = value / base if base else math.nan
        return record


# ------------------------------------------------------------------ the exact solve


@dataclass(frozen=True)
class Candidates:
    """Which variants each layer may take (--unit restricts them; protected layers stay whole; a family the
    nemotron-nas format cannot hold takes whole blocks only)."""

    allowed: tuple[tuple[str, ...], ...]  # per layer, a subset of STATES that includes KEPT

    @classmethod
    def build(cls, num_layers: int, units: Sequence[str] = ("block", "attention", "mlp"), protect_first: int = 0,
              protect_last: int = 0) -> Candidates:
        free = set(range(protect_first, num_layers - protect_last))
        return cls(tuple((KEPT, *[u for u in (ATTENTION, MLP, BLOCK) if u in units]) if index in free else (KEPT,)
                         for index in range(num_layers)))

    @property
    def sublayers(self) -> bool:
        return any(state in (ATTENTION, MLP) for states in self.allowed for state in states)


def saving(meter: Meter, target: Target, layer: int, state: str) -> float:
    """How much removing `state` at `layer` alone lowers the target's measure (additive by construction)."""
    n = meter.costs.num_layers
    return meter.value(target, Cut(n)) - meter.value(target, Cut.from_states(
        [state if i == layer else KEPT for i in range(n)]))


def solve(meter: Meter, targets: Sequence[Target], damage: Callable[[int, str], float], candidates: Candidates,
          tighten: dict[str, float] | None = None) -> Cut | None:
    """The cut with the least summed damage whose additive costs meet every target, or None when none can.

    `damage(layer, state)` is the measured harm of that single removal (kept: 0). `tighten[name]` scales a
    target's limit down (the re-solve after a measured miss). The engine rule of checkpoint.nemotron_nas
    (no MLP before the first attention among the layers that stay) and "one attention stays" are constraints.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    n = meter.costs.num_layers
    index = {(layer, state): position for position, (layer, state) in
             enumerate((layer, state) for layer in range(n) for state in STATES)}
    size = len(index)
    cost = np.zeros(size)
    upper = np.zeros(size)
    for (layer, state), position in index.items():
        if state in candidates.allowed[layer]:
            upper[position] = 1
            cost[position] = 0.0 if state == KEPT else float(damage(layer, state))
    rows, lower_bounds, upper_bounds = [], [], []

    def add(row: np.ndarray, low: float, high: float) -> None:
        rows.append(row)
        lower_bounds.append(low)
        upper_bounds.append(high)

    for layer in range(n):  # exactly one variant per layer
        row = np.zeros(size)
        for state in STATES:
            row[index[layer, state]] = 1
        add(row, 1, 1)
    row = np.zeros(size)  # at least one attention stays
    for layer in range(n):
        row[index[layer, KEPT]] = row[index[layer, MLP]] = 1
    add(row, 1, np.inf)
    if candidates.sublayers:  # an attention-only removal needs an attention kept in an earlier layer
        for layer in range(n):
            row = np.zeros(size)
            row[index[layer, ATTENTION]] = 1
            for earlier in range(layer):
                row[index[earlier, KEPT]] = row[index[earlier, MLP]] = -1
            add(row, -np.inf, 0)
    for target in targets:
        base = meter.base(target)
        limit = target.limit(base) * (tighten or {}).get(target.name, 1.0)
        row = np.zeros(size)
        for (layer, state), position in index.items():
            if state != KEPT:
                row[position] = saving(meter, target, layer, state)
        add(row, base - limit, np.inf)
    result = milp(cost, constraints=LinearConstraint(np.array(rows), lower_bounds, upper_bounds),
                  integrality=np.ones(size), bounds=Bounds(0, upper))
    if result.status != 0 or result.x is None:
        return None
    chosen = [next(state for state in STATES if result.x[index[layer, state]] > 0.5) for layer in range(n)]
    return Cut.from_states(chosen)
