"""The cut with the least calibration damage that meets every target: measure, solve exactly, refine, re-measure.

1. Damage of every single removal the candidates allow (each layer's attention, MLP and whole block), measured
   as the rise in calibration log-perplexity through the cut engine.
2. The exact solve over per-layer variants (budget.solve) with those damages and the exact or timed costs.
3. A measured (1+lambda) local search on the whole cut (EvoPress's scheme on the per-layer mask), because
   damage does not add up: each offspring moves one removal elsewhere or swaps a variant, must still meet
   every target, and replaces the parent only when its measured perplexity is lower.
4. Speed targets are judged on the final cut timed whole against the base. A miss tightens that target by
   the ratio it missed by, and steps 2-4 run again (at most MAX_RESOLVES times); how often is reported.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prunetool.cut import KEPT, Cut
from prunetool.errors import OptionError
from prunetool.select.budget import Candidates, Meter, Target, solve

OFFSPRING = 8  # lambda of the (1 + lambda) search
GENERATIONS = 12
MAX_RESOLVES = 3


@dataclass
class BudgetResult:
    cut: Cut
    perplexity: float  # calibration perplexity of the cut
    base_perplexity: float
    solved: Cut  # the exact solve's cut before the local search
    solved_perplexity: float
    reports: list[dict]  # per target: base, cut, limit, met (speed: measured whole)
    resolves: int  # how often a measured miss tightened a target and the search ran again
    evaluations: int  # whole cuts measured by the local search
    seconds: dict = field(default_factory=dict)  # per stage
    damage: dict = field(default_factory=dict)  # (layer, state) -> measured single-removal damage


def damage_table(engine, base_log: float, candidates: Candidates,
                 on_step: Callable[[int, int], None] | None = None) -> dict[tuple[int, str], float]:
    """(layer, state) -> log-perplexity rise when only that is removed, for every allowed removal."""
    n = len(candidates.allowed)
    jobs = [(layer, state) for layer in range(n) for state in candidates.allowed[layer] if state != KEPT]
    table = {}
    for done, (layer, state) in enumerate(jobs, 1):
        cut = Cut.from_states([state if i == layer else KEPT for i in range(n)])
        table[layer, state] = math.log(engine.perplexity_of(cut)) - base_log
        if on_step:
            on_step(done, len(jobs))
    return table


def feasible(cut: Cut, meter: Meter, targets: list[Target], candidates: Candidates,
             tighten: dict[str, float]) -> bool:
    if any(state not in candidates.allowed[i] for i, state in enumerate(cut.states)):
        return False
    try:
        cut.check_engines()
    except OptionError:
        return False
    return all(meter.value(t, cut) <= t.limit(meter.base(t)) * tighten.get(t.name, 1.0) * (1 + 1e-12)
               for t in targets)


def mutate(cut: Cut, candidates: Candidates, rng: random.Random) -> Cut | None:
    """Move one removal to a kept layer, or give one layer another allowed variant."""
    states = list(cut.states)
    removed = [i for i, s in enumerate(states) if s != KEPT]
    kept = [i for i, s in enumerate(states) if s == KEPT and len(candidates.allowed[i]) > 1]
    if removed and kept and rng.random() < 0.5:
        source, target = rng.choice(removed), rng.choice(kept)
        if states[source] not in candidates.allowed[target]:
            return None
        states[source], states[target] = KEPT, states[source]
    else:
        layer = rng.randrange(len(states))
        others = [s for s in candidates.allowed[layer] if s != states[layer]]
        if not others:
            return None
        states[layer] = rng.choice(others)
    try:
        return Cut.from_states(states)
    except OptionError:
        return None


def local_search(engine, start: Cut, start_ppl: float, meter: Meter, targets: list[Target],
                 candidates: Candidates, tighten: dict[str, float], seed: int = 0,
                 generations: int = GENERATIONS) -> tuple[Cut, float, int]:
    """(1 + OFFSPRING) search from the solve's cut; returns the best cut, its perplexity, evaluations made."""
    rng = random.Random(seed)
    best, best_ppl, evaluations, seen = start, start_ppl, 0, {tuple(start.states)}
    for _ in range(generations):
        children = []
        for _ in range(OFFSPRING * 4):  # tries, for up to OFFSPRING new feasible offspring
            child = mutate(best, candidates, rng)
            if child is None or tuple(child.states) in seen:
                continue
            seen.add(tuple(child.states))
            if feasible(child, meter, targets, candidates, tighten):
                children.append(child)
            if len(children) == OFFSPRING:
                break
        winner, winner_ppl = None, best_ppl
        for child in children:  # a child that cannot beat the best so far stops measuring early
            evaluations += 1
            value = engine.perplexity_of(child, give_up_above=winner_ppl)
            if value < winner_ppl:
                winner, winner_ppl = child, value
        if winner is not None:
            best, best_ppl = winner, winner_ppl
    return best, best_ppl, evaluations


