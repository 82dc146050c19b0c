"""The heads HTML report: its PNG encoder read back by an independent decoder, and a full render."""

import re
import struct
import zlib

import torch

from prunetool.heads.render import _colorize, _png, write_report

SIGNATURE = b"\x89PNG\r\n\x1a\n"


def decode_png(blob: bytes) -> tuple[int, int, list[list[tuple[int, int, int]]]]:
    """8-bit RGB PNG with unfiltered rows -> (width, height, rows of pixels); checks every chunk's CRC."""
    assert blob[:8] == SIGNATURE
    position, chunks = 8, []
    while position < len(blob):
        (length,) = struct.unpack(">I", blob[position:position + 4])
        kind, payload = blob[position + 4:position + 8], blob[position + 8:position + 8 + length]
        (crc,) = struct.unpack(">I", blob[position + 8 + length:position + 12 + length])
        assert crc == zlib.crc32(kind + payload), kind
        chunks.append((kind, payload))
        position += 12 + length
    assert [kind for kind, _ in chunks][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    width, height, depth, colour, compression, filtering, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, colour, compression, filtering, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(payload for kind, payload in chunks if kind == b"IDAT"))
    stride = 1 + 3 * width
    assert len(raw) == height * stride
    rows = []
    for y in range(height):
        line = raw[y * stride:(y + 1) * stride]
        assert line[0] == 0  # filter type 0: the bytes are the pixels
        rows.append([tuple(line[1 + 3 * x:4 + 3 * x]) for x in range(width)])
    return width, height, rows


def test_png_round_trips_the_colormap():
    weights = torch.tensor([[0.0, 0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8, 0.9], [1.0, 0.05, 0.0, 0.25, 2.0]])
    rgb = _colorize(weights)
    assert rgb.shape == (3, 5, 3) and rgb.dtype == torch.uint8
    width, height, rows = decode_png(_png(rgb))
    assert (width, height) == (5, 3)
    assert rows == [[tuple(pixel) for pixel in row] for row in rgb.tolist()]
    assert rows[0][0] == (68, 1, 84) and rows[2][4] == (253, 231, 37)  # zero and the image's own maximum
    brightness = [sum(_colorize(torch.tensor([[v, 1.0]]))[0, 0].tolist()) for v in (0.0, 0.1, 0.3, 0.6, 1.0)]
    assert brightness == sorted(brightness)


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
    for (layer, head), (overview, zoom) in sizes.items():
        for part, side in (("overview", overview), ("zoom", zoom)):
            width, height, rows = decode_png((tmp_path / f"heatmaps/L{layer}_H{head}_{part}.png").read_bytes())
            assert (width, height) == (side, side)
            assert rows[0][0] == (253, 231, 37)  # the first query sees only key 0: the image's maximum
            assert sum(rows[-1][0]) > sum(rows[-1][-1]) > sum(rows[-1][1])  # sink > faint diagonal > nothing


def test_only_heads_with_thumbnails_are_drawn(tmp_path):
    written = write_report(tmp_path, _data(), _thumbnails({(0, 0): (10, 5)}))
    assert sorted(written) == ["heatmaps/L0_H0_overview.png", "heatmaps/L0_H0_zoom.png", "report.html"]
