"""Repair-aware selection: judge candidate cuts by their perplexity *after* `--patch`'s fit.

The best cut to make is the one that is best once repaired, and a contiguous block that hurts more
than a scattered set before repair can hurt less after it (one patch stands in for the whole block).
Fitting is cheap: every run's statistics come from one hooked pass of the unpruned model, shared by all
candidates (a run that several candidates contain is captured and fitted once), and each candidate is
then measured with its runs' tensors swapped in for the duration of the measurement.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import contextmanager

import torch

from prunetool.architecture import decoder_of
from prunetool.repair.capture import capture_runs
from prunetool.repair.fit import fit_runs
from prunetool.repair.sites import plan_sites


@contextmanager
def tensors_replaced(model, tensors: dict[str, torch.Tensor]):
    """Decoder-relative parameters set to `tensors` inside the block, restored bit for bit on exit."""
    decoder = decoder_of(model)
    saved = {}
    try:
        with torch.no_grad():
            for name, value in tensors.items():
                parameter = decoder.get_parameter(name)
                saved[name] = parameter.detach().clone()
                parameter.copy_(value.to(parameter.dtype))
        yield
    finally:
        with torch.no_grad():
            for name, value in saved.items():
                decoder.get_parameter(name).copy_(value)


def patched_perplexities(model, cuts: Iterable[Sequence[int]], fit_windows: torch.Tensor, judge_windows: torch.Tensor,
                         objective: str, *, batch_size: int = 1) -> dict[tuple[int, ...], float]:
    """{cut: perplexity of `judge_windows` with the cut removed and its patch (fitted on `fit_windows`) folded in}."""
    from prunetool.perplexity import cut_perplexity
    from prunetool.repair.sites import streamed_sites
    from prunetool.streaming import StreamedModel

    streamed = model if isinstance(model, StreamedModel) else None
    if streamed is not None:
        sites_of = {tuple(sorted(cut)): streamed_sites(streamed.model, sorted(cut)) for cut in cuts}
    else:
        sites_of = {tuple(sorted(cut)): plan_sites(model, sorted(cut)) for cut in cuts}
    sites = {(site.first, site.last): site for cut_sites in sites_of.values() for site in cut_sites}
    data = capture_runs(model, fit_windows, list(sites.values()), objective, batch_size=batch_size)
    fitted = {(patch_data.site.first, patch_data.site.last): patch
              for patch_data, patch in zip(data, fit_runs(model, data, objective))}
    out = {}
    for cut, cut_sites in sites_of.items():
        tensors = {}
        for site in cut_sites:
            tensors |= fitted[(site.first, site.last)].tensors
        replaced = (streamed.tensors_replaced({name: value.to(streamed.model.dtype) for name, value in tensors.items()})
                    if streamed is not None else tensors_replaced(model, tensors))
        with replaced:
            out[cut] = cut_perplexity(model, judge_windows, removed=cut, batch_size=batch_size)
    return out
