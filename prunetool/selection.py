"""Scores -> which layers to remove: one registry of criteria, and the plan they produce.

A criterion maps a SelectionRequest (the drop count N, the protected layers, the recorded scores and,
for `ppl` only, the model and calibration windows) to a Selection: the removed original 0-based
indices plus the per-layer values it ranked, which the --dry-run table shows. Every criterion except
`ppl` is a pure function of the scores, so it can be rerun from a scores file in milliseconds.
Adding a criterion is one function and one line in CRITERIA.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from prunetool.architecture import decoder_of
from prunetool.errors import OptionError, PrunetoolError
from prunetool.metrics import minmax
from prunetool.plan import PrunePlan

if TYPE_CHECKING:
    from prunetool.calibration import CalibrationSet
    from prunetool.scoring import Scores

TAPPA_BETA = 0.3  # the value TAPPA (Yang et al., arXiv:2601.21709) used for Llama-3.1-8B


def tappa_importance(block_influence: list[float], q_similarity: list[float], beta: float = TAPPA_BETA) -> list[float]:
    """TAPPA's BI' = minmax(BI) + beta * (1 - minmax(qsim)): low BI' means redundant and predictable."""
    bi, qsim = torch.tensor(block_influence, dtype=torch.float64), torch.tensor(q_similarity, dtype=torch.float64)
    return (minmax(bi) + beta * (1 - minmax(qsim))).tolist()


def lowest(values: list[float], count: int, candidates: Iterable[int] | None = None) -> list[int]:
    """Indices (among `candidates`, default all) of the `count` smallest values, ties to the lower index, sorted."""
    pool = range(len(values)) if candidates is None else candidates
    nan = [index for index in pool if math.isnan(values[index])]
    if nan:
        raise PrunetoolError(f"the scores of layers {nan} are NaN, so they cannot be ranked; "
                             "score again in float32 (--dtype float32)")
    order = sorted(pool, key=lambda index: (values[index], index))
    return sorted(order[:count])


