"""The heads HTML report: heatmaps with token-position axes and a colour bar, a full render, and the page
without matplotlib."""

import re
import struct
import sys

import pytest
import torch

from prunetool.heads.render import HEATMAP_DPI, HEATMAP_INCHES, heatmap_figure, heatmap_span, write_report

SIGNATURE = b"\x89PNG\r\n\x1a\n"
HEATMAP_PIXELS = (round(HEATMAP_INCHES[0] * HEATMAP_DPI), round(HEATMAP_INCHES[1] * HEATMAP_DPI))


def png_size(blob: bytes) -> tuple[int, int]:
    """(width, height) from the signature and the IHDR chunk, which must come first."""
    assert blob[:8] == SIGNATURE and blob[12:16] == b"IHDR"
    return struct.unpack(">II", blob[16:24])


def _ticks(ax, axis: str) -> list[float]:
    """The tick positions inside the axis limits, as the drawn labels show them."""
    ax.figure.canvas.draw()
    low, high = sorted(getattr(ax, f"get_{axis}lim")())
    labels = getattr(ax, f"get_{axis}ticklabels")()
    return [float(label.get_text().replace("\u2212", "-")) for label in labels if low <= label.get_position()[
        0 if axis == "x" else 1] <= high]


def test_heatmap_axes_are_token_positions():
    weights = torch.rand(16, 16)
    figure = heatmap_figure(weights, tokens=512, title="layer 3 head 1: whole window")
    ax, bar = figure.axes  # the map and its colour bar
    assert ax.get_xlim() == (-0.5, 511.5) and ax.get_ylim() == (511.5, -0.5)  # queries run down
    assert ax.get_xlabel() == "key position" and ax.get_ylabel() == "query position"
    assert figure.get_suptitle() == "layer 3 head 1: whole window" and "attention weight" in bar.get_ylabel()
    xs = _ticks(ax, "x")
    assert xs and max(xs) > 100 and all(x == int(x) for x in xs)  # positions, not pixel indices 0..15
    (image,) = ax.get_images()
    assert torch.equal(torch.as_tensor(image.get_array()), weights)
    assert image.norm.vmin == 0 and image.norm.vmax == pytest.approx(weights.max().item()) and image.norm.gamma == 0.5


def test_heatmap_ticks_follow_a_crop_offset():
    figure = heatmap_figure(torch.rand(8, 8), start=100)
    ax = figure.axes[0]
    assert ax.get_xlim() == (99.5, 107.5) and ax.get_ylim() == (107.5, 99.5)
    assert all(100 <= x <= 107 for x in _ticks(ax, "x") + _ticks(ax, "y"))


def test_heatmap_span():
    assert heatmap_span("overview", 128, 512) == 512  # pooled: the whole window
    assert heatmap_span("overview", 40, 40) == 40 and heatmap_span("overview", 16, None) == 16
    assert heatmap_span("zoom", 64, 512) == 64  # exact corner: one pixel per token


def _head(layer, head, kind, scores, swap, period=None):
    re_access, sequential, seasonal = scores
    return {"layer": layer, "head": head, "kv_head": 0, "type": kind,
            "pattern": {"type": kind, "re_access": re_access, "sequential": sequential, "seasonal": seasonal,
                        "fixed_positions": [0], "offset": 1, "period": period, "teeth": 4 if period else 0},
            "q_similarity": 0.7, "q_similarity_post_rope": None, "q_similarity_recent": 0.6,
            "rope": {"channel": 3, "share": 0.2, "theta": None, "period": None, "visible_channel": 1,
                     "visible_share": 0.1, "visible_period": 12.5},
            "swap": swap}


