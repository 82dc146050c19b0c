"""Scores -> which layers to remove. Criteria are pure functions of the recorded scores."""

import torch

from prunetool.metrics import minmax

TAPPA_BETA = 0.3  # the value TAPPA used for Llama-3.1-8B


def tappa_importance(block_influence: list[float], q_similarity: list[float], beta: float = TAPPA_BETA) -> list[float]:
    """TAPPA's BI' = minmax(BI) + beta * (1 - minmax(qsim)): low BI' means redundant and predictable."""
    bi, qsim = torch.tensor(block_influence, dtype=torch.float64), torch.tensor(q_similarity, dtype=torch.float64)
    return (minmax(bi) + beta * (1 - minmax(qsim))).tolist()


def lowest(values: list[float], count: int) -> list[int]:
    """Indices of the `count` smallest values (ties broken by the lower index), sorted ascending."""
    order = sorted(range(len(values)), key=lambda index: (values[index], index))
    return sorted(order[:count])


def default_drop_count(num_layers: int) -> int:
    """A quarter of the layers, ShortGPT's typical cut, as the preview when no count is given."""
    return max(1, num_layers // 4)
