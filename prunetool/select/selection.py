"""Scores and measurements -> the removal plan: one registry of criteria, option checks, the plan.

The criteria themselves live in ranking.py (pure functions of recorded scores: qsim, tappa, bi,
angular, last) and search.py (guided, the default, and ppl, which measure calibration perplexity on
the windows they are given). Adding a criterion is one function and one line in CRITERIA.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from prunetool.errors import OptionError
from prunetool.select.plan import PrunePlan
from prunetool.select.ranking import (GUIDED_BETA, GUIDED_BLOCKS, GUIDED_SHORTLIST, GUIDED_WINDOWS, HALVING_SCREEN_TOKENS,
                               SCREEN_DTYPES, TAPPA_BETA, Selection, SelectionRequest, select_angular, select_bi,
                               select_last, select_qsim, select_tappa)
from prunetool.select.search import select_guided, select_halving, select_ppl

if TYPE_CHECKING:
    from prunetool.select.calibration import CalibrationSet
    from prunetool.select.scoring import Scores


@dataclass(frozen=True)
class Criterion:
    select: Callable[[SelectionRequest], Selection]
    needs: str  # "scores", "model" (the model and calibration windows), "both" or "nothing"
    summary: str  # one line for --help and reports
    parameters: tuple[str, ...] = ()  # SelectionRequest fields recorded in the plan besides protection
    contiguous: tuple[str, ...] = ()  # the units at which it removes one run that must keep the final layer
    units: tuple[str, ...] = ("block",)  # what it can remove: whole layers and/or attention or MLP sublayers


SUBLAYER_UNITS = ("block", "attention", "mlp")


CRITERIA: dict[str, Criterion] = {
    "guided": Criterion(select_guided, "both", "q-similarity/BI rank proposes layer sets, calibration perplexity picks",
                        ("beta", "shortlist", "refine_windows", "blocks", "batch_size"), units=("block", "attention")),
    "qsim": Criterion(select_qsim, "scores", "highest query self-similarity (most predictable queries) first",
                      units=("block", "attention")),
    "tappa": Criterion(select_tappa, "scores", "TAPPA: lowest minmax(BI) + beta*(1 - minmax(qsim)) first", ("beta",),
                       units=("block", "attention")),
    "bi": Criterion(select_bi, "scores", "ShortGPT: lowest block influence (1 - cos across the layer or sublayer) first",
                    units=SUBLAYER_UNITS),
    "angular": Criterion(select_angular, "scores", "Gromov et al.: contiguous block with the smallest angular distance "
                         "(sublayers: the N smallest across themselves)", contiguous=("block",), units=SUBLAYER_UNITS),
    "last": Criterion(select_last, "nothing", "the N layers just before the final one", contiguous=SUBLAYER_UNITS,
                      units=SUBLAYER_UNITS),
    "ppl": Criterion(select_ppl, "model", "SLEB-style greedy: remove the layer that hurts calibration perplexity least, N times",
                     ("batch_size",), units=SUBLAYER_UNITS),
    "halving": Criterion(select_halving, "model", "SLEB's greedy with successive halving (screen on few windows, confirm "
                         "the best on all), contiguous blocks and neighbour swaps; with --patch, judged after the patch (default)",
                         ("shortlist", "refine_windows", "screen_tokens", "screen_dtype", "blocks", "batch_size",
                          "patch_objective"), units=SUBLAYER_UNITS),
}


def default_beta(criterion: str) -> float:
    """guided's own default (GUIDED_BETA) or TAPPA's published 0.3; equal today, kept apart on purpose."""
    return GUIDED_BETA if criterion == "guided" else TAPPA_BETA


def validate_selection(criterion: str, count: int, num_layers: int, *, beta: float | None = None,
                       protect_first: int = 0, protect_last: int = 0, shortlist: int = GUIDED_SHORTLIST,
                       refine_windows: int = GUIDED_WINDOWS, blocks: int = GUIDED_BLOCKS,
                       screen_tokens: int = HALVING_SCREEN_TOKENS, screen_dtype: str = "auto",
                       unit: str = "block") -> None:
    """Every option check that needs no model and no scores, so a typo fails before minutes of loading."""
    if criterion not in CRITERIA:
        raise OptionError(f"unknown --criterion {criterion!r}; choose one of {', '.join(CRITERIA)}")
    if unit not in SUBLAYER_UNITS:
        raise OptionError(f"--unit must be one of {', '.join(SUBLAYER_UNITS)}, got {unit!r}")
    if unit not in CRITERIA[criterion].units:
        able = [name for name, spec in CRITERIA.items() if unit in spec.units]
        raise OptionError(f"--criterion {criterion} does not rank {unit} sublayers; with --unit {unit} use one of "
                          f"{', '.join(able)}")
    beta = default_beta(criterion) if beta is None else beta
    if not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta < 0:
        raise OptionError(f"--beta must be a number >= 0 (TAPPA used 0.3), got {beta}")
    for flag, value, least in (("--shortlist", shortlist, 1), ("--refine-windows", refine_windows, 1),
                               ("--blocks", blocks, 0), ("--screen-tokens", screen_tokens, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise OptionError(f"{flag} must be a whole number >= {least}, got {value}")
    if screen_dtype not in SCREEN_DTYPES:
        raise OptionError(f"--screen-dtype must be one of {', '.join(SCREEN_DTYPES)}, got {screen_dtype!r}")
    for flag, value in (("--protect-first", protect_first), ("--protect-last", protect_last)):
        if value < 0:
            raise OptionError(f"{flag} must be 0 or more, got {value}")
    if count < 1:
        raise OptionError(f"--drop must be at least 1, got {count}")
    if count >= num_layers and unit != "mlp":
        what = "layers" if unit == "block" else "attention sublayers"
        raise OptionError(f"--drop {count} must be below the number of {what} ({num_layers}); at least one must stay")
    if count > num_layers:
        raise OptionError(f"--drop {count} is more than the {num_layers} MLP sublayers")
    free = num_layers - protect_first - protect_last
    if count > free:
        where = f"layers {protect_first}..{num_layers - protect_last - 1}" if free > 0 else "none"
        raise OptionError(f"--drop {count} is more than the {max(free, 0)} unprotected layers ({where}); "
                          "lower --drop, --protect-first or --protect-last")
    end = num_layers - max(1, protect_last)
    if unit in CRITERIA[criterion].contiguous and count > end - protect_first:
        raise OptionError(f"--criterion {criterion} removes one contiguous block and keeps the final layer: layers "
                          f"{protect_first}..{end - 1} leave room for {max(end - protect_first, 0)}, not {count}; "
                          "lower --drop, --protect-first or --protect-last")


def _num_layers(scores: Scores | None, model, num_layers: int | None) -> int:
    """The layer count from whatever is given; disagreement means the scores belong to another model."""
    known = {}
    if scores is not None:
        known["the scores"] = scores.num_layers
    if model is not None:
        from prunetool.model.runner import as_runner

        known["the model"] = len(as_runner(model).layers)
    if num_layers is not None:
        known["num_layers"] = num_layers
    if not known:
        raise OptionError("cannot select layers without the layer count: give scores, the model or num_layers")
    if len(set(known.values())) > 1:
        raise OptionError("layer counts disagree (" + ", ".join(f"{k}: {v}" for k, v in known.items())
                          + "); score this model again")
    return next(iter(known.values()))


def make_plan(base_model: str, criterion: str, count: int, *, scores: Scores | None = None, model=None,
              calibration: CalibrationSet | None = None, num_layers: int | None = None,
              beta: float | None = None, protect_first: int = 0, protect_last: int = 0,
              batch_size: int = 1, on_step: Callable[[int, int], None] | None = None,
              shortlist: int = GUIDED_SHORTLIST, refine_windows: int = GUIDED_WINDOWS,
              blocks: int = GUIDED_BLOCKS, screen_tokens: int = HALVING_SCREEN_TOKENS, screen_dtype: str = "auto",
              patch_objective: str | None = None, unit: str = "block") -> PrunePlan:
    """Validate, run one criterion, and record how the layers were chosen in a PrunePlan.

    `patch_objective` (prune --patch): criteria that can judge their proposals after the patch do so."""
    total = _num_layers(scores, model, num_layers)
    beta = default_beta(criterion) if beta is None else beta
    validate_selection(criterion, count, total, beta=beta, protect_first=protect_first, protect_last=protect_last,
                       shortlist=shortlist, refine_windows=refine_windows, blocks=blocks, screen_tokens=screen_tokens,
                       screen_dtype=screen_dtype, unit=unit)
    spec = CRITERIA[criterion]
    if spec.needs in ("scores", "both") and scores is None:
        raise OptionError(f"--criterion {criterion} ranks recorded scores; score the model first")
    if spec.needs in ("model", "both") and (model is None or calibration is None):
        raise OptionError(f"--criterion {criterion} measures perplexity, so it needs the model and calibration windows")
    request = SelectionRequest(total, count, scores, protect_first, protect_last, beta, model,
                               calibration.input_ids if calibration is not None else None, batch_size, on_step,
                               shortlist=shortlist, refine_windows=refine_windows, blocks=blocks,
                               screen_tokens=screen_tokens, screen_dtype=screen_dtype, unit=unit,
                               patch_objective=patch_objective if "patch_objective" in spec.parameters else None)
    selection = spec.select(request)
    parameters = {"protect_first": protect_first, "protect_last": protect_last}
    parameters |= {name: getattr(request, name) for name in spec.parameters} | selection.extra
    searched = None
    if spec.needs in ("model", "both"):
        searched = calibration.first(selection.extra.get("refine_windows", calibration.windows)).describe()
    described = scores.calibration if spec.needs in ("scores", "both") else searched
    return PrunePlan(base_model, total, selection.removed, criterion, parameters, selection.values, described,
                     searched, unit=unit)


def manual_plan(base_model: str, removed: Iterable[int], num_layers: int, unit: str = "block") -> PrunePlan:
    """A plan for layers the user named (--remove-layers); criterion "manual", nothing ranked."""
    return PrunePlan(base_model, num_layers, tuple(removed), "manual", unit=unit)


def parse_layers(text: str, num_layers: int, allow_all: bool = False, flag: str = "--remove-layers") -> tuple[int, ...]:
    """`--remove-layers 3,7,12` -> (3, 7, 12): 0-based original indices, comma-separated, spaces allowed; sorted.

    Removal must keep a layer; `allow_all` is for commands that only read the named layers.
    """
    hint = f"indices are 0-based, 0..{num_layers - 1} for this {num_layers}-layer model"
    if not text.strip():
        raise OptionError(f"{flag} is empty; give comma-separated layer indices such as 3,7,12 ({hint})")
    seen: list[int] = []
    for position, item in enumerate(text.split(","), 1):
        item = item.strip()
        if not item:
            raise OptionError(f"{flag} {text!r}: item {position} is empty; give comma-separated indices such as 3,7,12")
        if not re.fullmatch(r"[+-]?[0-9]+", item):
            raise OptionError(f"{flag} {text!r}: {item!r} is not a whole number; {hint}")
        index = int(item)
        if index < 0:
            raise OptionError(f"{flag} {text!r}: {index} is negative; {hint}")
        if index >= num_layers:
            raise OptionError(f"{flag} {text!r}: layer {index} does not exist; {hint}")
        if index in seen:
            raise OptionError(f"{flag} {text!r}: layer {index} is listed twice")
        seen.append(index)
    if len(seen) >= num_layers and not allow_all:
        raise OptionError(f"{flag} names all {num_layers} layers; at least one must stay")
    return tuple(sorted(seen))
