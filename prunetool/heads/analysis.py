"""Per-head evidence -> the heads report: a type per head, RoPE periods, swap labels, correlations, KV budgets.

The report is a plain JSON-able dict (the documented `--json` / heads.json format); the first window's
attention thumbnails ride beside it for the HTML report only.
"""

import math
from dataclasses import dataclass

import torch

from prunetool import __version__
from prunetool.heads.budget import kv_budgets
from prunetool.heads.patterns import (
    BAND, FIXED_POSITIONS, MEDIAN_WINDOW, MIN_PERIOD, MIN_TEETH, PATTERNS, STRUCTURE_THRESHOLD, TOOTH_SHARE, classify,
)
from prunetool.heads.probe import HeadEvidence
from prunetool.heads.rope import dominant_channels
from prunetool.heads.swap import LABEL_MARGIN
from prunetool.model.metrics import pearson, spearman
from prunetool.select.scoring import summarise_taps

SWAP_LABELS = ("positional", "symbolic", "mixed")
SEASONAL_LISTED = 0.05  # the report lists combs of diagonals that carry at least this share of attention


@dataclass
class HeadsReport:
    data: dict
    thumbnails: dict  # (layer, head) -> (overview, zoom) tensors of the first window


def _correlations(heads: list[dict], layers: list[dict]) -> dict:
    """How well q-similarity reads off predictability, per head and per layer (TAPPA's claim, measured)."""
    predictable = [0.0 if head["type"] == "retrieval" else 1.0 for head in heads]
    structure = [head["pattern"]["structure"] for head in heads]
    result = {"heads": len(heads)}
    for key, label in (("q_similarity", "pre_rope"), ("q_similarity_post_rope", "post_rope")):
        values = [head[key] for head in heads]
        result[label] = {
            "pearson_vs_predictable": pearson(values, predictable),
            "spearman_vs_structure": spearman(values, structure),
            "mean_by_type": {kind: (sum(v for v, h in zip(values, heads) if h["type"] == kind)
                                    / max(1, sum(h["type"] == kind for h in heads)))
                             if any(h["type"] == kind for h in heads) else None for kind in PATTERNS},
        }
    shares = [1.0 - layer["patterns"]["retrieval"] / max(1, sum(layer["patterns"].values())) for layer in layers]
    result["layers"] = {
        "pearson_q_similarity_vs_predictable_share": pearson([layer["q_similarity"] for layer in layers], shares),
        "pearson_post_rope_vs_predictable_share": pearson([layer["q_similarity_post_rope"] for layer in layers], shares),
    }
    return result


def thresholds() -> dict:
    return {"structure": STRUCTURE_THRESHOLD, "fixed_positions": FIXED_POSITIONS, "band": BAND,
            "median_window": MEDIAN_WINDOW, "min_period": MIN_PERIOD, "min_teeth": MIN_TEETH,
            "tooth_share": TOOTH_SHARE, "swap_label_margin": LABEL_MARGIN}


def analyse(evidence: HeadEvidence, *, model: str, calibration: dict, kv_budget: int | None,
            caps: list[int], full_attention: list[bool]) -> HeadsReport:
    layer_scores, head_scores, _ = summarise_taps(evidence.taps)
    group = evidence.num_heads // evidence.kv_heads
    heads, layers, seasonal, thumbnails = [], [], [], {}
    for index, layer in sorted(evidence.selected.items()):
        column, offset = layer.column / layer.windows, layer.offset / layer.windows
        channels = dominant_channels(layer.query_norms, layer.key_norms,
                                     layer.thetas if layer.thetas is not None
                                     else torch.zeros(layer.query_norms.shape[-1], dtype=torch.float64),
                                     longest_visible=offset.shape[-1] / MIN_TEETH)
        verdicts = layer.swaps.verdicts(evidence.num_heads)
        counts = dict.fromkeys(PATTERNS, 0)
        labels = dict.fromkeys(SWAP_LABELS, 0)
        for head in range(evidence.num_heads):
            pattern = classify(column[head], offset[head])
            counts[pattern.kind] += 1
            # no cos/sin tables reached the layer: every channel was given theta 0, so no period is claimed
            rope = channels[head] if layer.thetas is not None else {**channels[head], "theta": None}
            swap = verdicts[head]
            labels[swap["label"]] = labels.get(swap["label"], 0) + 1
            heads.append({
                "layer": index, "head": head, "kv_head": head // group, "type": pattern.kind,
                "pattern": pattern.to_json(),
                "q_similarity": head_scores["q_similarity"][index][head],
                "q_similarity_post_rope": head_scores["q_similarity_post_rope"][index][head],
                "q_similarity_recent": evidence.recent_similarity[index][head],
                "rope": rope, "swap": swap,
            })
            if pattern.period is not None and pattern.seasonal >= SEASONAL_LISTED:  # named seasonal or not
                predicted = rope["visible_period"]
                seasonal.append({"layer": index, "head": head, "seasonal": pattern.seasonal,
                                 "classified_seasonal": pattern.kind == "seasonal", "measured_period": pattern.period,
                                 "predicted_period": predicted, "channel": rope["visible_channel"],
                                 "ratio": pattern.period / predicted if predicted else None})
            thumbnails[(index, head)] = (layer.overview[head], layer.zoom[head])
        layers.append({
            "index": index, "patterns": counts, "swap": labels,
            "q_similarity": layer_scores[index]["q_similarity"],
            "q_similarity_post_rope": layer_scores[index]["q_similarity_post_rope"],
            "q_similarity_recent": sum(evidence.recent_similarity[index]) / evidence.num_heads,
            "block_influence": layer_scores[index]["block_influence"],
            "swap_tests": layer.swaps.swaps,
        })
    recent = [sum(values) / len(values) for values in evidence.recent_similarity]
    data = {
        "model": model,
        "calibration": calibration,
        "num_layers": len(evidence.recent_similarity),
        "num_heads": evidence.num_heads,
        "num_kv_heads": evidence.kv_heads,
        "head_dim": evidence.head_dim,
        "thresholds": thresholds(),
        "layers": layers,
        "heads": heads,
        "correlation": _correlations(heads, layers),
        "seasonal": sorted(seasonal, key=lambda row: -row["seasonal"]),
        "kv_budget": kv_budgets(recent, kv_budget, caps, full_attention) if kv_budget is not None else None,
        "meta": {"probe_seconds": round(evidence.seconds, 3), "prunetool_version": __version__,
                 "indexing": "0-based layer and head indices of the original model"},
    }
    return HeadsReport(_finite(data), thumbnails)


def _finite(value):
    """JSON has no NaN or infinity: such numbers become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value
