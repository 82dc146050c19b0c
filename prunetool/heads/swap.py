"""The swap test: does a head's attention stay with a position or follow the content that moved?

Swap the hidden states entering a layer at two blocks of positions (never the query, never the first
token, whose attention-sink role is measured by the re-access score), keep the position ids, rerun
only that layer, and compare the last token's attention over the two blocks before (a) and after (a'):
- positional: a' over (I, J) matches a over (I, J): the head attends by offset or place;
- symbolic: a' over (J, I) matches a over (I, J): the head follows the content it looks for.
Each swap counts in proportion to how differently the head attended the two blocks (swapping two
blocks it treats alike tells nothing). Long windows swap blocks of tokens rather than single tokens,
so that the moved blocks carry enough attention to measure.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

LABEL_MARGIN = 0.25  # positional or symbolic only when one agreement beats the other by this much


def block_size(seq_len: int) -> int:
    return max(1, seq_len // 64)


def candidate_blocks(seq_len: int, block: int) -> torch.Tensor:
    """Starts of whole blocks tiling back from the query: [T-1-b, T-1), [T-1-2b, T-1-b), ... none before token 1.

    Tiling from the query's end keeps the most recent tokens (a previous-token head's target) in a block.
    """
    return torch.arange(seq_len - 1 - block, 0, -block).flip(0)


def choose_swaps(last_row: torch.Tensor, block: int) -> list[tuple[int, int]]:
    """One swap per head: its most attended block with its least attended one (duplicates dropped).

    last_row: (H, T), the last token's attention in the unswapped window.
    """
    starts = candidate_blocks(last_row.shape[-1], block)
    if starts.numel() < 2:
        return []
    mass = torch.stack([last_row[:, s : s + block].sum(-1) for s in starts.tolist()], dim=-1)  # (H, blocks)
    swaps = []
    for head in range(mass.shape[0]):
        pair = (int(starts[mass[head].argmax()]), int(starts[mass[head].argmin()]))
        if pair[0] != pair[1] and pair not in swaps:
            swaps.append(pair)
    return swaps


def swapped_states(hidden: torch.Tensor, swaps: list[tuple[int, int]], block: int) -> torch.Tensor:
    """(1, T, d) -> (S, T, d): one copy per swap with blocks i and j exchanged."""
    batch = hidden.expand(len(swaps), *hidden.shape[1:]).clone()
    for row, (i, j) in enumerate(swaps):
        batch[row, i : i + block], batch[row, j : j + block] = hidden[0, j : j + block], hidden[0, i : i + block]
    return batch


@dataclass
class SwapTally:
    """Weighted sums over swaps, per head."""

    positional: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    symbolic: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    weight: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    swaps: int = 0

    def add(self, before: torch.Tensor, after: torch.Tensor, swaps: list[tuple[int, int]], block: int) -> None:
        """before (H, T), after (S, H, T): the last token's attention without and with each swap."""
        if not self.weight.numel():
            heads = before.shape[0]
            self.positional, self.symbolic, self.weight = (torch.zeros(heads, dtype=torch.float64) for _ in range(3))
        before, after = before.double(), after.double()
        for row, (i, j) in enumerate(swaps):
            a_i, a_j = before[:, i : i + block], before[:, j : j + block]
            b_i, b_j = after[row, :, i : i + block], after[row, :, j : j + block]
            original = torch.cat([a_i, a_j], -1)
            stayed = F.cosine_similarity(original, torch.cat([b_i, b_j], -1), dim=-1)
            followed = F.cosine_similarity(original, torch.cat([b_j, b_i], -1), dim=-1)
            weight = (a_i.sum(-1) - a_j.sum(-1)).abs()
            self.positional += weight * stayed
            self.symbolic += weight * followed
            self.weight += weight
            self.swaps += 1

    def verdicts(self, heads: int) -> list[dict]:
        """Per head: positional and symbolic agreement in [0, 1], and the label they give ("untested" without swaps)."""
        if not self.swaps:
            return [{"positional": None, "symbolic": None, "label": "untested"} for _ in range(heads)]
        result = []
        for pos, sym, weight in zip(self.positional.tolist(), self.symbolic.tolist(), self.weight.tolist()):
            if weight <= 0:
                result.append({"positional": None, "symbolic": None, "label": "untested"})
                continue
            pos, sym = pos / weight, sym / weight
            label = "positional" if pos - sym >= LABEL_MARGIN else "symbolic" if sym - pos >= LABEL_MARGIN else "mixed"
            result.append({"positional": pos, "symbolic": sym, "label": label})
        return result
