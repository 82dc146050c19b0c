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
from prunetool.metrics import minmax, rank01
from prunetool.plan import PrunePlan

if TYPE_CHECKING:
    from prunetool.calibration import CalibrationSet
    from prunetool.scoring import Scores

TAPPA_BETA = 0.3  # the value TAPPA (Yang et al., arXiv:2601.21709) used for Llama-3.1-8B
GUIDED_BETA = 0.3  # guided: TAPPA's published weight, now on ranks (bench/quality.py: 1.0 did worse on both models)
GUIDED_SHORTLIST = 4  # guided: candidates measured per round
GUIDED_WINDOWS = 4  # guided: calibration windows per perplexity measurement
GUIDED_BLOCKS = 3  # guided: contiguous blocks proposed beside the greedy path


def tappa_importance(block_influence: list[float], q_similarity: list[float], beta: float = TAPPA_BETA) -> list[float]:
    """TAPPA's BI' = minmax(BI) + beta * (1 - minmax(qsim)): low BI' means redundant and predictable."""
    bi, qsim = torch.tensor(block_influence, dtype=torch.float64), torch.tensor(q_similarity, dtype=torch.float64)
    return (minmax(bi) + beta * (1 - minmax(qsim))).tolist()


def guided_importance(block_influence: list[float], q_similarity: list[float], beta: float = GUIDED_BETA) -> list[float]:
    """rank01(BI) + beta * (1 - rank01(qsim)): TAPPA's combination with ranks in place of min-max."""
    bi, qsim = torch.tensor(block_influence, dtype=torch.float64), torch.tensor(q_similarity, dtype=torch.float64)
    return (rank01(bi) + beta * (1 - rank01(qsim))).tolist()


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
    batch_size: int = 1  # ppl and guided
    on_step: Callable[[int, int], None] | None = None  # ppl and guided: (evaluations done, total)
    shortlist: int = GUIDED_SHORTLIST  # guided only
    refine_windows: int = GUIDED_WINDOWS  # guided only
    blocks: int = GUIDED_BLOCKS  # guided only: contiguous candidate blocks measured
    measured: dict | None = None  # guided and ppl: frozenset(removed) -> perplexity, shared across calls

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


def _measure(req: SelectionRequest, windows: torch.Tensor, removed) -> float:
    """Calibration perplexity with `removed` gone (in memory); NaN counts as infinitely bad.

    `req.measured`, when given, remembers results by the removed set, so callers that select for several
    drop counts on one model and one set of windows (the quality benchmark) measure each set once.
    """
    from prunetool.in_memory import layers_removed
    from prunetool.perplexity import perplexity

    key = frozenset(removed)
    if req.measured is not None and key in req.measured:
        return req.measured[key]
    with layers_removed(req.model, list(removed)):
        value = perplexity(req.model, windows, batch_size=req.batch_size)
    value = math.inf if math.isnan(value) else value
    if req.measured is not None:
        req.measured[key] = value
    return value


class _Steps:
    """Counts measurements for the progress callback."""

    def __init__(self, req: SelectionRequest, total: int):
        self.req, self.total, self.done = req, total, 0

    def __call__(self) -> None:
        self.done += 1
        if self.req.on_step:
            self.req.on_step(self.done, self.total)


def _greedy_removal(req: SelectionRequest, windows: torch.Tensor, shortlist: Callable[[list[int], list[int]], list[int]],
                    step: _Steps) -> tuple[list[int], list[float | None], float]:
    """N rounds: each measures calibration perplexity with every shortlisted layer removed on top of those
    already chosen, and removes the lowest for good (ties: lower index).

    Returns the order, round one's value per layer (None where not measured) and the final perplexity.
    """
    removed: list[int] = []
    remaining = req.candidates
    first, last = None, math.nan
    for _ in range(req.count):
        trial = {}
        for layer in shortlist(remaining, removed):
            trial[layer] = _measure(req, windows, removed + [layer])
            step()
        best = min(trial, key=lambda i: (trial[i], i))
        first = first or [trial.get(i) for i in range(req.num_layers)]
        removed.append(best)
        last = trial[best]
        remaining = [i for i in remaining if i != best]
    return removed, first, last


