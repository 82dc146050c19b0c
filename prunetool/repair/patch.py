"""The maths of `prune --patch`: fit a linear map that stands in for a removed block, and fold it.

Row-vector convention throughout: tokens are rows. For a contiguous run of removed layers [a, b]:
- Y is the residual stream after layer a-1's attention, M the MLP output that layer adds to it (so
  layer a-1's output is Y + M), and L the residual stream the unpruned model hands to layer b+1 (or to
  the final norm when b is the last layer);
- the patch is T (d x d) with M T ~ L - Y: the kept layer's output Y + M T then approximates what the
  removed block would have produced;
- since M = H W^T (+ bias) with H the MLP's hidden activations and W = down_proj.weight [d, ff],
  M T = H (T^T W)^T (+ bias T): down_proj absorbs T exactly as W' = T^T W, b' = b T.

Least squares needs only X^T X, X^T R and ||R||^2 (X the features, R = L - Y the target), summed over
tokens in float64 (`PatchStats`): activations are never stored. The same statistics with X = H (ff
features) fit the whole down_proj directly (`solve_patch` on H gives W'^T), and with X = the input of
layer 0 and R = L they fit the map folded into the embedding matrix (E' = E T).

The cosine objective and the fit through a norm after the MLP (Gemma 2/3) are not quadratic and run
full-batch L-BFGS on a bounded number of cached tokens (float32 on CPU).

The whole-down_proj fit solves an ff x ff system, which overfits a few thousand tokens; its ridge is
chosen by `select_ridge` on calibration windows held back from the fit (every VALIDATE_EVERY-th window;
never the prune's held-out windows) and the final solve then uses every calibration window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

# Ridge added to X^T X before solving: RIDGE times the mean of its diagonal (scale-free), so a feature
# direction the calibration tokens never excite gets T ~ 0 there instead of noise; 1e-8 relative moves
# an exactly linear fit by ~1e-8 (the hand-set test checks 1e-6).
RIDGE = 1e-8
FIT_STEPS = 60  # L-BFGS iterations for the cosine refinement and the fit through a norm
# Tokens cached (float32, CPU) for the objectives that need activations: cosine on the 8192 it cached first
# overfitted (SmolLM2, 64k-token lstsq start 70.68 -> 75.05 held-out perplexity), on 32768 it helps (70.25).
CACHE_TOKENS = 32768
# Ridge candidates for the whole-down_proj fit (same relative scale as RIDGE) and which calibration windows
# judge them: window k with k % VALIDATE_EVERY == VALIDATE_EVERY - 1. Measured on SmolLM2-135M without layers
# 13-18 (bench/repair.py): the chosen ridge was 0.1 at 8k-64k C4 tokens, and 1e-8 loses 2-4 points of the gap.
RIDGES = (1e-8, 1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)
VALIDATE_EVERY = 8


@dataclass
class PatchStats:
    """Running X^T X, X^T R, ||R||^2 and the token count, in float64."""

    xtx: torch.Tensor
    xtr: torch.Tensor
    rtr: float = 0.0
    tokens: int = 0

    @classmethod
    def empty(cls, features: int, width: int) -> "PatchStats":
        return cls(torch.zeros(features, features, dtype=torch.float64),
                   torch.zeros(features, width, dtype=torch.float64))

    def add(self, x: torch.Tensor, r: torch.Tensor) -> None:
        """Add tokens: x (..., features) and r (..., width), any float dtype and device."""
        x = x.reshape(-1, x.shape[-1]).to("cpu", torch.float64)
        r = r.reshape(-1, r.shape[-1]).to("cpu", torch.float64)
        if x.shape[0] != r.shape[0]:
            raise ValueError(f"features for {x.shape[0]} tokens but targets for {r.shape[0]}")
        self.xtx += x.T @ x
        self.xtr += x.T @ r
        self.rtr += float((r * r).sum())
        self.tokens += x.shape[0]

    def merged(self, other: "PatchStats | None") -> "PatchStats":
        """The statistics of both token sets together."""
        if other is None or other.tokens == 0:
            return self
        return PatchStats(self.xtx + other.xtx, self.xtr + other.xtr, self.rtr + other.rtr, self.tokens + other.tokens)


def solve_patch(stats: PatchStats, ridge: float = RIDGE) -> torch.Tensor:
    """argmin_T ||X T - R||_F^2 + lambda ||T||_F^2 with lambda = ridge * mean(diag X^T X); float64."""
    if stats.tokens == 0:
        raise ValueError("no calibration tokens reached the patch statistics")
    xtx = stats.xtx
    lam = ridge * float(xtx.diagonal().mean()) or ridge
    eye = torch.eye(xtx.shape[0], dtype=xtx.dtype)
    return torch.linalg.solve(xtx + lam * eye, stats.xtr)


def select_ridge(fit: PatchStats, held: PatchStats | None, ridges=RIDGES) -> tuple[float, dict | None]:
    """The ridge (relative, as in solve_patch) whose solution on `fit` has the least error on `held`.

    Returns (ridge, {ridge: relative error on held}); with no held tokens, (RIDGE, None).
    """
    if held is None or held.tokens == 0 or held.rtr <= 0:
        return RIDGE, None
    errors = {ridge: relative_error(held, solve_patch(fit, ridge)) for ridge in ridges}
    return min(errors, key=lambda ridge: (errors[ridge], ridge)), errors


def squared_error(stats: PatchStats, t: torch.Tensor) -> float:
    """||X T - R||_F^2 from the statistics alone: tr(T^T XtX T) - 2 tr(T^T XtR) + ||R||^2."""
    t = t.to(torch.float64)
    value = float((t * (stats.xtx @ t)).sum() - 2 * (t * stats.xtr).sum()) + stats.rtr
    return max(value, 0.0)


def relative_error(stats: PatchStats, t: torch.Tensor) -> float:
    """||X T - R|| / ||R||: 0 is a perfect stand-in for the removed block."""
    return math.sqrt(squared_error(stats, t) / stats.rtr) if stats.rtr > 0 else 0.0


def identity_error(stats: PatchStats) -> float:
    """The relative error of the plain cut (T = I): the kept layer's output is left as it was."""
    return relative_error(stats, torch.eye(stats.xtx.shape[0], dtype=torch.float64))


