"""Scores and prune plans -> figures (`score --plot FILE.png`, `prune --plot FILE.png`), plus the matplotlib
plumbing the heads report shares.

matplotlib is the optional `[plot]` extra: it is imported only when a figure is drawn, and its absence is one
MissingExtraError line naming the pip command. Figures use matplotlib's object API on the Agg canvas (no
pyplot state, no display) and are written atomically, so an interrupted run never leaves half a picture
under the user's file name. Every layer index is 0-based in the original model, as in the scores and plans.
"""

import math
import os
import secrets
from pathlib import Path

from prunetool.cut import spans as layers_text  # [3, 4, 5, 9] -> "3-5, 9"
from prunetool.errors import MissingExtraError, OptionError

MISSING = "plotting needs matplotlib: pip install 'prunetool[plot]'"
WIDTH, PANEL_HEIGHT, DPI = 10.0, 2.1, 100  # inches, inches per panel, pixels per inch
LOG_SPAN = 20.0  # perplexities spanning more than this factor get a logarithmic axis
REMOVED_COLOUR, CHOSEN_COLOUR, OTHER_COLOUR = "#ee6677", "#cc3311", "#bbbbbb"
# (panel name, y label, curves as (series key, legend label)); a curve without data is left out
SCORE_PANELS = (
    ("block_influence", "block influence", (("block_influence", "1 - cos(layer input, output)"),)),
    ("q_similarity", "q-similarity", (("q_similarity", "pre-RoPE"), ("q_similarity_post_rope", "post-RoPE"))),
    ("angular_distance", "angular distance", (("angular_next", "input of layer l to input of l+1"),)),
)
CRITERION_LABELS = {"guided": "guided importance", "tappa": "TAPPA importance", "qsim": "q-similarity",
                    "bi": "block influence", "angular": "block distance d(l, l+N)",
                    "ppl": "perplexity with only this layer removed (round 1)",
                    "halving": "perplexity with only this layer removed (round-1 screening)"}


