"""Heads report -> a self-contained HTML page with attention heatmaps of a few representative heads.

The page is for reading a heads analysis by eye (pattern mix per layer, correlations, seasonal heads, KV
budgets, what the clearest heads attend to). It uses inline CSS only: no JavaScript, no network. The heatmaps
are drawn with matplotlib (the optional `[plot]` extra) with token positions on both axes and a colour bar;
without it the page is still written, minus the heatmaps, and says how to get them.
"""

import html
from pathlib import Path

import torch

from prunetool.errors import MissingExtraError
from prunetool.output.plots import new_figure, save_figure

TYPE_COLOURS = {"re-access": "#4477aa", "sequential": "#ee6677", "seasonal": "#228833", "retrieval": "#bbbbbb"}
SCORES = {"re-access": "re_access", "sequential": "sequential", "seasonal": "seasonal"}  # type -> pattern score
PER_GROUP = 2  # representative heads per group
SEASONAL_ROWS = 20
HEATMAP_INCHES, HEATMAP_DPI = (4.2, 3.7), 100  # 420 x 370 pixels: a 128-pixel thumbnail gets ~2 each
CSS = """body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#222;max-width:1120px;
margin:2em auto;padding:0 1em;line-height:1.4}h2{margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px;margin:.5em 0}th,td{padding:3px 8px;border-bottom:1px solid #e4e4e4;
text-align:right}th{background:#f5f5f5}.l{text-align:left}.bar{display:flex;width:180px;height:12px;background:#eee}
.legend span{display:inline-block;width:10px;height:10px;margin:0 4px 0 12px}
figure{display:inline-block;vertical-align:top;width:860px;margin:0 1em 1.5em 0}
figure img{width:420px;border:1px solid #ccc}figcaption{font-size:13px}
.note{color:#555;font-size:13px}"""


def heatmap_span(part: str, side: int, seq_len: int | None) -> int:
    """Token positions a thumbnail covers from position 0: the zoom is the window's exact top-left corner
    (one pixel per token); the overview is the whole window, average-pooled to `side` pixels."""
    return seq_len if part == "overview" and seq_len and seq_len >= side else side


def heatmap_figure(weights: torch.Tensor, *, start: int = 0, tokens: int | None = None, title: str = ""):
    """(queries, keys) attention weights -> Figure with both axes in token positions, `start` first, the
    columns covering `tokens` positions; colour on a square-root scale up to the map's own maximum, so
    faint diagonals stay visible next to a strong sink column, and a colour bar in real weights."""
    figure = new_figure(figsize=HEATMAP_INCHES, dpi=HEATMAP_DPI, layout="constrained")
    from matplotlib.colors import PowerNorm

    image = torch.nan_to_num(weights.detach().float().cpu()).clamp(min=0)
    scale = (tokens or image.shape[1]) / image.shape[1]  # token positions per pixel
    left, top = start - 0.5, start - 0.5
    extent = (left, left + image.shape[1] * scale, top + image.shape[0] * scale, top)
    peak = image.max().item()
    ax = figure.add_subplot()
    shown = ax.imshow(image.numpy(), cmap="viridis", norm=PowerNorm(0.5, vmin=0, vmax=peak if peak > 0 else 1),
                      extent=extent, interpolation="nearest", aspect="equal")
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    for spine in ax.spines.values():
        spine.set_linewidth(0.4)  # thin, so the first key's column (often the sink) is not hidden under it
    figure.suptitle(title, fontsize=9)
    figure.colorbar(shown, ax=ax, label="attention weight (\u221a scale)")
    return figure


def _draw_heatmaps(folder: Path, heads, thumbnails: dict, seq_len: int | None) -> list[str]:
    """Each head's overview and zoom as heatmaps/L{layer}_H{head}_{part}.png; returns the names written."""
    written = []
    for layer, head in heads:
        for part, image in zip(("overview", "zoom"), thumbnails[(layer, head)]):
            tokens = heatmap_span(part, image.shape[-1], seq_len)
            what = f"whole window, {tokens} tokens" if part == "overview" else f"first {tokens} tokens"
            name = f"heatmaps/L{layer}_H{head}_{part}.png"
            save_figure(heatmap_figure(image, tokens=tokens, title=f"layer {layer} head {head}: {what}"), folder / name)
            written.append(name)
    return written


def _fmt(value, digits: int | None = 3) -> str:
    """A number as table text; null (and absent) becomes an em dash. digits=None: shortest form."""
    if value is None:
        return "\u2014"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return format(value, "g") if digits is None else f"{value:.{digits}f}"
    return html.escape(str(value))


def _table(headers: list[str], rows: list[list[str]], left: int = 0) -> str:
    """Rows of ready HTML cells; the first `left` columns align left."""
    def cells(tag, values):
        return "".join(f"<{tag}{' class=l' if i < left else ''}>{v}</{tag}>" for i, v in enumerate(values))
    body = "".join(f"<tr>{cells('td', row)}</tr>" for row in rows)
    return f"<table><tr>{cells('th', [html.escape(h) for h in headers])}</tr>{body}</table>"