def select_ppl(req: SelectionRequest) -> Selection:
    """SLEB-style greedy search (Song et al., arXiv:2402.09025): measure, do not predict.

    N rounds; in each, every remaining candidate is removed in memory on top of those already chosen and
    the perplexity of the calibration windows measured; the lowest (ties: lower index) goes for good.
    Costs sum_k (C-k) evaluations of all windows for C candidates. Values: perplexity after removing
    each layer alone (the first round); None for protected layers. It can overfit a small calibration
    set (baselines note), so the windows used are recorded in the plan.
    """
    step = _Steps(req, sum(len(req.candidates) - k for k in range(req.count)))
    removed, first, _ = _greedy_removal(req, req.windows, lambda remaining, _: remaining, step)
    return Selection(tuple(removed), first, {"greedy_order": removed})


def contiguous_blocks(values: list[float], count: int, start: int, end: int, best: int) -> list[tuple[int, ...]]:
    """The `best` blocks [l, l+count) inside [start, end) with the lowest summed values (ties: lower l)."""
    starts = range(start, end - count + 1)
    ranked = sorted(starts, key=lambda l: (sum(values[l:l + count]), l))
    return [tuple(range(l, l + count)) for l in ranked[:best]]


def select_guided(req: SelectionRequest) -> Selection:
    """prunetool's default: q-similarity and Block Influence propose, calibration perplexity decides.

    Layers are ordered by guided_importance, rank01(BI) + beta * (1 - rank01(qsim)) (TAPPA's signal with
    rank normalisation). Two kinds of candidate sets are proposed from that order and the one with the
    lowest perplexity on the first `refine_windows` calibration windows is removed:
    - a greedy path: N rounds, each measuring the `shortlist` lowest-ranked remaining layers removed on
      top of those already chosen and keeping the best (SLEB's search, restricted to the shortlist);
    - the `blocks` contiguous runs of N layers with the lowest summed importance (removing neighbours
      together often costs less than their single-layer costs add up to, which greedy search misses).
    Cost: N * shortlist + blocks evaluations of a few windows, against SLEB's sum_k (C-k) over all of
    them. Values: the guided importance of every layer.
    """
    values = guided_importance(_column(req, "block_influence"), _column(req, "q_similarity"), req.beta)
    size = max(1, req.shortlist)
    windows = req.windows[: max(1, req.refine_windows)]
    blocks = contiguous_blocks(values, req.count, req.protect_first, req.num_layers - req.protect_last, req.blocks)
    step = _Steps(req, sum(min(size, len(req.candidates) - k) for k in range(req.count)) + len(blocks))

    def shortlist(remaining: list[int], _removed: list[int]) -> list[int]:
        return sorted(remaining, key=lambda i: (values[i], i))[:size]

    order, _, greedy_ppl = _greedy_removal(req, windows, shortlist, step)
    proposals = {tuple(sorted(order)): ("greedy", greedy_ppl)}
    for block in blocks:
        if block not in proposals:
            proposals[block] = ("block", _measure(req, windows, block))
        step()
    chosen = min(proposals, key=lambda c: (proposals[c][1], c))
    extra = {"greedy_order": order, "refine_windows": int(windows.shape[0]), "chosen_from": proposals[chosen][0],
             "proposals": [{"removed": list(c), "kind": k, "perplexity": v} for c, (k, v) in proposals.items()]}
    return Selection(chosen, values, extra)


@dataclass(frozen=True)
class Criterion:
    select: Callable[[SelectionRequest], Selection]
    needs: str  # "scores", "model" (the model and calibration windows), "both" or "nothing"
    summary: str  # one line for --help and reports
    parameters: tuple[str, ...] = ()  # SelectionRequest fields recorded in the plan besides protection
    contiguous: bool = False  # removes one block that must keep the final layer


