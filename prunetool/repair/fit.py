"""Per run: solve the patch from what the calibration pass gathered and give the new tensors.

Objectives (`prune --patch-objective`):
- "lstsq": T = argmin ||M T - (L - Y)||, folded into down_proj (W' = T^T W), ReplaceMe's LS variant;
- "cosine": the lstsq T refined by L-BFGS on mean(1 - cos(Y + M T, L)) over cached tokens;
- "down_proj": the whole down_proj refitted by ridge least squares, W' = argmin ||H W'^T - (L - Y)||^2 +
  lambda ||W'||^2 with H the MLP's hidden activations (ff x ff normal equations): still a plain down_proj,
  but ff x d free numbers instead of d x d. lambda is chosen on every 8th calibration window
  (patch.select_ridge), then the solve uses all of them.
A run that starts at layer 0 always uses the map T (lstsq, or cosine-refined) on the embeddings; a run
after a layer with a post-MLP norm fits down_proj through the norm (squared error, or cosine).
Results are float64 tensors keyed by decoder-relative name; the caller casts them to the checkpoint's dtype.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from prunetool.model.architecture import decoder_of
from prunetool.repair.capture import RunData
from prunetool.repair.patch import (cosine_loss, fit_through_norm, fold_down_proj, fold_embedding, identity_error,
                                    norm_relative_error, refine_cosine, relative_error, select_ridge, solve_patch)
from prunetool.repair.sites import norm_name, post_mlp_norm

OBJECTIVES = ("lstsq", "cosine", "down_proj")
# Default by measurement (bench/repair.py, bench/results/repair.json; SmolLM2-135M without layers 13-18,
# C4 calibration, WikiText-2 16 x 512, plain cut 84.56): with 8k tokens the map T did best (cosine 75.02,
# 13.8% of the log-perplexity gap; down_proj 77.38 at ridge 1e-8), but every objective gains from tokens
# and the whole down_proj gains most once its ridge is chosen on held-back windows: at 64k tokens lstsq T
# 70.68 (20.6%), cosine T 70.25 (21.3%, 32k cached), down_proj 65.45 (29.5%). So the default is down_proj,
# fitted on DEFAULT_PATCH_TOKENS of calibration (prune --patch-windows): more saturates (128k tokens 64.81,
# 30.6%; 256k 64.86, 30.5%; bench/results/repair_tokens.json) at 2-4x the calibration pass.
DEFAULT_OBJECTIVE = "down_proj"
DEFAULT_PATCH_TOKENS = 65536


@dataclass
class RunPatch:
    """One run's outcome: new tensors (decoder-relative name -> float64) and what to record."""

    tensors: dict
    record: dict


def _cosine_pair(run: RunData, before_t: torch.Tensor | None, after_t: torch.Tensor) -> dict:
    x, y, l = run.cached_tensors()
    with torch.no_grad():
        before = x if before_t is None else x @ before_t.float()
        return {"before": float(cosine_loss(y + before, l)), "after": float(cosine_loss(y + x @ after_t.float(), l))}


def fit_run(model, run: RunData, objective: str) -> RunPatch:
    site = run.site
    record = {"layers": site.layers, "kind": site.kind, "tokens": run.tokens}
    if site.kind == "skip":
        return RunPatch({}, record | {"action": f"not patched: {site.reason}", "tensors": []})
    decoder = decoder_of(model)
    if site.kind == "embedding":
        t = solve_patch(run.stats)
        method = "lstsq"
        extra = {}
        if objective == "cosine":
            lstsq_t = t
            t, _, _ = refine_cosine(t, *run.cached_tensors())
            method = "cosine"
            extra = {"cosine_loss": _cosine_pair(run, None, t), "cached_tokens": run.cached,
                     "lstsq_residual_error": relative_error(run.stats, lstsq_t)}
        name = site.tensors[0]
        new = fold_embedding(decoder.get_parameter(name).detach().to("cpu"), t)
        errors = {"before": identity_error(run.stats), "after": relative_error(run.stats, t)}
        return RunPatch({name: new}, record | {"action": f"folded into {name}", "method": method,
                                                "tensors": [name], "residual_error": errors, **extra})
    layer = decoder.layers[site.layer]
    down = layer.mlp.down_proj
    weight = down.weight.detach().to("cpu")  # the statistics live on the CPU; so does every fit
    if site.kind == "norm":
        h, y, l = run.cached_tensors()
        norm = copy.deepcopy(post_mlp_norm(layer)).to("cpu")
        how = "cosine" if objective == "cosine" else "lstsq"
        new_weight, _, _ = fit_through_norm(weight, h, y, l, norm, objective=how)
        errors = {"before": norm_relative_error(weight, h, y, l, norm),
                  "after": norm_relative_error(new_weight, h, y, l, norm)}
        name = site.tensors[0]
        return RunPatch({name: new_weight}, record | {
            "action": f"fitted through {norm_name(layer)} into {name.removesuffix('.weight')}", "method": how,
            "tensors": [name], "residual_error": errors, "cached_tokens": run.cached})
    extra = {}
    if objective == "down_proj":
        ridge, held_errors = select_ridge(run.stats, run.held)
        stats = run.stats.merged(run.held)
        solution = solve_patch(stats, ridge)  # [ff, d] = W'^T
        errors = {"before": relative_error(stats, weight.to(torch.float64).T),
                  "after": relative_error(stats, solution)}
        tensors = {site.tensors[0]: solution.T.contiguous()}
        extra = {"ridge": ridge, "ridge_chosen_on": (
            f"{run.held.tokens} tokens of every 8th calibration window, fitted on the other {run.stats.tokens}"
            if held_errors else "no held-back window (fewer than 8 calibration windows): the default ridge"),
            **({"held_back_error_by_ridge": {f"{r:g}": e for r, e in held_errors.items()}} if held_errors else {})}
    else:
        t = solve_patch(run.stats)
        if objective == "cosine":
            lstsq_t = t
            t, _, _ = refine_cosine(t, *run.cached_tensors())
            extra = {"cosine_loss": _cosine_pair(run, None, t), "cached_tokens": run.cached,
                     "lstsq_residual_error": relative_error(run.stats, lstsq_t)}
        errors = {"before": identity_error(run.stats), "after": relative_error(run.stats, t)}
        new_weight, new_bias = fold_down_proj(weight, t, None if down.bias is None else down.bias.detach().to("cpu"))
        tensors = {site.tensors[0]: new_weight}
        if new_bias is not None:
            tensors[site.tensors[1]] = new_bias
    target = site.tensors[0].removesuffix(".weight")
    return RunPatch(tensors, record | {"action": f"folded into {target}", "method": objective,
                                       "tensors": list(tensors), "residual_error": errors, **extra})


def fit_runs(model, data: list[RunData], objective: str) -> list[RunPatch]:
    """One RunPatch per run. `model` may be any ModelRunner: a layer-streamed one (prune --low-memory) holds
    an absorbing layer's real weights only while its run is fitted."""
    from prunetool.model.runner import as_runner

    if objective not in OBJECTIVES:
        raise ValueError(f"unknown patch objective {objective!r}; expected one of {OBJECTIVES}")
    runner = as_runner(model)
    patches = []
    for run in data:
        if run.site.kind in ("down_proj", "norm"):
            with runner.layer_loaded(run.site.layer):
                patches.append(fit_run(runner.model, run, objective))
        else:  # skips and embedding folds (planned only where the runner holds the whole table)
            patches.append(fit_run(runner.model, run, objective))
    return patches
