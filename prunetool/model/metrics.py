"""Pure layer and head metrics. Shapes in comments: B windows, H heads, T tokens, D head dim, d model dim.

Every function here reduces as it goes so that capture hooks never keep a T x T matrix or a layer's
hidden states: the hooks call these on one batch and keep only the small results.
"""

import math

import torch
import torch.nn.functional as F


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """Unit vectors along the last axis in float32 (a zero vector stays zero rather than NaN)."""
    return F.normalize(x.float(), dim=-1)


def mean_pairwise_cosine(x: torch.Tensor) -> torch.Tensor:
    """Mean cosine over all ordered pairs of distinct rows: TAPPA's query self-similarity.

    x: (..., T, D) -> (...). Uses sum_{i != j} u_i.u_j = ||sum_i u_i||^2 - sum_i ||u_i||^2, so the cost is
    O(T*D) instead of the O(T^2*D) Gram matrix; the subtracted term is T unless a row is exactly zero.
    """
    t = x.shape[-2]
    if t < 2:
        raise ValueError("query self-similarity needs at least 2 tokens per window")
    u = unit_rows(x)
    total = u.sum(dim=-2, dtype=torch.float64)  # (..., D)
    diagonal = u.pow(2).sum(dim=(-2, -1), dtype=torch.float64)  # (...), == T for non-zero rows
    return (total.pow(2).sum(-1) - diagonal) / (t * (t - 1))


def mean_consecutive_cosine(x: torch.Tensor) -> torch.Tensor:
    """Mean cosine between rows t and t+1 (lag-1 self-similarity). x: (..., T, D) -> (...)."""
    u = unit_rows(x)
    return (u[..., 1:, :] * u[..., :-1, :]).sum(-1, dtype=torch.float64).mean(-1)


def block_influence_per_window(layer_in: torch.Tensor, layer_out: torch.Tensor) -> torch.Tensor:
    """ShortGPT's Block Influence, 1 - cos(input, output) averaged over tokens. (B, T, d) x2 -> (B,)."""
    cos = (unit_rows(layer_in) * unit_rows(layer_out)).sum(-1, dtype=torch.float64)  # (B, T)
    return (1.0 - cos).mean(-1)


def angular_distance_per_window(start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """Gromov et al.'s angular distance (1/pi) arccos(cos) between two states. (B, d) x2 -> (B,)."""
    cos = (unit_rows(start) * unit_rows(end)).sum(-1, dtype=torch.float64).clamp(-1.0, 1.0)
    return torch.arccos(cos) / math.pi


def angular_distance_matrix(states: torch.Tensor) -> torch.Tensor:
    """Gromov et al.'s angular distance (1/pi) arccos(cos) between every pair of layer inputs.

    states: (W, L+1, d), the last token's input to each layer (index L is the last layer's output)
    -> (L+1, L+1), mean over windows, symmetric with an exact zero diagonal.
    """
    u = F.normalize(states.double(), dim=-1)
    cos = (u @ u.transpose(-1, -2)).clamp(-1.0, 1.0)  # (W, L+1, L+1)
    dist = torch.arccos(cos).mean(0) / math.pi
    dist.fill_diagonal_(0.0)
    return (dist + dist.T) / 2


def minmax(values: torch.Tensor) -> torch.Tensor:
    """Scale to [0, 1]; a constant vector maps to zeros (nothing to tell apart)."""
    lo, hi = values.min(), values.max()
    if hi - lo <= 0:
        return torch.zeros_like(values)
    return (values - lo) / (hi - lo)


def rank01(values: torch.Tensor) -> torch.Tensor:
    """Ranks scaled to [0, 1] (0 = smallest; ties share their mean rank).

    Unlike min-max, one extreme value (the first and last layers' large Block Influence) cannot squash
    every other layer into a narrow band, so a second signal added to it keeps its say.
    """
    n = values.numel()
    if n < 2:
        return torch.zeros_like(values, dtype=torch.float64)
    ranks = torch.empty(n, dtype=torch.float64)
    ordered = sorted(range(n), key=lambda i: values[i].item())
    start = 0
    while start < n:
        end = start
        while end + 1 < n and values[ordered[end + 1]].item() == values[ordered[start]].item():
            end += 1
        for position in range(start, end + 1):
            ranks[ordered[position]] = (start + end) / 2
        start = end + 1
    return ranks / (n - 1)


def pearson(x: list[float], y: list[float]) -> float | None:
    """Pearson correlation; None when either side is constant or there are fewer than 3 points."""
    a, b = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    if a.numel() < 3:
        return None
    a, b = a - a.mean(), b - b.mean()
    denominator = a.norm() * b.norm()
    return None if denominator <= 0 else (a @ b / denominator).item()


def spearman(x: list[float], y: list[float]) -> float | None:
    """Rank correlation (ties share their mean rank)."""
    return pearson(rank01(torch.tensor(x)).tolist(), rank01(torch.tensor(y)).tolist())