def new_figure(**options):
    """A Figure on the Agg canvas; MissingExtraError (one line) when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise MissingExtraError(MISSING) from error
    figure = Figure(**options)
    FigureCanvasAgg(figure)
    return figure


def check_plot_path(path) -> None:
    """Before any slow work: matplotlib is installed, the file type can be drawn, the target is no folder."""
    path = Path(path)
    kind = path.suffix.lstrip(".").lower() or "png"
    if path.is_dir():
        raise OptionError(f"--plot {path} is a folder; give a file name such as scores.png")
    if kind not in new_figure().canvas.get_supported_filetypes():
        raise OptionError(f"cannot draw a .{kind} file; name the plot FILE.png (or .svg, .pdf)")


def save_figure(figure, path) -> Path:
    """Render to a temporary file beside `path`, then rename it into place: readers see the old file or the
    whole new one, and a failed render leaves nothing behind. The format follows the suffix (png by default)."""
    path = Path(path)
    kind = path.suffix.lstrip(".").lower() or "png"
    if kind not in figure.canvas.get_supported_filetypes():
        raise OptionError(f"cannot draw a .{kind} file; name the plot FILE.png (or .svg, .pdf)")
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.part")  # umask applies
    try:
        figure.savefig(temporary, format=kind)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def _number(value) -> float:
    """JSON value -> float; null (a value that was not measured) becomes NaN, a gap in the curve."""
    return math.nan if value is None else float(value)


def score_series(scores: dict) -> dict[str, list[float]]:
    """The scores JSON -> per-layer curves by name; post-RoPE and the angular curve only where recorded.

    angular_next[l] is angular_distance[l][l+1]: layer l's input against layer l+1's (the last layer's
    output for l = L-1), i.e. how far layer l alone turns the residual stream.
    """
    layers = sorted(scores["layers"], key=lambda layer: layer["index"])
    series = {name: [_number(layer.get(name)) for layer in layers]
              for name in ("block_influence", "q_similarity", "q_similarity_post_rope")}
    if all(math.isnan(value) for value in series["q_similarity_post_rope"]):
        del series["q_similarity_post_rope"]
    distance, count = scores.get("angular_distance") or [], len(layers)
    if len(distance) == count + 1 and all(len(row) == count + 1 for row in distance):
        series["angular_next"] = [_number(distance[layer][layer + 1]) for layer in range(count)]
    return series


def candidates(plan: dict) -> list[tuple[str, float, bool]]:
    """A search's measured proposals as (label, perplexity, chosen), in the order they were tried; after
    the patch where the search judged them so (halving with --patch)."""
    removed = sorted(plan["removed"])
    parameters = plan.get("parameters") or {}
    proposals = parameters.get("patched") or parameters.get("proposals") or []
    return [(f"{proposal['kind']}\n{layers_text(proposal['removed'])}",
             _number(proposal.get("patched_perplexity", proposal.get("perplexity"))), sorted(proposal["removed"]) == removed)
            for proposal in proposals]


def _log_if_wide(ax, values) -> None:
    positive = [value for value in values if math.isfinite(value) and value > 0]
    if positive and max(positive) / min(positive) > LOG_SPAN:
        ax.set_yscale("log")


def _mark_removed(ax, removed, legend: bool, label: str = "removed") -> None:
    """One shaded band per removed layer (gid 'removed'); the first panel names them in its legend."""
    for number, layer in enumerate(sorted(removed)):
        ax.axvspan(layer - 0.5, layer + 0.5, color=REMOVED_COLOUR, alpha=0.25, linewidth=0, gid="removed",
                   label=label if legend and number == 0 else "_nolegend_")


def _layer_panel(ax, name: str, ylabel: str, curves: list[tuple[str, list[float]]], removed, first: bool,
                 band_label: str = "removed") -> None:
    """One panel over the layer axis: its curves as dots joined by lines, the removed layers shaded."""
    ax.set_label(name)
    for label, values in curves:
        ax.plot(range(len(values)), values, marker="o", markersize=3, linewidth=1.2, label=label)
    _mark_removed(ax, removed, legend=first, label=band_label)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    if curves and name == "ppl":
        _log_if_wide(ax, curves[0][1])
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8, framealpha=0.8)


def _candidate_panel(ax, entries: list[tuple[str, float, bool]], windows) -> None:
    """One bar per measured proposal, the chosen one highlighted; an infinite (NaN) perplexity shows as ∞."""
    ax.set_label("candidates")
    heights = [value if math.isfinite(value) else math.nan for _, value, _ in entries]
    colours = [CHOSEN_COLOUR if chosen else OTHER_COLOUR for _, _, chosen in entries]
    bars = ax.bar(range(len(entries)), heights, color=colours)
    ax.bar_label(bars, labels=[f"{value:.4g}" if math.isfinite(value) else "" for value in heights], fontsize=8)
    for x, value in enumerate(heights):
        if math.isnan(value):
            ax.text(x, 0.5, "\u221e", transform=ax.get_xaxis_transform(), ha="center", fontsize=12)
    ax.set_xticks(range(len(entries)), [label for label, _, _ in entries], fontsize=8)
    for tick, (_, _, chosen) in zip(ax.get_xticklabels(), entries):
        tick.set_fontweight("bold" if chosen else "normal")
    ax.set_xlim(-0.6, len(entries) - 0.4)
    finite = [value for value in heights if math.isfinite(value)]
    _log_if_wide(ax, finite)
    if finite and ax.get_yscale() == "log":
        ax.set_ylim(min(finite) / 2, max(finite) * 3)  # room below the lowest bar and above the highest label
    elif finite:
        ax.set_ylim(0, max(finite) * 1.15)
    ax.set_ylabel("perplexity")
    where = f" on {windows} calibration windows" if windows else ""
    ax.set_title(f"candidates measured{where} (highlighted: removed)", fontsize=9)


def _layer_figure(num_layers: int, panels: list[tuple], removed, title: str, entries=(), windows=None,
                  band_label: str = "removed"):
    """Panels sharing the layer axis, then (when given) the candidate bars on their own axis below."""
    rows = max(1, len(panels)) + (1 if entries else 0)
    figure = new_figure(figsize=(WIDTH, PANEL_HEIGHT * rows + 0.6), dpi=DPI, layout="constrained")
    grid = figure.add_gridspec(rows, 1)
    first = ax = None
    for row, (name, ylabel, curves) in enumerate(panels or [("layers", "", [])]):
        ax = figure.add_subplot(grid[row, 0], sharex=first)
        first = first or ax
        _layer_panel(ax, name, ylabel, curves, removed, first=row == 0, band_label=band_label)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.tick_params(labelbottom=row == len(panels) - 1 or not panels)
        if not curves:
            ax.set_yticks([])
    first.set_xlim(-0.5, num_layers - 0.5)
    ax.set_xlabel("layer (0-based, original model)")
    if entries:
        _candidate_panel(figure.add_subplot(grid[rows - 1, 0]), entries, windows)
    figure.suptitle(title)
    return figure


def _score_panels(scores: dict) -> list[tuple]:
    series = score_series(scores)
    return [(name, ylabel, [(label, series[key]) for key, label in curves if key in series])
            for name, ylabel, curves in SCORE_PANELS if any(key in series for key, _ in curves)]


def layer_scores_figure(scores: dict, *, removed=(), title: str | None = None, band_label: str = "removed"):
    """The scores JSON as panels over the layer axis: block influence, q-similarity pre/post RoPE and the
    angular distance to the next layer, with `removed` layers shaded."""
    calibration = scores.get("calibration") or {}
    default = f"{scores.get('model', 'model')}: per-layer scores"
    if calibration.get("windows"):
        default += f" ({calibration['windows']} windows of {calibration.get('seq_len')} tokens)"
    return _layer_figure(len(scores["layers"]), _score_panels(scores), tuple(removed), title or default,
                         band_label=band_label)


def plot_layer_scores(scores: dict, path, *, removed=(), title: str | None = None, band_label: str = "removed"):
    """Draw layer_scores_figure into `path` (atomically, creating folders); returns the Figure."""
    figure = layer_scores_figure(scores, removed=removed, title=title, band_label=band_label)
    save_figure(figure, path)
    return figure


def prune_figure(scores: dict | None, plan: dict, *, title: str | None = None):
    """The score panels (when scores exist), the criterion's per-layer values (ppl: each layer's first-round
    perplexity), and the guided search's candidate perplexities, with the plan's removed layers shaded."""
    num_layers, criterion = plan["num_layers"], plan.get("criterion", "")
    if scores is not None and len(scores["layers"]) != num_layers:
        raise OptionError(f"the scores are for {len(scores['layers'])} layers but the plan for {num_layers}; "
                          "score this model again")
    panels = _score_panels(scores) if scores is not None else []
    values = plan.get("criterion_values")
    if values and not (scores is not None and criterion in ("qsim", "bi")):  # those repeat a score panel
        label = CRITERION_LABELS.get(criterion, f"{criterion} value")
        measured = criterion in ("ppl", "halving")
        panels.append(("ppl" if measured else "criterion", "perplexity" if measured else label,
                       [(label, [_number(v) for v in values])]))
    parameters = plan.get("parameters") or {}
    default = f"{plan.get('base_model', 'model')}: --criterion {criterion} removes {layers_text(plan['removed'])}"
    return _layer_figure(num_layers, panels, tuple(plan["removed"]), title or default, candidates(plan),
                         parameters.get("refine_windows"))


def plot_prune(scores: dict | None, plan: dict, path, *, title: str | None = None):
    """Draw prune_figure into `path` (atomically, creating folders); returns the Figure."""
    figure = prune_figure(scores, plan, title=title)
    save_figure(figure, path)
    return figure


FRONTIER_STYLE = {"mixed": ("tab:blue", "o"), "block-only": ("tab:red", "s"), "attention-only": ("tab:green", "^")}


def pareto_figure(frontier: dict, *, title: str | None = None):
    """Calibration perplexity against the swept target, one curve per candidate kind, the chosen cut starred."""
    figure = new_figure(figsize=(6.4, 4.2))
    axes = figure.add_subplot()
    speed = frontier["target"]["name"] in ("decode", "prefill")
    for kind, (colour, marker) in FRONTIER_STYLE.items():
        points = sorted((p for p in frontier["points"] if p["kind"] == kind),
                        key=lambda p: p["speedup"] if speed else p["ratio"])
        if points:
            axes.plot([p["speedup"] if speed else p["ratio"] for p in points], [p["perplexity"] for p in points],
                      marker=marker, color=colour, label=kind)
    chosen = frontier.get("chosen")
    if chosen:
        axes.plot([chosen["x"]], [chosen["perplexity"]], marker="*", markersize=14, color="black", linestyle="none",
                  label=f"chosen: {chosen['describe']}")
    axes.set_xlabel(f"{frontier['target']['name']} ({'predicted speed-up' if speed else 'x base'})")
    axes.set_ylabel("calibration perplexity")
    axes.set_yscale("log")
    axes.legend(fontsize="small")
    axes.set_title(title or f"{frontier['model']}: quality against {frontier['target']['name']}", fontsize="medium")
    figure.tight_layout()
    return figure


def plot_pareto(frontier: dict, path, *, title: str | None = None):
    figure = pareto_figure(frontier, title=title)
    save_figure(figure, path)
    return figure
