"""Measured searches: remove candidate layer sets in memory and compare calibration perplexity.

Unlike ranking.py these are not functions of the scores alone: they run the model on the calibration
windows handed to them (SelectionRequest.windows, the selection windows only; held-out windows never
reach a search), and the plan records which windows those were.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from prunetool.cut import Cut
from prunetool.select.ranking import (INFLUENCE_COLUMNS, Selection, SelectionRequest, column, contiguous_blocks,
                                     guided_importance)

class _LowerBound(float):
    """A remembered measurement that gave up early: the set's perplexity is above this value."""


def _measure(req: SelectionRequest, windows: torch.Tensor, removed, engine=None, give_up_above: float = math.inf) -> float:
    """Calibration perplexity with `removed` gone (in memory); NaN counts as infinitely bad.

    With an `engine` (prunetool.select.cut_engine), only the layers after the first layer that differs from its
    current cut run; without one (an architecture it cannot replay), a full forward of the cut model.
    `give_up_above`: the caller only asks whether this set beats that value, so the engine may stop early;
    a result above it can be a lower bound.
    `req.measured`, when given, remembers results by the removed set, so callers that select for several
    drop counts on one model and one set of windows (the quality benchmark) measure each set once; a
    result above the limit is remembered as a _LowerBound, which answers later callers whose limit it
    also exceeds and is measured again for the others.
    """
    key = frozenset(removed)
    known = req.measured.get(key) if req.measured is not None else None
    if known is not None and (not isinstance(known, _LowerBound) or known > give_up_above):
        return known
    engine = engine.get() if engine is not None else None
    if engine is not None:
        if not set(engine.removed) <= key:  # another branch of the search: move the cut, keep the shared prefix
            engine.set_cut(key)
        value = engine.perplexity_without(key, give_up_above=give_up_above)
    else:
        value = _full_forward(req, windows, removed)
    value = math.inf if math.isnan(value) else value
    if req.measured is not None:
        req.measured[key] = value if value <= give_up_above else _LowerBound(value)
    return value


class _LazyEngine:
    """A CutEngine over `windows`, built on the first measurement that the memo cannot answer (building
    costs one plain forward, the capture, and the self-check's replay of one window); None inside where
    the model's forward cannot be replayed layer by layer, and the searches then measure with full
    forwards."""

    def __init__(self, req: SelectionRequest, windows: torch.Tensor, *, screening: bool = False):
        self.req, self.windows, self.removed, self._engine, self._built = req, windows, [], None, False
        self.screening = screening  # runs on cut_engine.screening_model (bfloat16 where that is native)
        self.dtype = None  # what the measurements ran in, once built

    def get(self):
        if not self._built:
            from prunetool.select.cut_engine import CutEngine, EngineUnsupported, screening_model

            self._built = True
            model = screening_model(self.req.model) if self.screening else self.req.model
            try:
                self._engine = CutEngine(model, self.windows, batch_size=self.req.batch_size, unit=self.req.unit)
                self._engine.remove(self.removed)
                self.dtype = self._engine.model.dtype
            except EngineUnsupported:
                self._engine = None  # full forwards of the model itself
                self.dtype = self.req.model.dtype if isinstance(self.req.model, torch.nn.Module) else None
        return self._engine

    def remove(self, layers: list[int]) -> None:
        self.removed += layers
        if self._engine is not None:
            self._engine.remove(layers)


def _full_forward(req: SelectionRequest, windows: torch.Tensor, removed) -> float:
    """Perplexity of `windows` with `removed` gone, by a plain forward of the cut model (no engine)."""
    from prunetool.model.runner import cut_perplexity

    return cut_perplexity(req.model, windows, Cut.of(req.unit, removed, req.num_layers), batch_size=req.batch_size)


class _Steps:
    """Counts measurements for the progress callback."""

    def __init__(self, req: SelectionRequest, total: int):
        self.req, self.total, self.done = req, total, 0

    def __call__(self) -> None:
        self.done += 1
        if self.req.on_step:
            self.req.on_step(self.done, self.total)