def _difference(a, b):
    return None if a is None or b is None else a - b


def _representatives(heads: list[dict], drawable) -> list[tuple[str, list[dict]]]:
    """Groups of heads worth looking at: the clearest heads of each type, the least structured retrieval
    heads, and those the swap test finds most positional and most symbolic. Only drawable heads count."""
    heads = [head for head in heads if (head["layer"], head["head"]) in drawable]

    def top(title, pool, key):
        scored = [head for head in pool if key(head) is not None]
        return title, sorted(scored, key=key, reverse=True)[:PER_GROUP]

    def weakest(head):
        scores = [head["pattern"].get(name) for name in SCORES.values()]
        scores = [score for score in scores if score is not None]
        return -max(scores) if scores else None

    groups = [top(f"{kind}: highest {kind} score", [h for h in heads if h["type"] == kind],
                  lambda head, name=name: head["pattern"].get(name)) for kind, name in SCORES.items()]
    groups.append(top("retrieval: least structured", [h for h in heads if h["type"] == "retrieval"], weakest))
    groups.append(top("most positional (swap test)", heads,
                      lambda head: _difference(head["swap"].get("positional"), head["swap"].get("symbolic"))))
    groups.append(top("most symbolic (swap test)", heads,
                      lambda head: _difference(head["swap"].get("symbolic"), head["swap"].get("positional"))))
    return [(title, members) for title, members in groups if members]


def _card(head: dict, images: bool) -> str:
    """One head: its overview and zoom heatmaps (when drawn) and what the report measured about it."""
    name = f"heatmaps/L{head['layer']}_H{head['head']}"
    pattern, rope, swap = head["pattern"], head.get("rope") or {}, head.get("swap") or {}
    lines = [f"<b>layer {head['layer']} head {head['head']}: {html.escape(head['type'])}</b>",
             " \u00b7 ".join(f"{kind} {_fmt(pattern.get(score))}" for kind, score in SCORES.items()),
             f"q-sim {_fmt(head.get('q_similarity'))} pre-RoPE / {_fmt(head.get('q_similarity_post_rope'))} post-RoPE",
             f"RoPE channel {_fmt(rope.get('channel'))} (period {_fmt(rope.get('period'), 1)}), visible channel "
             f"{_fmt(rope.get('visible_channel'))} (period {_fmt(rope.get('visible_period'), 1)})"]
    if pattern.get("period") is not None:
        lines.append(f"measured period {_fmt(pattern['period'], 1)} ({_fmt(pattern.get('teeth'))} teeth)")
    lines.append(f"swap: {_fmt(swap.get('label'))} (positional {_fmt(swap.get('positional'))}, "
                 f"symbolic {_fmt(swap.get('symbolic'))})")
    parts = ("overview", "zoom") if images else ()
    pictures = "".join(f'<img src="{name}_{part}.png" alt="{part}"> ' for part in parts)
    return f"<figure>{pictures}<figcaption>{'<br>'.join(lines)}</figcaption></figure>"


def _layer_rows(data: dict, budgets: dict) -> tuple[list[str], list[list[str]]]:
    """The per-layer table: pattern mix as a stacked bar and counts, q-similarity, swap labels, KV budget."""
    labels = ["positional", "symbolic", "mixed"]
    if any(layer["swap"].get("untested") for layer in data["layers"]):
        labels.append("untested")
    headers = ["layer", "patterns", *TYPE_COLOURS, "q-sim pre", "q-sim post", *labels]
    headers += ["KV budget"] if budgets else []
    rows = []
    for layer in data["layers"]:
        counts = layer["patterns"]
        total = sum(count or 0 for count in counts.values()) or 1
        bar = "".join(f'<div style="width:{100 * (counts.get(kind) or 0) / total:.2f}%;background:{colour}"></div>'
                      for kind, colour in TYPE_COLOURS.items())
        row = [_fmt(layer["index"]), f'<div class="bar">{bar}</div>', *(_fmt(counts.get(k)) for k in TYPE_COLOURS),
               _fmt(layer.get("q_similarity")), _fmt(layer.get("q_similarity_post_rope")),
               *(_fmt(layer["swap"].get(label, 0)) for label in labels)]
        rows.append(row + ([_fmt(budgets.get(layer["index"]))] if budgets else []))
    return headers, rows