def fold_down_proj(weight: torch.Tensor, t: torch.Tensor, bias: torch.Tensor | None = None):
    """down_proj after the patch: W' = T^T W (W is [d, ff]) and b' = b T; float64 results."""
    t = t.to(torch.float64)
    new_weight = t.T @ weight.to(torch.float64)
    new_bias = None if bias is None else bias.to(torch.float64) @ t
    return new_weight, new_bias


def fold_embedding(embedding: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Token embeddings after a patch of a run starting at layer 0: E' = E T (rows are tokens); float64."""
    return embedding.to(torch.float64) @ t.to(torch.float64)


def cosine_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of 1 - cos(pred, target)."""
    return (1 - nn.functional.cosine_similarity(pred, target, dim=-1, eps=1e-8)).mean()


def _lbfgs(parameter: torch.Tensor, loss_fn, steps: int) -> tuple[torch.Tensor, float, float]:
    """Full-batch L-BFGS from `parameter`; returns (best parameter seen, its loss, the starting loss)."""
    parameter = parameter.detach().contiguous().clone().requires_grad_(True)
    optimizer = torch.optim.LBFGS([parameter], lr=1, max_iter=steps, history_size=20,
                                  line_search_fn="strong_wolfe", tolerance_grad=1e-9, tolerance_change=1e-12)
    with torch.no_grad():
        start = float(loss_fn(parameter))
    best = [start, parameter.detach().clone()]

    def closure():
        optimizer.zero_grad()
        loss = loss_fn(parameter)
        loss.backward()
        value = float(loss.detach())
        if math.isfinite(value) and value < best[0]:
            best[0], best[1] = value, parameter.detach().clone()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return best[1], best[0], start


def refine_cosine(t: torch.Tensor, m: torch.Tensor, y: torch.Tensor, l: torch.Tensor,
                  steps: int = FIT_STEPS) -> tuple[torch.Tensor, float, float]:
    """Minimise mean(1 - cos(Y + M T, L)) over cached tokens from T; returns (T, loss after, loss before).

    Runs in float32 (the cache's dtype); the result never has a higher loss than the start.
    """
    m, y, l = (v.to(torch.float32) for v in (m, y, l))
    best, after, before = _lbfgs(t.to(torch.float32), lambda p: cosine_loss(y + m @ p, l), steps)
    return best.to(torch.float64), after, before


def fit_through_norm(weight: torch.Tensor, h: torch.Tensor, y: torch.Tensor, l: torch.Tensor, norm: nn.Module, *,
                     objective: str, steps: int = FIT_STEPS) -> tuple[torch.Tensor, float, float]:
    """down_proj [d, ff] for a layer whose MLP output passes a norm before the residual add (Gemma 2/3).

    Minimises, over cached tokens, ||norm(H W'^T) - (L - Y)||^2 / ||L - Y||^2 ("lstsq") or
    mean(1 - cos(Y + norm(H W'^T), L)) ("cosine"), starting from the current W. The norm is a
    float32 copy of the layer's own module, held fixed. Returns (W', loss after, loss before).
    """
    norm = _frozen_float_copy(norm)
    h, y, l = (v.to(torch.float32) for v in (h, y, l))
    r = l - y
    scale = float((r * r).sum()) or 1.0
    if objective == "cosine":
        def loss_fn(w):
            return cosine_loss(y + norm(h @ w.T), l)
    else:
        def loss_fn(w):
            return ((norm(h @ w.T) - r) ** 2).sum() / scale
    best, after, before = _lbfgs(weight.to(torch.float32), loss_fn, steps)
    return best.to(torch.float64), after, before


def norm_relative_error(weight: torch.Tensor, h: torch.Tensor, y: torch.Tensor, l: torch.Tensor,
                        norm: nn.Module) -> float:
    """||norm(H W^T) - (L - Y)|| / ||L - Y|| on cached tokens (the through-a-norm counterpart of relative_error)."""
    norm = _frozen_float_copy(norm)
    with torch.no_grad():
        r = l.float() - y.float()
        pred = norm(h.float() @ weight.float().T)
        return math.sqrt(float(((pred - r) ** 2).sum()) / max(float((r * r).sum()), 1e-30))


def _frozen_float_copy(module: nn.Module) -> nn.Module:
    import copy

    module = copy.deepcopy(module).float()
    for parameter in module.parameters():
        parameter.requires_grad_(False)
    return module