def _greedy_removal(req: SelectionRequest, windows: torch.Tensor, shortlist: Callable[[list[int], list[int]], list[int]],
                    step: _Steps, engine=None) -> tuple[list[int], list[float | None], float]:
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
            trial[layer] = _measure(req, windows, removed + [layer], engine)
            step()
        best = min(trial, key=lambda i: (trial[i], i))
        first = first or [trial.get(i) for i in range(req.num_layers)]
        removed.append(best)
        last = trial[best]
        remaining = [i for i in remaining if i != best]
        if engine is not None and len(removed) < req.count:
            engine.remove([best])
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
    removed, first, _ = _greedy_removal(req, req.windows, lambda remaining, _: remaining, step,
                                        _LazyEngine(req, req.windows))
    return Selection(tuple(removed), first, {"greedy_order": removed})


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
    values = guided_importance(column(req, INFLUENCE_COLUMNS[req.unit]), column(req, "q_similarity"), req.beta)
    size = max(1, req.shortlist)
    windows = req.windows[: max(1, req.refine_windows)]
    blocks = contiguous_blocks(values, req.count, req.protect_first, req.num_layers - req.protect_last, req.blocks)
    step = _Steps(req, sum(min(size, len(req.candidates) - k) for k in range(req.count)) + len(blocks))

    def shortlist(remaining: list[int], _removed: list[int]) -> list[int]:
        return sorted(remaining, key=lambda i: (values[i], i))[:size]

    engine = _LazyEngine(req, windows)
    block_ppl = {}
    for block in blocks:  # before the greedy path moves the engine's cut away from the uncut model
        block_ppl[block] = _measure(req, windows, block, engine)
    order, _, greedy_ppl = _greedy_removal(req, windows, shortlist, step, engine)
    proposals = {tuple(sorted(order)): ("greedy", greedy_ppl)}
    for block in blocks:
        if block not in proposals:
            proposals[block] = ("block", block_ppl[block])
        step()
    chosen = min(proposals, key=lambda c: (proposals[c][1], c))
    extra = {"greedy_order": order, "refine_windows": int(windows.shape[0]), "chosen_from": proposals[chosen][0],
             "proposals": [{"removed": list(c), "kind": k, "perplexity": v} for c, (k, v) in proposals.items()]}
    return Selection(chosen, values, extra)


def _screen(req: SelectionRequest, holder: _LazyEngine, base: list[int], extras: list[tuple[int, ...]],
            keep: int | None = None) -> dict[tuple[int, ...], float]:
    """Perplexity of `base + extra` for every extra, on the holder's (short) screening windows.

    `keep`: the caller uses only the `keep` lowest, so once `keep` are measured each further extra gives up
    as soon as it is certainly above the keep-th lowest so far; its value is then a lower bound above that,
    which leaves the `keep` lowest (ties by key included) what exact values would make them. Extras are
    measured in the order given: best guesses first make the limit tight early.
    """
    engine = holder.get()
    values: dict[tuple[int, ...], float] = {}
    if engine is not None:
        engine.set_cut(base)
        for extra in extras:
            limit = math.inf if keep is None or len(values) < keep else sorted(values.values())[keep - 1]
            value = engine.perplexity_without(extra, give_up_above=limit)
            values[extra] = math.inf if math.isnan(value) else value
    else:
        for extra in extras:
            value = _full_forward(req, holder.windows, {*base, *extra})
            values[extra] = math.inf if math.isnan(value) else value
    return values