def default_drop_count(num_layers: int) -> int:
    """A quarter of the layers, ShortGPT's typical cut, as the preview when no count is given."""
    return max(1, num_layers // 4)


@dataclass(frozen=True)
class SelectionRequest:
    """Everything a criterion may use; indices are 0-based in the original model."""

    num_layers: int  # L
    count: int  # N, the layers to remove
    scores: Scores | None = None
    protect_first: int = 0  # never remove layers 0..protect_first-1
    protect_last: int = 0  # never remove the last protect_last layers
    beta: float = TAPPA_BETA  # tappa only
    model: object = None  # ppl only
    windows: torch.Tensor | None = None  # ppl only: calibration input_ids (W, T)
    batch_size: int = 1  # ppl only
    on_step: Callable[[int, int], None] | None = None  # ppl only: (evaluations done, total)

    @property
    def candidates(self) -> list[int]:
        return list(range(self.protect_first, self.num_layers - self.protect_last))

    @property
    def block_end(self) -> int:
        """Exclusive end of a contiguous block: before the protected tail, and never the final layer."""
        return self.num_layers - max(1, self.protect_last)


@dataclass(frozen=True)
class Selection:
    removed: tuple[int, ...]
    values: list[float | None] | None  # one per original layer; None where there is nothing per layer
    extra: dict = field(default_factory=dict)  # recorded in the plan's parameters


def _column(req: SelectionRequest, metric: str) -> list[float]:
    values = req.scores.column(metric)
    if len(values) != req.num_layers:
        raise PrunetoolError(f"the scores hold {len(values)} {metric} values for a {req.num_layers}-layer model; score again")
    return values


def select_qsim(req: SelectionRequest) -> Selection:
    """Highest query self-similarity first: the layers whose queries are most predictable (TAPPA's signal)."""
    values = _column(req, "q_similarity")
    return Selection(tuple(lowest([-v for v in values], req.count, req.candidates)), values)


def select_tappa(req: SelectionRequest) -> Selection:
    """TAPPA (Yang et al., arXiv:2601.21709): lowest BI' = minmax(BI) + beta * (1 - minmax(qsim)) first.

    Min-max runs over all layers (protected ones included) so the shown values do not depend on protection.
    """
    values = tappa_importance(_column(req, "block_influence"), _column(req, "q_similarity"), req.beta)
    return Selection(tuple(lowest(values, req.count, req.candidates)), values)


def select_bi(req: SelectionRequest) -> Selection:
    """ShortGPT (Men et al., arXiv:2403.03853): lowest Block Influence, 1 - cos(layer in, layer out), first."""
    values = _column(req, "block_influence")
    return Selection(tuple(lowest(values, req.count, req.candidates)), values)


def select_angular(req: SelectionRequest) -> Selection:
    """Gromov et al. (arXiv:2403.17887): the block [l, l+N) whose input and output are closest in angle.

    angular_distance[l][l+N] compares the input of layer l with the input of layer l+N (index L is the
    final output). The block never includes the final layer (l+N <= L-1), as in the paper; ties go to
    the smaller l. Values: d(l, l+N) per possible start l, None where no block may start.
    """
    n, dist = req.count, req.scores.angular_distance
    if len(dist) != req.num_layers + 1 or any(len(row) != req.num_layers + 1 for row in dist):
        raise PrunetoolError(f"the scores' angular distance matrix is not {req.num_layers + 1}x{req.num_layers + 1}; score again")
    values: list[float | None] = [None] * req.num_layers
    starts = range(req.protect_first, req.block_end - n + 1)
    for start in starts:
        values[start] = dist[start][start + n]
    best = lowest(values, 1, starts)[0]
    return Selection(tuple(range(best, best + n)), values)


def select_last(req: SelectionRequest) -> Selection:
    """The N layers just before the final one, [L-1-N, L-1): the simpler heuristic Gromov et al.
    (arXiv:2403.17887) compare with their angular criterion, as deep layers (bar the last) tend to matter least.

    With protect_last > 1 the block moves up to sit just before the protected tail.
    """
    return Selection(tuple(range(req.block_end - req.count, req.block_end)), None)


def select_ppl(req: SelectionRequest) -> Selection:
    """SLEB-style greedy search (Song et al., arXiv:2402.09025): measure, do not predict.

    N rounds; in each, every remaining candidate is removed in memory on top of those already chosen and
    the perplexity of the calibration windows measured; the lowest (ties: lower index) goes for good.
    Costs sum_k (C-k) evaluations of all windows for C candidates. Values: perplexity after removing
    each layer alone (the first round); None for protected layers. It can overfit a small calibration
    set (baselines note), so the windows used are recorded in the plan.
    """
    from prunetool.in_memory import layers_removed
    from prunetool.perplexity import perplexity

    removed: list[int] = []
    remaining = req.candidates
    total = sum(len(remaining) - k for k in range(req.count))
    done, first = 0, None
    for _ in range(req.count):
        trial = {}
        for layer in remaining:
            with layers_removed(req.model, removed + [layer]):
                trial[layer] = perplexity(req.model, req.windows, batch_size=req.batch_size)
            done += 1
            if req.on_step:
                req.on_step(done, total)
        best = min(remaining, key=lambda i: (math.inf if math.isnan(trial[i]) else trial[i], i))
        first = first or [trial.get(i) for i in range(req.num_layers)]
        removed.append(best)
        remaining = [i for i in remaining if i != best]
    return Selection(tuple(removed), first, {"greedy_order": removed})


@dataclass(frozen=True)
class Criterion:
    select: Callable[[SelectionRequest], Selection]
    needs: str  # "scores", "model" (the model and calibration windows) or "nothing"
    summary: str  # one line for --help and reports
    parameters: tuple[str, ...] = ()  # SelectionRequest fields recorded in the plan besides protection
    contiguous: bool = False  # removes one block that must keep the final layer


CRITERIA: dict[str, Criterion] = {
    "qsim": Criterion(select_qsim, "scores", "highest query self-similarity (most predictable queries) first"),
    "tappa": Criterion(select_tappa, "scores", "TAPPA: lowest minmax(BI) + beta*(1 - minmax(qsim)) first", ("beta",)),
    "bi": Criterion(select_bi, "scores", "ShortGPT: lowest block influence first"),
    "angular": Criterion(select_angular, "scores", "Gromov et al.: contiguous block with the smallest angular distance",
                         contiguous=True),
    "last": Criterion(select_last, "nothing", "the N layers just before the final one", contiguous=True),
    "ppl": Criterion(select_ppl, "model", "SLEB-style greedy: remove the layer that hurts calibration perplexity least, N times",
                     ("batch_size",)),
}


def validate_selection(criterion: str, count: int, num_layers: int, *, beta: float = TAPPA_BETA,
                       protect_first: int = 0, protect_last: int = 0) -> None:
    """Every option check that needs no model and no scores, so a typo fails before minutes of loading."""
    if criterion not in CRITERIA:
        raise OptionError(f"unknown --criterion {criterion!r}; choose one of {', '.join(CRITERIA)}")
    if not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta < 0:
        raise OptionError(f"--beta must be a number >= 0 (TAPPA used 0.3), got {beta}")
    for flag, value in (("--protect-first", protect_first), ("--protect-last", protect_last)):
        if value < 0:
            raise OptionError(f"{flag} must be 0 or more, got {value}")
    if count < 1:
        raise OptionError(f"--drop must be at least 1, got {count}")
    if count >= num_layers:
        raise OptionError(f"--drop {count} must be below the number of layers ({num_layers}); at least one must stay")
    free = num_layers - protect_first - protect_last
    if count > free:
        where = f"layers {protect_first}..{num_layers - protect_last - 1}" if free > 0 else "none"
        raise OptionError(f"--drop {count} is more than the {max(free, 0)} unprotected layers ({where}); "
                          "lower --drop, --protect-first or --protect-last")
    end = num_layers - max(1, protect_last)
    if CRITERIA[criterion].contiguous and count > end - protect_first:
        raise OptionError(f"--criterion {criterion} removes one contiguous block and keeps the final layer: layers "
                          f"{protect_first}..{end - 1} leave room for {max(end - protect_first, 0)}, not {count}; "
                          "lower --drop, --protect-first or --protect-last")


def _num_layers(scores: Scores | None, model, num_layers: int | None) -> int:
    """The layer count from whatever is given; disagreement means the scores belong to another model."""
    known = {}
    if scores is not None:
        known["the scores"] = scores.num_layers
    if model is not None:
        known["the model"] = len(decoder_of(model).layers)
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
              beta: float = TAPPA_BETA, protect_first: int = 0, protect_last: int = 0,
              batch_size: int = 1, on_step: Callable[[int, int], None] | None = None) -> PrunePlan:
    """Validate, run one criterion, and record how the layers were chosen in a PrunePlan."""
    total = _num_layers(scores, model, num_layers)
    validate_selection(criterion, count, total, beta=beta, protect_first=protect_first, protect_last=protect_last)
    spec = CRITERIA[criterion]
    if spec.needs == "scores" and scores is None:
        raise OptionError(f"--criterion {criterion} ranks recorded scores; score the model first")
    if spec.needs == "model" and (model is None or calibration is None):
        raise OptionError(f"--criterion {criterion} measures perplexity, so it needs the model and calibration windows")
    request = SelectionRequest(total, count, scores, protect_first, protect_last, beta, model,
                               calibration.input_ids if calibration is not None else None, batch_size, on_step)
    selection = spec.select(request)
    parameters = {"protect_first": protect_first, "protect_last": protect_last}
    parameters |= {name: getattr(request, name) for name in spec.parameters} | selection.extra
    if spec.needs == "scores":
        described = scores.calibration
    else:
        described = calibration.describe() if calibration is not None else None
    return PrunePlan(base_model, total, selection.removed, criterion, parameters, selection.values, described)