def search_budget(engine, meter: Meter, targets: list[Target], candidates: Candidates, *,
                  measure_speed: Callable[[Cut], dict[str, float]] | None = None,
                  on_step: Callable[[int, int], None] | None = None, seed: int = 0) -> BudgetResult:
    """The full search; `measure_speed(cut)` -> {"decode": speed-up, ...} times the cut whole against the base."""
    clock, seconds = time.perf_counter(), {}
    n = len(candidates.allowed)
    base_ppl = engine.perplexity_of(Cut(n))
    table = damage_table(engine, math.log(base_ppl), candidates, on_step)
    seconds["damage"] = time.perf_counter() - clock
    tighten: dict[str, float] = {}
    resolves, evaluations = 0, 0
    while True:
        clock = time.perf_counter()
        solved = solve(meter, targets, lambda layer, state: table[layer, state], candidates, tighten)
        if solved is None:
            raise OptionError(unreachable(meter, targets, candidates, tighten))
        seconds["solve"] = seconds.get("solve", 0.0) + time.perf_counter() - clock
        clock = time.perf_counter()
        engine.set_cut(Cut(n))
        solved_ppl = engine.perplexity_of(solved)
        cut, ppl, made = local_search(engine, solved, solved_ppl, meter, targets, candidates, tighten, seed + resolves)
        evaluations += made
        seconds["local_search"] = seconds.get("local_search", 0.0) + time.perf_counter() - clock
        speed_targets = [t for t in targets if t.is_speed]
        measured = {}
        if speed_targets and measure_speed is not None:
            clock = time.perf_counter()
            measured = measure_speed(cut)
            seconds["speed"] = seconds.get("speed", 0.0) + time.perf_counter() - clock
        missed = [t for t in speed_targets if t.name in measured and measured[t.name] < t.value]
        if not missed or resolves >= MAX_RESOLVES:
            break
        resolves += 1
        for target in missed:
            tighten[target.name] = tighten.get(target.name, 1.0) * measured[target.name] / target.value
    reports = []
    for target in targets:
        report = meter.report(target, cut)
        if target.is_speed:
            report["predicted_speedup"] = report.pop("speedup")
            if target.name in measured:
                report["speedup"] = measured[target.name]
                report["met"] = measured[target.name] >= target.value
        reports.append(report)
    return BudgetResult(cut, ppl, base_ppl, solved, solved_ppl, reports, resolves, evaluations, seconds, table)


def best_reachable(meter: Meter, target: Target, candidates: Candidates) -> Cut | None:
    """The cut the candidates allow that goes furthest for `target` alone (its exact additive optimum)."""
    from prunetool.select.budget import saving

    return solve(meter, [], lambda layer, state: -saving(meter, target, layer, state), candidates)


def unreachable(meter: Meter, targets: list[Target], candidates: Candidates, tighten: dict[str, float]) -> str:
    """One line: which target no allowed cut reaches, and the best value the candidates can reach for it."""
    for target in targets:
        if solve(meter, [target], lambda layer, state: 1.0, candidates, tighten) is None:
            best = best_reachable(meter, target, candidates)
            if best is None:
                reach = "nothing can be removed"
            else:
                report = meter.report(target, best)
                reach = (f"the best reachable is {target.name}={report['ratio']:.3f} ({report['cut']:,.0f})"
                         if "ratio" in report else f"the best reachable is {target.name}={report['speedup']:.2f}x "
                         "(predicted)")
            return (f"no cut the candidates allow meets --target {target.text}: {reach}; allow more (drop --unit, "
                    "lower --protect-first/--protect-last) or ask for less")
    return ("no single cut meets every --target together (each is reachable alone); ask for less of one of "
            + ", ".join(t.text for t in targets))


FRONTIER_POINTS = 8
FRONTIER_KINDS = {"mixed": ("block", "attention", "mlp"), "block-only": ("block",), "attention-only": ("attention",)}


def sweep_values(target: Target) -> list[float]:
    """FRONTIER_POINTS relative limits around the asked one: from a quarter of its saving to twice it."""
    saving = (1 - 1 / target.value) if target.is_speed else None
    if target.is_speed:
        return [1 / (1 - saving * f) for f in _fractions()]
    if not target.relative:
        raise OptionError(f"--pareto sweeps a relative target; give --target {target.name} as a fraction such as 0.85")
    return [max(0.0, 1 - (1 - target.value) * f) for f in _fractions()]


def _fractions() -> list[float]:
    return [0.25 + 1.75 * i / (FRONTIER_POINTS - 1) for i in range(FRONTIER_POINTS)]


def frontier(engine, result: BudgetResult, meter: Meter, target: Target, allowed: Candidates) -> list[dict]:
    """Calibration perplexity against the first target's value, for the mixed, block-only and attention-only
    solves at FRONTIER_POINTS limits (exact solves from the measured damage; each point's cut measured whole)."""
    n = len(allowed.allowed)
    points = []
    for kind, units in FRONTIER_KINDS.items():
        states = tuple(tuple(s for s in layer if s == KEPT or s in units) for layer in allowed.allowed)
        candidates = Candidates(states)
        if not any(len(layer) > 1 for layer in states):
            continue
        for value in sweep_values(target):
            swept = Target(target.name, value, True, f"{target.name}={value:.4g}", target.context, target.batch)
            cut = solve(meter, [swept], lambda layer, state: result.damage.get((layer, state), math.inf), candidates)
            if cut is None:
                continue
            engine.set_cut(Cut(n))
            report = meter.report(swept, cut)
            points.append({"kind": kind, "limit": value, "cut": cut.to_json(), "perplexity": engine.perplexity_of(cut),
                           "value": report["cut"], "ratio": report.get("ratio"),
                           "speedup": report.get("speedup")})
    return points
