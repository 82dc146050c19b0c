"""`prunetool prune --target …`: a budget instead of a count -> the least-damage mixed cut -> checkpoint -> checks.

The story: check the targets and options before anything loads; load the model and the calibration windows;
measure what the search needs (single-removal damage through the cut engine, per-sublayer timings for speed
targets); search (select.budget_search); then, unless --dry-run, measure held-out perplexity, write the cut
(blocks only: the source's format; otherwise nemotron-nas) and verify it before it is published, as prune does.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from prunetool.checkpoint.surgery import write_cut_checkpoint
from prunetool.checkpoint.surgery.output import check_output
from prunetool.checkpoint.verify import verify_checkpoint
from prunetool.checkpoint_io import text_num_layers
from prunetool.commands.prune import (PruneRequest, default_output, load_for_prune, measure_perplexity, side_files,
                                      starting_point)
from prunetool.cut import Cut
from prunetool.errors import OptionError, UnsupportedModelError
from prunetool.memory import peak_rss_bytes
from prunetool.output.runs import record_current_run
from prunetool.progress import window_progress
from prunetool.select.budget import Candidates, Meter, Target, parse_targets, solve
from prunetool.select.budget_search import unreachable
from prunetool.select.costs import checkpoint_costs
from prunetool.select.plan import PrunePlan
from prunetool.sources import model_key, resolve_model

UNITS = ("block", "attention", "mlp")


def check_target_options(request: PruneRequest, source, num_layers: int, console: Console) -> tuple[list[Target],
                                                                                                    Candidates]:
    """Every refusal that needs no model: the targets, the options --target replaces or cannot take yet, and
    which variants each layer may take."""
    from prunetool.checkpoint.nemotron_nas.convert import check_expressible

    if request.drop is not None or request.layers is not None:
        raise OptionError("--target chooses how much to remove; give it instead of --drop or --remove-layers")
    if request.patch:
        raise OptionError("--target does not patch yet; prune with --target, then `prunetool heal` the folder")
    if request.low_memory:
        raise OptionError("--target needs the model loaded (it measures every candidate removal); drop --low-memory")
    if request.unit is not None and request.unit not in UNITS:
        raise OptionError(f"--unit must be one of {', '.join(UNITS)}, got {request.unit!r}")
    targets = parse_targets(request.target)
    units = (request.unit,) if request.unit else UNITS
    if any(unit != "block" for unit in units):
        try:
            check_expressible(source.config)
        except UnsupportedModelError as error:
            if request.unit is not None:
                raise
            units = ("block",)
            console.print(f"whole blocks only: {error}".split(";")[0], highlight=False, soft_wrap=True)
    for flag, value in (("--protect-first", request.protect_first), ("--protect-last", request.protect_last)):
        if value < 0:
            raise OptionError(f"{flag} must be 0 or more, got {value}")
    return targets, Candidates.build(num_layers, units, request.protect_first, request.protect_last)


def speed_meter(model, targets: list[Target], source, console: Console):
    """Per-sublayer timings for the speed targets (cached), and a function that times a cut whole against the base."""
    from prunetool.model.runner import as_runner
    from prunetool.paths import cache_dir
    from prunetool.select.speed import DEFAULT_CONTEXT, Workload, cached_timing, cut_seconds

    device = as_runner(model).device
    workloads = {t.name: Workload(t.name, t.context or DEFAULT_CONTEXT[t.name], t.batch or 1)
                 for t in targets if t.is_speed}
    timings = {}
    for name, workload in workloads.items():
        console.print(f"timing every sublayer: {name}, {workload.describe()}", highlight=False)
        timings[name] = cached_timing(model, workload, device, cache_dir() / "timings.json", model_key(source))

    def measure(cut: Cut) -> dict[str, float]:
        found = {}
        for name, workload in workloads.items():
            base, mine = cut_seconds(model, [None, cut], workload, device)
            found[name] = base["median"] / mine["median"]
        return found

    return timings, measure, {name: w.describe() for name, w in workloads.items()}


def write_frontier(pareto: dict, request: PruneRequest, console: Console) -> None:
    """--pareto FILE.json and --plot FILE.png: the frontier the search's measurements give."""
    from prunetool.checkpoint_io import write_json_atomic

    if request.pareto is not None:
        write_json_atomic(Path(request.pareto), pareto)
        console.print(f"frontier written to {request.pareto}", highlight=False)
    if request.plot is not None:
        from prunetool.output.plots import plot_pareto

        plot_pareto(pareto, request.plot)
        console.print(f"plot written to {request.plot}", highlight=False)


