"""Attention maps -> the pattern a head follows: re-access, sequential, seasonal or retrieval.

Pure functions. A probe pass reduces every (T x T) attention map of a window to two profiles over the
last `rows` queries (so every analysed row sees the same keys):
- the column profile c[j]: mean attention to key position j (j < T - rows);
- the offset profile m[d]: mean attention to the key d tokens back (0 <= d < T - rows; keys >= 1).
The profiles, averaged over windows, decide the type. Each test measures how much of a query's
attention a structure fixed in advance explains (docs/heads.md gives the reasoning and thresholds):
- re-access: mass on the FIXED_POSITIONS most attended key positions (vertical stripes, the sink);
- sequential: mass on the best diagonal, one offset either side allowed (a diagonal band of width 3);
- seasonal: mass on evenly spaced diagonals beyond the strongest one, after a running median removes
  smooth trends (so a broad local band does not count), with at least MIN_TEETH teeth;
- retrieval: together these explain less than STRUCTURE_THRESHOLD of the attention, so most of it
  jumps with the content. Otherwise the largest of the three names the head (a head split between the
  sink and the previous token is predictable, and named after the larger part).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

STRUCTURE_THRESHOLD = 0.5  # most of the attention must land on places fixed in advance to call a head predictable
FIXED_POSITIONS = 4  # re-access: how many fixed key positions may share the stripe mass
BAND = 1  # sequential and seasonal: offsets either side of a diagonal that still count as on it
MEDIAN_WINDOW = 11  # seasonal: running median width that estimates the smooth background
MIN_PERIOD = 6.0  # seasonal: RoPE's fastest pair (theta = 1) repeats every 2*pi = 6.28 tokens; nothing faster
MIN_TEETH = 3  # seasonal: diagonals that must each carry >= TOOTH_SHARE of the strongest one
TOOTH_SHARE = 0.2
PERIOD_GRID = 4096  # angular frequencies tried between 2*pi/(D/2) and 2*pi/MIN_PERIOD
PATTERNS = ("re-access", "sequential", "seasonal", "retrieval")


def profile_rows(seq_len: int) -> int:
    """How many final queries the profiles average: 64, or a quarter of a short window (at least 2)."""
    return max(2, min(64, seq_len // 4))


def attention_profiles(weights: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., T, T) attention -> column profile (..., T - rows) and offset profile (..., T - rows).

    Row t in [T - rows, T) and offset d in [0, T - rows) address key t - d >= 1, so the first token
    (the usual sink) only ever enters the column profile.
    """
    t = weights.shape[-1]
    last = weights[..., t - rows :, :].float()  # (..., rows, T)
    column = last[..., : t - rows].mean(-2)
    queries = torch.arange(t - rows, t, device=weights.device)[:, None]
    offsets = torch.arange(t - rows, device=weights.device)[None, :]
    index = (queries - offsets).expand(*last.shape[:-1], t - rows)  # key position per (row, offset)
    offset = last.gather(-1, index).mean(-2)
    return column, offset


@dataclass(frozen=True)
class HeadPattern:
    """The verdict for one head and the evidence behind it."""

    kind: str
    re_access: float  # share on the FIXED_POSITIONS strongest key positions
    sequential: float  # share on the best diagonal band
    seasonal: float  # share on evenly spaced diagonals beyond the strongest one
    fixed_positions: tuple[int, ...]  # the key positions the re-access score counts
    offset: int  # centre of the best diagonal (0 = the query itself, 1 = the previous token)
    period: float | None  # measured spacing of the seasonal diagonals, when there are enough of them
    teeth: int  # seasonal diagonals that carry mass

    @property
    def structure(self) -> float:
        return structure_share(self.re_access, self.sequential, self.seasonal)

    def to_json(self) -> dict:
        return {"type": self.kind, "structure": self.structure, "re_access": self.re_access, "sequential": self.sequential,
                "seasonal": self.seasonal, "fixed_positions": list(self.fixed_positions),
                "offset": self.offset, "period": self.period, "teeth": self.teeth}


def re_access_score(column: torch.Tensor) -> tuple[float, tuple[int, ...]]:
    top = torch.topk(column.double(), min(FIXED_POSITIONS, column.numel()))
    return top.values.sum().item(), tuple(sorted(top.indices.tolist()))


def band_sums(offset: torch.Tensor) -> torch.Tensor:
    """Mass within BAND offsets of every centre offset."""
    padded = F.pad(offset.double()[None, None], (BAND, BAND))
    return F.conv1d(padded, torch.ones(1, 1, 2 * BAND + 1, dtype=torch.float64))[0, 0]


def sequential_score(offset: torch.Tensor) -> tuple[float, int]:
    sums = band_sums(offset)
    best = int(sums.argmax())
    return sums[best].item(), best


