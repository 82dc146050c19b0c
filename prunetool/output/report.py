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
    """One row per layer: the layer metrics (bars on the two that drive pruning), the guided rank score, the mark.

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
    table.add_column("rank", justify="right")
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


def budget_table(budget: dict, plan: dict) -> Table:
    """--target: the cut, each target against the base and whether it is met, and what the search cost."""
    seconds = budget["seconds"]
    ppl = budget["calibration_perplexity"]
    table = Table(title=f"budget cut: {plan['cut']['describe']} (0-based original indices)", title_justify="left",
                  box=box.SIMPLE_HEAD, caption_justify="left",
                  caption=f"calibration perplexity {ppl['base']:.3f} -> {ppl['cut']:.3f} (exact solve "
                          f"{ppl['solved']:.3f}, then {budget['local_search_evaluations']} measured neighbours); "
                          f"{budget['resolves']} re-solve(s) after a measured speed miss; {seconds['total']:.1f} s")
    for column in ("target", "base", "cut", "met"):
        table.add_column(column, justify="left" if column == "target" else "right")
    for report in budget["targets"]:
        if "ratio" in report:
            cut, base = f"{report['cut']:,.0f} ({report['ratio']:.3f}x)", f"{report['base']:,.0f}"
        else:
            measured = report.get("speedup")
            cut = (f"{measured:.2f}x measured, " if measured is not None else "") + \
                f"{report['predicted_speedup']:.2f}x predicted"
            base = "1.00x"
        table.add_row(report["target"], base, cut, Text("yes", style="green") if report["met"] else
                      Text("no", style="bold red"))
    return table


def perplexity_table(perplexity: dict, base_layers: int, kept_layers: int) -> Table:
    """Base against pruned on held-out text; the caption says which text."""
    table = Table(title="held-out perplexity", title_justify="left", box=box.SIMPLE_HEAD,
                  caption=perplexity["description"], caption_justify="left")
    for column in ("model", "layers", "perplexity"):
        table.add_column(column, justify="right" if column != "model" else "left")
    table.add_row("base", str(base_layers), f"{perplexity['before']:.3f}")
    if "patched" in perplexity:
        table.add_row("pruned, no patch", str(kept_layers), f"{perplexity['plain_cut']:.3f}")
        table.add_row("pruned + patch", str(kept_layers), f"{perplexity['patched']:.3f}")
    else:
        table.add_row("pruned", str(kept_layers), f"{perplexity['after']:.3f}")
    return table


def _number(value) -> str:
    if not isinstance(value, (int, float)):
        return str(value)
    return f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"


def eval_rows(report: dict) -> list[tuple[str, str, bool | None, dict[str, tuple[float, float | None]]]]:
    """(task, metric, higher is better, {label: (value, stderr)}) for every metric any model reported."""
    rows: dict[tuple[str, str], dict] = {}
    better: dict[tuple[str, str], bool | None] = {}
    for label, entry in report["models"].items():
        lm = entry.get("lm_eval") or {}
        for task, metrics in (lm.get("results") or {}).items():
            for key, value in metrics.items():
                metric, comma, _ = key.partition(",")
                if not comma or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                    continue
                stderr = metrics.get(key.replace(",", "_stderr,", 1))
                rows.setdefault((task, metric), {})[label] = (value, stderr if isinstance(stderr, (int, float)) else None)
                better[(task, metric)] = (lm.get("higher_is_better") or {}).get(task, {}).get(metric)
        if entry.get("heldout_ppl"):
            rows.setdefault(("heldout_ppl", "perplexity"), {})[label] = (entry["heldout_ppl"]["perplexity"], None)
            better[("heldout_ppl", "perplexity")] = False
    return [(task, metric, better[(task, metric)], values) for (task, metric), values in rows.items()]


def eval_table(report: dict) -> Table:
    """One row per task and metric, one column per model (value ± stderr), and the change when comparing two."""
    labels = list(report["models"])
    info = report["prunetool"]
    limit = f", first {info['limit']} documents per task" if info.get("limit") else ""
    table = Table(title=f"evaluation{limit}", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("task")
    table.add_column("metric")
    for label in labels:
        table.add_column(label, justify="right")
    if len(labels) == 2:
        table.add_column("change", justify="right")
    for task, metric, higher, values in eval_rows(report):
        arrow = {True: " ↑", False: " ↓"}.get(higher, "")
        cells = []
        for label in labels:
            value, stderr = values.get(label, (None, None))
            cells.append("—" if value is None else _number(value) + (f" ± {_number(stderr)}" if stderr else ""))
        if len(labels) == 2:
            first, second = (values.get(label, (None, None))[0] for label in labels)
            if first is None or second is None:
                cells.append("")
            else:
                delta = second - first
                worse = higher is not None and delta != 0 and (delta < 0) == higher
                cells.append(Text(f"{delta:+.4g}", style="red" if worse else "green" if higher is not None and delta else ""))
        table.add_row(task, metric + arrow, *cells)
    return table


def efficiency_table(report: dict) -> Table | None:
    """What each model costs to run: parameters, KV bytes per token, speeds, peak memory (x base)."""
    rows = {label: entry["efficiency"] for label, entry in report["models"].items() if entry.get("efficiency")}
    if not rows:
        return None
    setting = next(iter(rows.values()))["setting"]
    if setting.get("engine"):  # measured in a serving engine: its workload says what the speeds are
        title = f"efficiency in {setting['engine']} on {setting['device']} ({setting['dtype']}; {setting['workload']})"
    else:
        title = (f"efficiency on {setting['device']} ({setting['dtype']}, batch {setting['batch']}, median of "
                 f"{setting['repeats']}; prefill {setting['prefill_tokens']} tokens, decode "
                 f"{setting['decode_tokens']} after {setting['decode_prompt_tokens']})")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    columns = (("parameters", "parameters", "{:,.0f}"), ("kv_cache_bytes_per_token", "KV bytes/token", "{:,.0f}"),
               ("prefill_tokens_per_second", "prefill tok/s", "{:,.0f}"),
               ("decode_tokens_per_second", "decode tok/s", "{:,.1f}"), ("peak_memory_bytes", "peak MiB", None))
    table.add_column("model")
    for _, title, _ in columns:
        table.add_column(title, justify="right")
    for label, row in rows.items():
        relative = row.get("relative_to_base") or {}
        cells = []
        for key, _, form in columns:
            value = row[key] / 2**20 if form is None else row[key]
            text = f"{value:,.0f}" if form is None else form.format(value)
            cells.append(text + (f" ({relative[key]:.2f}x)" if key in relative and row is not rows.get("base") else ""))
        table.add_row(label, *cells)
    return table


def hop_table(report: dict) -> Table | None:
    """Hop-probe accuracy against context length: one row per probe and model, one column per length."""
    from prunetool.evaluation.hop import parse_task_name

    cells: dict[tuple[str, str], dict[int, float]] = {}
    for label, entry in report["models"].items():
        for task, metrics in ((entry.get("lm_eval") or {}).get("results") or {}).items():
            parsed = parse_task_name(task)
            if parsed and "acc,none" in metrics:
                cells.setdefault((parsed[0], label), {})[parsed[1]] = metrics["acc,none"]
    if not cells:
        return None
    lengths = sorted({n for row in cells.values() for n in row})
    table = Table(title="hop probes: accuracy by context length (chance 0.04)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("probe")
    table.add_column("model")
    for n in lengths:
        table.add_column(str(n), justify="right")
    order = list(report["models"])
    for (kind, label), row in sorted(cells.items(), key=lambda item: (item[0][0], order.index(item[0][1]))):
        table.add_row(kind, label, *(f"{row[n]:.2f}" if n in row else "—" for n in lengths))
    return table


def long_context_table(report: dict) -> Table | None:
    """Long-context accuracy per KV cache: one row per model and cache (full, then each --kv-budget schedule)."""
    entries = {label: entry["long_context"] for label, entry in report["models"].items() if entry.get("long_context")}
    if not entries:
        return None
    tasks = list(next(iter(entries.values()))["tasks"])
    window = next(iter(entries.values()))["window"]
    table = Table(title=f"long-context accuracy by KV cache (SnapKV-style, window {window})", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for header in ("model", "cache", *tasks, "mean", "tokens/layer", "of full"):
        table.add_column(header, justify="left" if header in ("model", "cache") else "right")
    for label, result in entries.items():
        for column in result["columns"]:
            cache = result["cache"][column]
            share = cache["share_of_full"]
            table.add_row(label, column, *(f"{result['tasks'][task]['accuracy'][column]:.2f}" for task in tasks),
                          f"{result['mean_accuracy'][column]:.3f}", f"{cache['mean_tokens_per_layer']:.0f}",
                          "—" if share is None else f"{share:.0%}")
    return table


def _fmt(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def heads_table(data: dict) -> Table:
    """One row per analysed layer: how many heads follow each pattern, mean q-similarity, swap labels, KV budget."""
    budgets = {row["index"]: row["budget"] for row in data["kv_budget"]["layers"]} if data.get("kv_budget") else None
    table = Table(title=f"{data['model']}: attention heads per layer ({data['num_heads']} heads, 0-based indices)",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("layer", justify="right")
    for header in ("re-acc", "seq", "seas", "retr"):
        table.add_column(header, justify="right")
    table.add_column("q-sim", justify="right")
    table.add_column("post", justify="right")  # post-RoPE q-sim; short so the table fits 80 columns
    for header in ("pos", "sym", "mix"):
        table.add_column(header, justify="right")
    if budgets is not None:
        table.add_column("KV", justify="right")
    for layer in data["layers"]:
        counts, swap = layer["patterns"], layer["swap"]
        cells = [str(layer["index"])] + [str(counts[kind]) for kind in ("re-access", "sequential", "seasonal", "retrieval")]
        cells += [_fmt(layer["q_similarity"]), _fmt(layer["q_similarity_post_rope"])]
        cells += [str(swap.get(label, 0)) for label in ("positional", "symbolic", "mixed")]
        if budgets is not None:
            cells.append(str(budgets[layer["index"]]))
        table.add_row(*cells)
    return table


def heads_summary(data: dict) -> list[str]:
    """The lines under the table: the q-similarity vs pattern correlation and the seasonal periods."""
    correlation = data["correlation"]
    lines = [
        f"q-similarity vs predictable (not retrieval) over {correlation['heads']} heads: Pearson pre-RoPE "
        f"{_fmt(correlation['pre_rope']['pearson_vs_predictable'])}, post-RoPE "
        f"{_fmt(correlation['post_rope']['pearson_vs_predictable'])}; per layer (share predictable) pre "
        f"{_fmt(correlation['layers']['pearson_q_similarity_vs_predictable_share'])}, post "
        f"{_fmt(correlation['layers']['pearson_post_rope_vs_predictable_share'])}",
    ]
    named = [row for row in data["seasonal"] if row["classified_seasonal"]]
    if named:
        pairs = ", ".join(f"L{row['layer']}H{row['head']} {row['measured_period']:.1f} vs {_fmt(row['predicted_period'], 1)}"
                          for row in named[:8])
        lines.append(f"seasonal heads, measured vs predicted period (tokens): {pairs}")
    else:
        combs = len(data["seasonal"])
        lines.append(f"no head reaches the seasonal threshold; {combs} {'shows' if combs == 1 else 'show'} a weaker comb "
                     "of diagonals (periods in the JSON `seasonal` list)")
    if data.get("kv_budget"):
        budget = data["kv_budget"]
        lines.append(f"KV budgets: {budget['kv_budget']} tokens per layer on average, {budget['total']} in all; "
                     "more cache where recent queries differ (low post-RoPE q-similarity)")
    return lines
