"""Recorded scores -> which layers to remove: the criteria that are pure functions of the scores.

Each maps a SelectionRequest (drop count N, protected layers, the scores) to a Selection: the removed
original 0-based indices plus the per-layer values it ranked, which the --dry-run table shows. Being
pure, they rerun from a scores file in milliseconds. The measured searches live in search.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from prunetool.errors import PrunetoolError
from prunetool.model.metrics import minmax, rank01

if TYPE_CHECKING:
    from prunetool.select.scoring import Scores

TAPPA_BETA = 0.3  # the value TAPPA (Yang et al., arXiv:2601.21709) used for Llama-3.1-8B
GUIDED_BETA = 0.3  # guided: TAPPA's published weight, now on ranks (bench/quality.py: 1.0 did worse on both models)
GUIDED_SHORTLIST = 4  # guided: candidates measured per round
GUIDED_WINDOWS = 4  # guided: calibration windows per perplexity measurement
GUIDED_BLOCKS = 3  # guided: contiguous blocks proposed beside the greedy path
HALVING_SCREEN_TOKENS = 128  # halving: tokens of each measuring window a screening reads
SCREEN_DTYPES = ("auto", "model")  # halving: screen in bfloat16 where native (auto) or in the model's own dtype


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
    screen_tokens: int = HALVING_SCREEN_TOKENS  # halving only: screening windows' length
    screen_dtype: str = "auto"  # halving only: one of SCREEN_DTYPES
    patch_objective: str | None = None  # halving only: judge the proposals after prune --patch's fit
    measured: dict | None = None  # guided and ppl: frozenset(removed) -> perplexity, shared across calls
    unit: str = "block"  # measured criteria: remove whole layers, or only their attention or MLP sublayers

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


# what Block Influence and angular distance are measured across, per unit (select/scoring.py)
INFLUENCE_COLUMNS = {"block": "block_influence", "attention": "attention_influence", "mlp": "mlp_influence"}


def column(req: SelectionRequest, metric: str) -> list[float]:
    missing = [layer["index"] for layer in req.scores.layers if metric not in layer]
    if missing:
        raise PrunetoolError(f"the scores hold no {metric} for layers {missing}: it is measured only in plain "
                             "pre-norm layers (no sandwich norms); score again if the file predates it")
    values = req.scores.column(metric)
    if len(values) != req.num_layers:
        raise PrunetoolError(f"the scores hold {len(values)} {metric} values for a {req.num_layers}-layer model; score again")
    return values


def select_qsim(req: SelectionRequest) -> Selection:
    """Highest query self-similarity first: the layers whose queries are most predictable (TAPPA's signal)."""
    values = column(req, "q_similarity")
    return Selection(tuple(lowest([-v for v in values], req.count, req.candidates)), values)


def select_tappa(req: SelectionRequest) -> Selection:
    """TAPPA (Yang et al., arXiv:2601.21709): lowest BI' = minmax(BI) + beta * (1 - minmax(qsim)) first.

    Min-max runs over all layers (protected ones included) so the shown values do not depend on protection.
    With --unit attention, BI is measured across the attention sublayer.
    """
    values = tappa_importance(column(req, INFLUENCE_COLUMNS[req.unit]), column(req, "q_similarity"), req.beta)
    return Selection(tuple(lowest(values, req.count, req.candidates)), values)


def select_bi(req: SelectionRequest) -> Selection:
    """ShortGPT (Men et al., arXiv:2403.03853): lowest Block Influence, 1 - cos(layer in, layer out), first.

    With a sublayer unit, 1 - cos across that sublayer (FinerCut's and LLM-Drop's similarity signal)."""
    values = column(req, INFLUENCE_COLUMNS[req.unit])
    return Selection(tuple(lowest(values, req.count, req.candidates)), values)


def select_angular(req: SelectionRequest) -> Selection:
    """Gromov et al. (arXiv:2403.17887): the block [l, l+N) whose input and output are closest in angle.

    angular_distance[l][l+N] compares the input of layer l with the input of layer l+N (index L is the
    final output). The block never includes the final layer (l+N <= L-1), as in the paper; ties go to
    the smaller l. Values: d(l, l+N) per possible start l, None where no block may start.
    With a sublayer unit: the N sublayers with the smallest angular distance across themselves.
    """
    if req.unit != "block":
        values = column(req, f"{req.unit}_angular")
        return Selection(tuple(lowest(values, req.count, req.candidates)), values)
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


def contiguous_blocks(values: list[float], count: int, start: int, end: int, best: int) -> list[tuple[int, ...]]:
    """The `best` blocks [l, l+count) inside [start, end) with the lowest summed values (ties: lower l)."""
    starts = range(start, end - count + 1)
    ranked = sorted(starts, key=lambda l: (sum(values[l:l + count]), l))
    return [tuple(range(l, l + count)) for l in ranked[:best]]