def write_report(folder: Path, data: dict, thumbnails: dict) -> list[str]:
    """Write report.html and the representative heads' heatmaps into `folder`; return the relative names written.

    thumbnails: (layer, head) -> (overview, zoom) attention maps (queries x keys) of the first window.
    Without matplotlib the page is written without heatmaps and says how to get them: `heads --output`
    should not fail over an optional extra when the numbers are all there.
    """
    groups = _representatives(data["heads"], thumbnails)
    heads = list({(h["layer"], h["head"]): None for _, members in groups for h in members})
    seq_len = (data.get("calibration") or {}).get("seq_len")
    try:
        written, missing = _draw_heatmaps(folder, heads, thumbnails, seq_len), None
    except MissingExtraError as error:
        written, missing = [], str(error)

    calibration, kv = data.get("calibration") or {}, data.get("kv_budget")
    budgets = {row["index"]: row.get("budget") for row in kv["layers"]} if kv else {}
    legend = "".join(f'<span style="background:{c}"></span>{html.escape(k)}' for k, c in TYPE_COLOURS.items())
    parts = [f"<h1>Attention heads: {_fmt(data.get('model'))}</h1>",
             f"<p>{_fmt(data.get('num_layers'))} layers \u00d7 {_fmt(data.get('num_heads'))} heads "
             f"({_fmt(data.get('num_kv_heads'))} KV heads, head_dim {_fmt(data.get('head_dim'))}). Calibration: "
             f"{_fmt(calibration.get('windows'))} windows of {_fmt(calibration.get('seq_len'))} tokens (stride "
             f"{_fmt(calibration.get('stride'))}, {_fmt(calibration.get('tokens'))} tokens) from "
             f"{_fmt(calibration.get('source'))}, sha256 {_fmt((calibration.get('sha256') or '')[:12] or None)}.</p>",
             "<p class=note>Thresholds: " + " \u00b7 ".join(f"{html.escape(key)} {_fmt(value, None)}" for key, value
                                                          in (data.get("thresholds") or {}).items()) + "</p>",
             f'<h2>Layers</h2><p class="legend">{legend}</p>', _table(*_layer_rows(data, budgets), left=2)]

    correlation = data.get("correlation") or {}
    pre, post = correlation.get("pre_rope") or {}, correlation.get("post_rope") or {}
    metrics = [("Pearson vs predictable (head)", lambda c: c.get("pearson_vs_predictable")),
               ("Spearman vs structure share", lambda c: c.get("spearman_vs_structure"))]
    metrics += [(f"mean q-sim, {kind} heads", lambda c, kind=kind: (c.get("mean_by_type") or {}).get(kind))
                for kind in TYPE_COLOURS]
    layers = correlation.get("layers") or {}
    parts += [f"<h2>Correlation</h2><p>Over {_fmt(correlation.get('heads'))} heads: does query self-similarity "
              "predict a predictable (non-retrieval) head?</p>",
              _table(["", "pre-RoPE", "post-RoPE"], [[html.escape(label), _fmt(get(pre)), _fmt(get(post))]
                                                      for label, get in metrics], left=1),
              f"<p>Per layer, Pearson of q-sim vs the predictable share of heads: pre-RoPE "
              f"{_fmt(layers.get('pearson_q_similarity_vs_predictable_share'))}, post-RoPE "
              f"{_fmt(layers.get('pearson_post_rope_vs_predictable_share'))}.</p>"]

    parts += ["<h2>Representative heads</h2><p class=note>Left: the first window's whole map, average-pooled; right: "
              "its exact top-left corner. Axes are token positions, queries down and keys across; colour is the "
              "attention weight on a square-root scale up to the map's own maximum (dark violet = 0, yellow = "
              "maximum; see each colour bar).</p>"]
    if missing:
        parts.append(f"<p class=note>Heatmaps left out: {html.escape(missing)}</p>")
    parts += [f"<h3>{html.escape(title)}</h3>" + "".join(_card(head, not missing) for head in members)
              for title, members in groups]

    seasonal = data.get("seasonal") or []
    parts.append(f"<h2>Seasonal candidates</h2><p>{len(seasonal)} heads show a comb of diagonals"
                 + (f"; the top {min(len(seasonal), SEASONAL_ROWS)} by seasonal score.</p>" if seasonal else ".</p>"))
    if seasonal:
        parts.append(_table(["layer", "head", "seasonal score", "classified", "measured period", "predicted period",
                             "ratio"],
                            [[_fmt(row.get("layer")), _fmt(row.get("head")), _fmt(row.get("seasonal")),
                              _fmt(row.get("classified_seasonal")), _fmt(row.get("measured_period"), 1),
                              _fmt(row.get("predicted_period"), 1), _fmt(row.get("ratio"))]
                             for row in seasonal[:SEASONAL_ROWS]]))
    if kv:
        parts += [f"<h2>KV budget</h2><p>{_fmt(kv.get('kv_budget'))} tokens per layer on average, "
                  f"{_fmt(kv.get('total'))} in all. Rule: {_fmt(kv.get('rule'))}.</p>",
                  _table(["layer", "q-sim recent", "unpredictability", "budget", "cap"],
                         [[_fmt(row.get("index")), _fmt(row.get("q_similarity_recent")),
                           _fmt(row.get("unpredictability")), _fmt(row.get("budget")), _fmt(row.get("cap"))]
                          for row in kv["layers"]])]
    page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>Heads: {_fmt(data.get("model"))}'
            f"</title><style>{CSS}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n")
    (folder / "report.html").write_text(page, encoding="utf-8")
    return written + ["report.html"]
