"""Scores -> what people read: a rich table with inline bars. Machines get JSON from the CLI."""

from rich import box
from rich.table import Table
from rich.text import Text

BAR_WIDTH = 8
BLOCKS = " ▏▎▍▌▋▊▉█"


def bar(value: float, lo: float, hi: float, width: int = BAR_WIDTH) -> str:
    """A left-aligned bar whose length places `value` between the column's min and max."""
    fraction = 0.0 if hi <= lo else (value - lo) / (hi - lo)
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, rest = divmod(eighths, 8)
    return ("█" * full + (BLOCKS[rest] if rest else "")).ljust(width)


def _column_range(values: list[float]) -> tuple[float, float]:
    return min(values), max(values)


def scores_table(scores, marked: set[int], importance: list[float]) -> Table:
    """One row per layer: the layer metrics (bars on the two that drive pruning), TAPPA's BI', the mark.

    Fits an 80-column terminal for any layer count; the JSON output carries every metric in full.
    """
    table = Table(title=f"{scores.model}: {scores.num_layers} layers (0-based indices)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("layer", justify="right")
    columns = [  # (key, header, with bar)
        ("q_similarity", "q-sim", True),
        ("q_similarity_post_rope", "post-RoPE", False),
        ("q_similarity_lag1", "lag-1", False),
        ("block_influence", "block infl.", True),
    ]
    ranges = {key: _column_range(scores.column(key)) for key, _, _ in columns}
    for _, header, _ in columns:
        table.add_column(header, no_wrap=True)
    table.add_column("BI'", justify="right")
    table.add_column("prune", no_wrap=True)
    for layer, value in zip(scores.layers, importance):
        index = layer["index"]
        cells = [Text(f"{index}")]
        for key, _, with_bar in columns:
            number = f"{layer[key]:.4f}"
            cells.append(Text.assemble((bar(layer[key], *ranges[key]), "cyan"), " ", number) if with_bar
                         else Text(number))
        cells.append(Text(f"{value:.3f}"))
        cells.append(Text("drop", style="bold red") if index in marked else Text(""))
        table.add_row(*cells)
    return table


def plan_table(plan: dict) -> Table:
    """The --dry-run view: each original layer, the criterion's value, its new index, and whether it goes."""
    values = plan.get("criterion_values")
    removed = set(plan["removed"])
    table = Table(title=f"{plan['criterion']}: remove {len(removed)} of {plan['num_layers']} layers\n"
                        "(0-based original indices)", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("layer", justify="right")
    if values:
        table.add_column("value", justify="right")
    table.add_column("new index", justify="right")
    table.add_column("")
    index_map = plan["index_map"]
    for index in range(plan["num_layers"]):
        cells = [str(index)]
        if values:
            cells.append("" if values[index] is None else f"{values[index]:.4f}")
        cells.append("" if index in removed else str(index_map[str(index)]))
        cells.append(Text("remove", style="bold red") if index in removed else Text(""))
        table.add_row(*cells)
    return table


def perplexity_table(perplexity: dict, base_layers: int, kept_layers: int) -> Table:
    """Base against pruned on held-out text; the caption says which text."""
    table = Table(title="held-out perplexity", title_justify="left", box=box.SIMPLE_HEAD,
                  caption=perplexity["description"], caption_justify="left")
    for column in ("model", "layers", "perplexity"):
        table.add_column(column, justify="right" if column != "model" else "left")
    table.add_row("base", str(base_layers), f"{perplexity['before']:.3f}")
    table.add_row("pruned", str(kept_layers), f"{perplexity['after']:.3f}")
    return table