def manual_plan(base_model: str, removed: Iterable[int], num_layers: int) -> PrunePlan:
    """A plan for layers the user named (--layers); criterion "manual", nothing ranked."""
    return PrunePlan(base_model, num_layers, tuple(removed), "manual")


def parse_layers(text: str, num_layers: int) -> tuple[int, ...]:
    """`--layers 3,7,12` -> (3, 7, 12): 0-based original indices, comma-separated, spaces allowed; sorted."""
    hint = f"indices are 0-based, 0..{num_layers - 1} for this {num_layers}-layer model"
    if not text.strip():
        raise OptionError(f"--layers is empty; give comma-separated layer indices such as 3,7,12 ({hint})")
    seen: list[int] = []
    for position, item in enumerate(text.split(","), 1):
        item = item.strip()
        if not item:
            raise OptionError(f"--layers {text!r}: item {position} is empty; give comma-separated indices such as 3,7,12")
        if not re.fullmatch(r"[+-]?[0-9]+", item):
            raise OptionError(f"--layers {text!r}: {item!r} is not a whole number; {hint}")
        index = int(item)
        if index < 0:
            raise OptionError(f"--layers {text!r}: {index} is negative; {hint}")
        if index >= num_layers:
            raise OptionError(f"--layers {text!r}: layer {index} does not exist; {hint}")
        if index in seen:
            raise OptionError(f"--layers {text!r}: layer {index} is listed twice")
        seen.append(index)
    if len(seen) >= num_layers:
        raise OptionError(f"--layers names all {num_layers} layers; at least one must stay")
    return tuple(sorted(seen))
