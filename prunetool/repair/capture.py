"""One calibration pass of the unpruned model that gathers what every run's patch fit needs.

Per run [a, b] (see sites.py), forward hooks take:
- X, the features the map multiplies: layer a-1's MLP output M (the map T), the input of down_proj H
  (the whole-down_proj fit), or the input of layer 0 (a run that starts there);
- Y, layer a-1's residual after attention, as the layer's output minus what its MLP branch added;
- L, the input of layer b+1 (or of the final norm when b is the last layer), from a pre-hook.
Least-squares objectives add each batch to float64 statistics (PatchStats) and drop it; the cosine
objective and the fit through a norm also keep up to `cache_tokens` tokens of X, Y, L in float32 on
CPU. The forward stops after the deepest target is reached: later layers and the head never run.
The whole-down_proj fit sends every VALIDATE_EVERY-th window to separate statistics (`held`) that choose
its ridge (patch.select_ridge); the split is by window index, so it does not depend on the batch size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prunetool.model.architecture import decoder_of
from prunetool.model.capture import _hidden_from, _output_tensor
from prunetool.repair.patch import CACHE_TOKENS, VALIDATE_EVERY, PatchStats
from prunetool.repair.sites import PatchSite, post_mlp_norm
from prunetool.model.loading import input_device


class _Reached(Exception):
    """Raised by the deepest target hook: the rest of the forward is not needed."""


@dataclass
class RunData:
    """What the calibration pass gathered for one run."""

    site: PatchSite
    features: str  # "mlp_output" | "down_proj_input" | "layer0_input" | "none"
    stats: PatchStats | None = None
    held: PatchStats | None = None  # windows that choose the ridge (whole-down_proj fit only)
    cache: dict = field(default_factory=lambda: {"x": [], "y": [], "l": []})
    cached: int = 0
    tokens: int = 0

    def cached_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(torch.cat(self.cache[key]) for key in ("x", "y", "l"))


def features_for(site: PatchSite, objective: str) -> str:
    if site.kind == "embedding":
        return "layer0_input"
    if site.kind == "norm" or (site.kind == "down_proj" and objective == "down_proj"):
        return "down_proj_input"
    return "mlp_output" if site.kind == "down_proj" else "none"


def needs_cache(site: PatchSite, objective: str) -> bool:
    return site.kind == "norm" or (objective == "cosine" and site.kind in ("down_proj", "embedding"))


def needs_stats(site: PatchSite) -> bool:
    return site.kind in ("down_proj", "embedding")


def selects_ridge(site: PatchSite, objective: str) -> bool:
    return site.kind == "down_proj" and objective == "down_proj"


def capture_runs(model, windows: torch.Tensor, sites: list[PatchSite], objective: str, *,
                 cache_tokens: int = CACHE_TOKENS, batch_size: int = 1, on_batch=None) -> list[RunData]:
    """Run the unpruned `model` over `windows` (W, T) once; returns one RunData per site (skips included).

    `model` may be any ModelRunner: a layer-streamed one's hooks see each layer while it is loaded."""
    from prunetool.model.runner import as_runner

    runner = as_runner(model)
    windows, model = runner.input_rows(windows), runner.model
    decoder = decoder_of(model)
    layers = decoder.layers
    width = model.config.get_text_config(decoder=True).hidden_size
    data = [RunData(site, features_for(site, objective)) for site in sites]
    active = [run for run in data if run.site.kind != "skip"]
    if not active:
        return data
    handles = []
    pending: dict[int, dict] = {}
    position = {"start": 0}  # index of the batch's first window
    windows_in_batch = [1]
    deepest = max(len(layers) if run.site.final else run.site.last + 1 for run in active)

    def store(run: RunData, key: str):
        def hook(_module, args, kwargs, output=None):
            value = _hidden_from(args, kwargs) if output is None else _output_tensor(output)
            pending.setdefault(id(run), {})[key] = value
        return hook

    def finish(run: RunData, stop: bool):
        def hook(_module, args, kwargs):
            got = pending.pop(id(run), {})
            target = _hidden_from(args, kwargs).to("cpu", torch.float64)
            width_l = target.shape[-1]
            target = target.reshape(-1, width_l)
            if run.site.kind == "embedding":
                x = got["x"].to("cpu", torch.float64).reshape(-1, width_l)
                y = torch.zeros_like(target)
            else:
                added = got["added"].to("cpu", torch.float64).reshape(-1, width_l)
                y = got["out"].to("cpu", torch.float64).reshape(-1, width_l) - added
                x = added if run.features == "mlp_output" else got["h"].to("cpu", torch.float64)
                x = x.reshape(-1, x.shape[-1])
            residual = target - y
            if run.stats is not None:
                bias = None
                if run.features == "down_proj_input":
                    bias = layers[run.site.layer].mlp.down_proj.bias
                residual = residual if bias is None else residual - bias.detach().to("cpu", torch.float64)
                if run.held is None:
                    run.stats.add(x, residual)
                else:
                    per_window = x.shape[0] // windows_in_batch[0]
                    for k in range(windows_in_batch[0]):
                        part = slice(k * per_window, (k + 1) * per_window)
                        held = (position["start"] + k) % VALIDATE_EVERY == VALIDATE_EVERY - 1
                        (run.held if held else run.stats).add(x[part], residual[part])
            if needs_cache(run.site, objective) and run.cached < cache_tokens:
                take = min(cache_tokens - run.cached, x.shape[0])
                for key, value in (("x", x), ("y", y), ("l", target)):
                    run.cache[key].append(value[:take].to(torch.float32))
                run.cached += take
            run.tokens += x.shape[0]
            if stop:
                raise _Reached
        return hook

    try:
        for run in active:
            site = run.site
            if needs_stats(site):
                features = (layers[site.layer].mlp.down_proj.in_features if run.features == "down_proj_input"
                            else width)
                run.stats = PatchStats.empty(features, width)
                if selects_ridge(site, objective):
                    run.held = PatchStats.empty(features, width)
            stop = (len(layers) if site.final else site.last + 1) == deepest
            if site.kind == "embedding":
                handles.append(layers[0].register_forward_pre_hook(store(run, "x"), with_kwargs=True))
            else:
                layer = layers[site.layer]
                added = post_mlp_norm(layer) if site.kind == "norm" else layer.mlp
                handles.append(added.register_forward_hook(store(run, "added"), with_kwargs=True))
                handles.append(layer.register_forward_hook(store(run, "out"), with_kwargs=True))
                if run.features == "down_proj_input":
                    handles.append(layer.mlp.down_proj.register_forward_pre_hook(store(run, "h"), with_kwargs=True))
            target = decoder.norm if site.final else layers[site.last + 1]
            handles.append(target.register_forward_pre_hook(finish(run, stop), with_kwargs=True))
        device = input_device(model)
        # no_grad, not inference_mode: the cached tensors later enter autograd (the cosine and norm fits)
        with torch.no_grad():
            for start in range(0, windows.shape[0], batch_size):
                batch = windows[start:start + batch_size].to(device=device, dtype=torch.long)
                position["start"], windows_in_batch[0] = start, int(batch.shape[0])
                try:
                    decoder(input_ids=batch, use_cache=False)
                except _Reached:
                    pass
                pending.clear()
                if on_batch is not None:
                    on_batch(int(batch.shape[0]))
    finally:
        for handle in handles:
            handle.remove()
    return data