def select_halving(req: SelectionRequest) -> Selection:
    """SLEB's greedy search made cheap by successive halving, plus contiguous blocks and a local swap.

    Measuring windows are the first `refine_windows` calibration windows; screening windows are their
    first `screen_tokens` tokens (a quarter of the text at the defaults, and the shorter attention is
    cheaper still), run in bfloat16 where that is native (cut_engine.screening_model; the plan records
    `screened_in`; `screen_dtype="model"` keeps the model's dtype) while every measurement that decides
    runs in the model's own dtype. Round one screens every candidate, later rounds the better half of
    round one's screening; each round measures only its best `shortlist` on the measuring windows, and the lowest
    goes for good. Beside that greedy path, every contiguous run of N layers is screened and the best
    `blocks` measured (removing neighbours together can cost less than greedy's one-at-a-time order
    finds), right after round one while the engines still hold the uncut model. The best proposal is
    then refined: a removed layer is swapped for a kept neighbour while that lowers the perplexity.
    Both window sets are measured through the cut engine (prunetool.select.cut_engine), so a candidate runs
    only the layers after it; wherever only the lowest values count (later rounds' screening, the
    confirmations, the blocks' screening, the swaps) a candidate stops as soon as it is certainly worse
    than what the search holds, which leaves every choice and every reported value as full measurement
    would make them.
    Values: round one's screening perplexity per layer (None for protected layers).
    """
    windows = req.windows[: max(1, req.refine_windows)]
    screening = _LazyEngine(req, windows[:, : max(2, req.screen_tokens)], screening=req.screen_dtype == "auto")
    holder = _LazyEngine(req, windows)
    keep = max(1, req.shortlist)
    half = max(len(req.candidates) // 2, keep + req.count)
    step = _Steps(req, len(req.candidates) + (req.count - 1) * half + req.count * keep + 2 * req.blocks + 4 * req.count)
    removed: list[int] = []
    first: list[float | None] | None = None
    pool, screened = req.candidates, {}
    for _ in range(req.count):
        # the previous round's order (best first) makes the give-up limits of this round's screening tight
        remaining = sorted((i for i in pool if i not in removed), key=lambda i: (screened.get(i, math.inf), i))
        screened = {extra[0]: value for extra, value in
                    _screen(req, screening, removed, [(i,) for i in remaining], keep=None if first is None else keep).items()}
        for _ in remaining:
            step()
        if first is None:  # later rounds screen only round one's better half: a layer whose removal alone
            first = [screened.get(i) for i in range(req.num_layers)]  # ranks low seldom becomes the best
            pool = sorted(screened, key=lambda i: (screened[i], i))[:max(len(screened) // 2, keep + req.count)]
            block_ppl = _measured_blocks(req, screening, holder, windows, first, step)  # while both are uncut
        confirmed: dict[int, float] = {}
        for layer in sorted(screened, key=lambda i: (screened[i], i))[:keep]:  # only the lowest matters
            confirmed[layer] = _measure(req, windows, removed + [layer], holder,
                                        give_up_above=min(confirmed.values(), default=math.inf))
            step()
        best = min(confirmed, key=lambda i: (confirmed[i], i))
        removed.append(best)
        greedy_ppl = confirmed[best]
        if len(removed) < req.count:  # later rounds' confirmations share the new prefix
            holder.remove([best])
    proposals = {tuple(sorted(removed)): ("greedy", greedy_ppl)}
    for block, value in block_ppl.items():
        proposals.setdefault(block, ("block", value))
    chosen = min(proposals, key=lambda c: (proposals[c][1], c))
    best_ppl, swaps = proposals[chosen][1], []
    improved = True
    while improved:  # first improvement, until no swap of a removed layer for a kept neighbour helps
        improved = False
        for layer in chosen:
            for neighbour in (layer - 1, layer + 1):
                if neighbour in chosen or neighbour not in req.candidates:
                    continue
                trial = tuple(sorted((set(chosen) - {layer}) | {neighbour}))
                value = _measure(req, windows, trial, holder, give_up_above=best_ppl)
                step()
                if value < best_ppl:
                    swaps.append({"out": layer, "in": neighbour, "perplexity": value})
                    chosen, best_ppl, improved = trial, value, True
                    break
            if improved:
                break
    proposals.setdefault(chosen, ("swap", best_ppl))
    extra = {"greedy_order": removed, "refine_windows": int(windows.shape[0]), "screen_tokens": int(screening.windows.shape[1]),
             "screened_in": str(screening.dtype).removeprefix("torch.") if screening.dtype is not None else None,
             "chosen_from": proposals[chosen][0],
             "proposals": [{"removed": list(c), "kind": k, "perplexity": v} for c, (k, v) in proposals.items()],
             "swaps": swaps, "perplexity": best_ppl}
    if req.patch_objective is not None:
        chosen = _judge_patched(req, windows, proposals, extra)
    return Selection(chosen, first, extra)


def _measured_blocks(req: SelectionRequest, screening: _LazyEngine, holder: _LazyEngine, windows: torch.Tensor,
                     first: list[float | None], step: _Steps) -> dict[tuple[int, ...], float]:
    """Every contiguous run of N candidate layers screened, and the best `req.blocks` measured.

    Called while both engines hold the uncut model, so a block runs only from its first layer on.
    """
    starts = range(req.protect_first, req.block_end - req.count + 1)
    if req.blocks <= 0 or len(starts) == 0:
        return {}
    blocks = sorted((tuple(range(start, start + req.count)) for start in starts),  # likeliest first
                    key=lambda b: (sum(math.log(first[i]) for i in b), b))
    screened = _screen(req, screening, [], blocks, keep=req.blocks)  # each block is its own cut
    measured = {}
    for block in sorted(screened, key=lambda b: (screened[b], b))[:req.blocks]:
        measured[block] = _measure(req, windows, block, holder)
        step()
    return measured


def _judge_patched(req: SelectionRequest, windows: torch.Tensor, proposals: dict, extra: dict) -> tuple[int, ...]:
    """Repair-aware choice (prune --patch): every proposal measured with its patch fitted and folded in.

    The fit reads the calibration windows after the measuring ones (all of them when there are no others),
    so a proposal is not judged on the text its patch was fitted to.
    """
    from prunetool.repair.judge import patched_perplexities

    fit = req.windows[windows.shape[0]:] if req.windows.shape[0] > windows.shape[0] else windows
    patched = patched_perplexities(req.model, list(proposals), fit, windows, req.patch_objective, batch_size=req.batch_size)
    patched = {cut: math.inf if math.isnan(value) else value for cut, value in patched.items()}
    chosen = min(patched, key=lambda c: (patched[c], c))
    extra.update({"judged_after_patch": {"objective": req.patch_objective, "fit_windows": int(fit.shape[0]),
                                         "fit_on_measuring_windows": fit is windows},
                  "patched": [{"removed": list(c), "kind": proposals[c][0], "perplexity": proposals[c][1],
                               "patched_perplexity": v} for c, v in patched.items()],
                  "perplexity": proposals[chosen][1], "patched_perplexity": patched[chosen],
                  "chosen_from": proposals[chosen][0]})
    return chosen