CRITERIA: dict[str, Criterion] = {
    "guided": Criterion(select_guided, "both", "q-similarity/BI rank proposes layer sets, calibration perplexity picks (default)",
                        ("beta", "shortlist", "refine_windows", "blocks", "batch_size")),
    "qsim": Criterion(select_qsim, "scores", "highest query self-similarity (most predictable queries) first"),
    "tappa": Criterion(select_tappa, "scores", "TAPPA: lowest minmax(BI) + beta*(1 - minmax(qsim)) first", ("beta",)),
    "bi": Criterion(select_bi, "scores", "ShortGPT: lowest block influence first"),
    "angular": Criterion(select_angular, "scores", "Gromov et al.: contiguous block with the smallest angular distance",
                         contiguous=True),
    "last": Criterion(select_last, "nothing", "the N layers just before the final one", contiguous=True),
    "ppl": Criterion(select_ppl, "model", "SLEB-style greedy: remove the layer that hurts calibration perplexity least, N times",
                     ("batch_size",)),
}


def default_beta(criterion: str) -> float:
    """guided's own default (GUIDED_BETA) or TAPPA's published 0.3; equal today, kept apart on purpose."""
    return GUIDED_BETA if criterion == "guided" else TAPPA_BETA


def validate_selection(criterion: str, count: int, num_layers: int, *, beta: float | None = None,
                       protect_first: int = 0, protect_last: int = 0, shortlist: int = GUIDED_SHORTLIST,
                       refine_windows: int = GUIDED_WINDOWS, blocks: int = GUIDED_BLOCKS) -> None:
    """Every option check that needs no model and no scores, so a typo fails before minutes of loading."""
    if criterion not in CRITERIA:
        raise OptionError(f"unknown --criterion {criterion!r}; choose one of {', '.join(CRITERIA)}")
    beta = default_beta(criterion) if beta is None else beta
    if not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta < 0:
        raise OptionError(f"--beta must be a number >= 0 (TAPPA used 0.3), got {beta}")
    for flag, value, least in (("--shortlist", shortlist, 1), ("--refine-windows", refine_windows, 1),
                               ("--blocks", blocks, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise OptionError(f"{flag} must be a whole number >= {least}, got {value}")
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
              beta: float | None = None, protect_first: int = 0, protect_last: int = 0,
              batch_size: int = 1, on_step: Callable[[int, int], None] | None = None,
              shortlist: int = GUIDED_SHORTLIST, refine_windows: int = GUIDED_WINDOWS,
              blocks: int = GUIDED_BLOCKS) -> PrunePlan:
    """Validate, run one criterion, and record how the layers were chosen in a PrunePlan."""
    total = _num_layers(scores, model, num_layers)
    beta = default_beta(criterion) if beta is None else beta
    validate_selection(criterion, count, total, beta=beta, protect_first=protect_first, protect_last=protect_last,
                       shortlist=shortlist, refine_windows=refine_windows, blocks=blocks)
    spec = CRITERIA[criterion]
    if spec.needs in ("scores", "both") and scores is None:
        raise OptionError(f"--criterion {criterion} ranks recorded scores; score the model first")
    if spec.needs in ("model", "both") and (model is None or calibration is None):
        raise OptionError(f"--criterion {criterion} measures perplexity, so it needs the model and calibration windows")
    request = SelectionRequest(total, count, scores, protect_first, protect_last, beta, model,
                               calibration.input_ids if calibration is not None else None, batch_size, on_step,
                               shortlist=shortlist, refine_windows=refine_windows, blocks=blocks)
    selection = spec.select(request)
    parameters = {"protect_first": protect_first, "protect_last": protect_last}
    parameters |= {name: getattr(request, name) for name in spec.parameters} | selection.extra
    if spec.needs in ("scores", "both"):
        described = scores.calibration
    else:
        described = calibration.describe() if calibration is not None else None
    return PrunePlan(base_model, total, selection.removed, criterion, parameters, selection.values, described)


def manual_plan(base_model: str, removed: Iterable[int], num_layers: int) -> PrunePlan:
    """A plan for layers the user named (--layers); criterion "manual", nothing ranked."""
    return PrunePlan(base_model, num_layers, tuple(removed), "manual")


def parse_layers(text: str, num_layers: int, allow_all: bool = False) -> tuple[int, ...]:
    """`--layers 3,7,12` -> (3, 7, 12): 0-based original indices, comma-separated, spaces allowed; sorted.

    Removal must keep a layer; `allow_all` is for commands that only read the named layers.
    """
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
    if len(seen) >= num_layers and not allow_all:
        raise OptionError(f"--layers names all {num_layers} layers; at least one must stay")
    return tuple(sorted(seen))