def _data():
    layer = {"patterns": {"re-access": 1, "sequential": 1, "seasonal": 0, "retrieval": 0},
             "swap": {"positional": 1, "symbolic": 1, "mixed": 0}, "q_similarity": 0.8,
             "q_similarity_post_rope": 0.5, "q_similarity_recent": 0.6, "block_influence": 0.9, "swap_tests": 4}
    return {
        "model": "tiny <model>", "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "head_dim": 8,
        "calibration": {"source": "data.raw", "sha256": "ab" * 32, "seq_len": 16, "stride": 16, "windows": 1,
                        "tokens": 16},
        "thresholds": {"structure": 0.4, "min_teeth": 3},
        "layers": [{**layer, "index": 0},
                   {**layer, "index": 1, "patterns": {"re-access": 0, "sequential": 0, "seasonal": 1, "retrieval": 1},
                    "swap": {"positional": 0, "symbolic": 0, "mixed": 0, "untested": 2},
                    "q_similarity_post_rope": None}],
        "heads": [_head(0, 0, "re-access", (0.9, 0.1, 0.0), {"positional": 0.2, "symbolic": 0.9, "label": "symbolic"}),
                  _head(0, 1, "sequential", (0.1, 0.8, 0.1), {"positional": 0.9, "symbolic": 0.1,
                                                              "label": "positional"}),
                  _head(1, 0, "seasonal", (0.1, 0.2, 0.5), {"positional": None, "symbolic": None,
                                                            "label": "untested"}, period=12.0),
                  _head(1, 1, "retrieval", (0.1, 0.1, None), {"positional": None, "symbolic": None,
                                                              "label": "untested"})],
        "correlation": {"heads": 4,
                        "pre_rope": {"pearson_vs_predictable": 0.1, "spearman_vs_structure": None,
                                     "mean_by_type": {"re-access": 0.7, "sequential": 0.7, "seasonal": 0.7,
                                                      "retrieval": None}},
                        "post_rope": {"pearson_vs_predictable": 0.3, "spearman_vs_structure": 0.2,
                                      "mean_by_type": {"re-access": 0.5, "sequential": None, "seasonal": 0.5,
                                                       "retrieval": 0.4}},
                        "layers": {"pearson_q_similarity_vs_predictable_share": None,
                                   "pearson_post_rope_vs_predictable_share": 0.7}},
        "seasonal": [{"layer": 1, "head": 0, "seasonal": 0.5, "classified_seasonal": True, "measured_period": 12.0,
                      "predicted_period": 12.5, "channel": 1, "ratio": 0.96}],
        "kv_budget": {"format": "prunetool-kv-budget/1", "rule": "budget proportional to 1 - q-sim", "kv_budget": 8,
                      "total": 16, "budgets": [6, 10],
                      "layers": [{"index": 0, "q_similarity_recent": 0.6, "unpredictability": 0.4, "share": 6.4,
                                  "cap": 16, "budget": 6},
                                 {"index": 1, "q_similarity_recent": None, "unpredictability": 0.6, "share": 9.6,
                                  "cap": 16, "budget": 10}]},
        "meta": {},
    }


def _thumbnails(sizes):
    """Causal maps of the given sizes: a sink column plus a faint diagonal, rows summing to 1."""
    def causal(n):
        weights = torch.eye(n) * 0.2
        weights[:, 0] += 1.0
        return torch.tril(weights) / torch.tril(weights).sum(-1, keepdim=True)
    return {key: (causal(overview), causal(zoom)) for key, (overview, zoom) in sizes.items()}


def test_write_report(tmp_path):
    sizes = {(0, 0): (20, 7), (0, 1): (16, 8), (1, 0): (12, 12), (1, 1): (9, 3)}
    written = write_report(tmp_path, _data(), _thumbnails(sizes))
    on_disk = {str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*") if path.is_file()}
    assert set(written) == on_disk and len(written) == len(on_disk) == 9
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "<script" not in page and "http" not in page and "tiny &lt;model&gt;" in page
    for index in (0, 1):
        assert f"<tr><td class=l>{index}</td>" in page
    assert "\u2014" in page and "untested" in page and "KV budget" in page and "12.5" in page
    for name in re.findall(r'src="([^"]+)"', page):
        assert (tmp_path / name).is_file(), name
    for name in written[:-1]:
        assert png_size((tmp_path / name).read_bytes()) == HEATMAP_PIXELS
    assert "token positions" in page and "Heatmaps left out" not in page


def test_only_heads_with_thumbnails_are_drawn(tmp_path):
    written = write_report(tmp_path, _data(), _thumbnails({(0, 0): (10, 5)}))
    assert sorted(written) == ["heatmaps/L0_H0_overview.png", "heatmaps/L0_H0_zoom.png", "report.html"]


def test_report_without_matplotlib_says_how_to_get_heatmaps(tmp_path, monkeypatch):
    for name in [name for name in sys.modules if name == "matplotlib" or name.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    written = write_report(tmp_path, _data(), _thumbnails({(0, 0): (10, 5), (1, 0): (12, 12)}))
    assert written == ["report.html"] and [path.name for path in tmp_path.iterdir()] == ["report.html"]
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "<img" not in page and "layer 0 head 0: re-access" in page
    assert ("<p class=note>Heatmaps left out: plotting needs matplotlib: pip install "
            "&#x27;prunetool[plot]&#x27;</p>") in page