def run_budget(request: PruneRequest, console: Console) -> dict:
    """Check, load, measure, search, then write and verify as prune does; returns what the CLI prints."""
    from prunetool.select.budget_search import search_budget
    from prunetool.select.cut_engine import CutEngine

    clock = time.perf_counter()
    start = starting_point(request)
    source = resolve_model(start.spec, trust_remote_code=request.trust_remote_code)
    spec = start.spec or source.spec
    num_layers = text_num_layers(source.config)
    targets, candidates = check_target_options(request, source, num_layers, console)
    if request.output is not None and not request.dry_run:
        check_output(source.path, Path(request.output), request.force)
    contexts = [t.context for t in targets if t.name in ("kv", "memory") and t.context]
    meter = Meter(checkpoint_costs(source.path, context=max(contexts) if contexts else None))
    sizes = [t for t in targets if not t.is_speed]  # exact costs: a size no cut reaches is refused before loading
    if sizes and solve(meter, sizes, lambda layer, state: 1.0, candidates) is None:
        raise OptionError(unreachable(meter, sizes, candidates, {}))
    model, calibration, setting = load_for_prune(request, start, source, False, True, console)
    verifying = request.verify and not request.dry_run
    timings, measure, workloads = speed_meter(model, targets, source, console)
    meter.timings.update(timings)
    selection = calibration.first(min(start.calibration["samples"], calibration.windows))
    measured = selection.first(min(request.refine_windows, selection.windows))  # what every removal is judged on
    engine = CutEngine(model, measured.input_ids, batch_size=request.batch_size)
    with window_progress(console) as progress:
        task = progress.add_task("measuring every removal", total=None)
        result = search_budget(engine, meter, targets, candidates, measure_speed=measure,
                               on_step=lambda done, total: progress.update(task, completed=done, total=total))
    pareto = None
    if request.pareto is not None or request.plot is not None:
        from prunetool.select.budget_search import frontier

        first = targets[0]
        points = frontier(engine, result, meter, first, candidates)
        report = meter.report(first, result.cut)
        pareto = {"model": spec, "target": first.to_json(), "points": points,
                  "chosen": {"x": report.get("ratio", report.get("speedup")), "perplexity": result.perplexity,
                             "describe": result.cut.describe()},
                  "quality": "calibration perplexity on the selection windows"}
    del engine
    budget = {"targets": result.reports, "workloads": workloads, "resolves": result.resolves,
              "local_search_evaluations": result.evaluations,
              "calibration_perplexity": {"base": result.base_perplexity, "solved": result.solved_perplexity,
                                         "cut": result.perplexity},
              "solved_cut": result.solved.to_json(), "units": sorted({u for a in candidates.allowed for u in a}),
              "seconds": {key: round(value, 2) for key, value in result.seconds.items()}
              | {"total": round(time.perf_counter() - clock, 2)}}
    plan = PrunePlan(spec, num_layers, (), "budget", {"protect_first": request.protect_first,
                                                      "protect_last": request.protect_last},
                     calibration=selection.describe(), search_calibration=measured.describe(), cut=result.cut,
                     targets=budget)
    answer = {"plan": plan.to_json(), "dry_run": request.dry_run, "budget": budget, "scores": None}
    if pareto is not None:
        write_frontier(pareto, request, console)
    if request.dry_run:
        return answer | {"peak_rss_bytes": peak_rss_bytes()}
    perplexity_info = measure_perplexity(model, calibration, plan) if verifying else None
    output, verification = Path(request.output or default_output(spec, plan)), {}

    def check(folder: Path) -> None:
        verification.update(verify_checkpoint(folder, expected_layers=len(plan.kept), held_out=calibration.held_out,
                                              expected_perplexity=perplexity_info["after"], setting=setting,
                                              shipped_code=not plan.cut.blocks_only))

    command = f"prunetool prune {plan.base_model} --target {request.target}" + (
        f" --unit {request.unit}" if request.unit else "")
    with window_progress(console) as progress:
        task = progress.add_task("writing shards", total=None)
        write_cut_checkpoint(source.path, plan.cut, output, force=request.force,
                             extra_files=side_files(plan, source, perplexity_info, setting, command=command),
                             on_shard=lambda name: progress.advance(task),
                             before_publish=check if verifying else None)
    pruned = {"path": str(output.resolve()), "removed": list(plan.removed), "criterion": plan.criterion,
              "cut": plan.cut.to_json(), "held_out": perplexity_info["held_out"] if perplexity_info else None}
    record_current_run(spec, source.path, None, start.calibration, pruned)
    return answer | {"output": str(output), "perplexity": perplexity_info, "verification": verification or None,
                     "patch": None, "low_memory": False, "peak_rss_bytes": peak_rss_bytes()}