def running_median(values: torch.Tensor, width: int = MEDIAN_WINDOW) -> torch.Tensor:
    half = width // 2
    padded = F.pad(values.double()[None, None], (half, half), mode="replicate")[0, 0]
    return padded.unfold(0, width, 1).median(-1).values


def _comb(residual: torch.Tensor, sums: torch.Tensor, period: float, start: float) -> tuple[float, int]:
    """(mass beyond the strongest tooth, teeth carrying >= TOOTH_SHARE of it) for teeth at start + k * period."""
    d = sums.numel()
    centres = torch.arange(start, d - 0.5, period, dtype=torch.float64).round().long().clamp(max=d - 1)
    # what each tooth holds beyond the same width of the profile between the teeth: a comb laid on a
    # flat or noisy profile then scores about zero, however many offsets its teeth cover
    covered = torch.zeros(d, dtype=torch.bool)
    for shift in range(-BAND, BAND + 1):
        covered[(centres + shift).clamp(0, d - 1)] = True
    if covered.all():
        return 0.0, 0
    teeth = sums[centres] - (2 * BAND + 1) * residual[~covered].mean()
    if teeth.numel() == 0 or teeth.max() <= 0:
        return 0.0, 0
    carrying = int((teeth >= TOOTH_SHARE * teeth.max()).sum())
    return max(0.0, (teeth.sum() - teeth.max()).item()), carrying


def seasonal_score(offset: torch.Tensor, candidates: int = 8) -> tuple[float, float | None, int]:
    """(share beyond the strongest diagonal, measured period, teeth) of the best comb of diagonals.

    Candidate periods are the strongest peaks of the de-trended profile's Fourier magnitude, so a
    period need not be a whole number of tokens (RoPE's are not); each candidate's teeth are read back
    from the profile, and a comb needs MIN_TEETH teeth with mass. A comb also fits at its harmonics
    (P/2, P/3 ...) with the same mass; near-ties go to the longest period.
    """
    d = offset.numel()
    if d < 2 * MIN_PERIOD + 1:
        return 0.0, None, 0
    residual = (offset.double() - running_median(offset)).clamp(min=0.0)
    positions = torch.arange(d, dtype=torch.float64)
    omegas = torch.linspace(2 * math.pi / (d / 2), 2 * math.pi / MIN_PERIOD, PERIOD_GRID, dtype=torch.float64)
    phase = omegas[:, None] * positions[None, :]
    real, imag = torch.cos(phase) @ residual, torch.sin(phase) @ residual
    magnitude = torch.sqrt(real**2 + imag**2)
    peaks = (magnitude[1:-1] >= magnitude[:-2]) & (magnitude[1:-1] >= magnitude[2:])
    peak_index = torch.nonzero(peaks).flatten() + 1
    peak_index = peak_index[magnitude[peak_index].argsort(descending=True)[:candidates]]
    sums = band_sums(residual)
    best = (0.0, None, 0)
    for index in peak_index.tolist():
        omega = omegas[index].item()
        period = 2 * math.pi / omega
        start = (math.atan2(imag[index].item(), real[index].item()) / omega) % period  # first tooth
        score, teeth = _comb(residual, sums, period, start)
        if teeth < MIN_TEETH:
            continue
        if score > best[0] * 1.01 or (score >= best[0] * 0.99 and best[1] is not None and period > best[1]):
            best = (score, period, teeth)
    return best


def structure_share(re_access: float, sequential: float, seasonal: float) -> float:
    """Share of attention on fixed places: stripes, the best diagonal, the comb's other diagonals.

    The three parts are (nearly) disjoint: the stripes are key positions at least `rows` tokens back from
    some analysed query, and the comb's score leaves out its strongest diagonal.
    """
    return min(1.0, re_access + sequential + seasonal)


def name_pattern(re_access: float, sequential: float, seasonal: float,
                 threshold: float = STRUCTURE_THRESHOLD) -> str:
    """retrieval if the three structures together explain less than `threshold`, else the largest (ties: this order)."""
    if structure_share(re_access, sequential, seasonal) < threshold:
        return "retrieval"
    scores = {"re-access": re_access, "sequential": sequential, "seasonal": seasonal}
    return max(scores, key=scores.get)


def classify(column: torch.Tensor, offset: torch.Tensor) -> HeadPattern:
    """Name a head's pattern from its window-averaged profiles."""
    re_access, positions = re_access_score(column)
    sequential, best_offset = sequential_score(offset)
    seasonal, period, teeth = seasonal_score(offset)
    kind = name_pattern(re_access, sequential, seasonal)
    return HeadPattern(kind, re_access, sequential, seasonal, positions, best_offset, period, teeth)
