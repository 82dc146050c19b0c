"""Repair-aware selection: judge candidate cuts by their perplexity *after* `--patch`'s fit.

The best cut to make is the one that is best once repaired, and a contiguous block that hurts more
than a scattered set before repair can hurt less after it (one patch stands in for the whole block).
Fitting is cheap: every run's statistics come from one hooked pass of the unpruned model, shared by all
candidates (a run that several candidates contain is captured and fitted once), and each candidate is
then measured with its runs' tensors swapped in for the duration of the measurement.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from prunetool.repair.capture import capture_runs
from prunetool.repair.fit import fit_runs
from prunetool.repair.sites import runner_sites
from prunetool.cut import Cut
from prunetool.model.runner import as_runner


def patched_perplexities(model, cuts: Iterable[Sequence[int]], fit_windows: torch.Tensor, judge_windows: torch.Tensor,
                         objective: str, *, batch_size: int = 1) -> dict[tuple[int, ...], float]:
    """{cut: perplexity of `judge_windows` with the cut removed and its patch (fitted on `fit_windows`) folded in}."""
    runner = as_runner(model)
    sites_of = {tuple(sorted(cut)): runner_sites(runner, sorted(cut)) for cut in cuts}
    sites = {(site.first, site.last): site for cut_sites in sites_of.values() for site in cut_sites}
    data = capture_runs(runner, fit_windows, list(sites.values()), objective, batch_size=batch_size)
    fitted = {(patch_data.site.first, patch_data.site.last): patch
              for patch_data, patch in zip(data, fit_runs(runner, data, objective))}
    out = {}
    for cut, cut_sites in sites_of.items():
        tensors = {}
        for site in cut_sites:
            tensors |= fitted[(site.first, site.last)].tensors
        with runner.tensors_replaced(tensors):
            out[cut] = runner.perplexity(judge_windows, cut=Cut.of("block", cut, len(runner.layers)),
                                         batch_size=batch_size)
    return out
