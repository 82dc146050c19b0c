"""Calibration windows -> per-layer and per-head scores, in one forward pass over the decoder stack."""

import time
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from prunetool import __version__
from prunetool.model.architecture import inspect_decoder
from prunetool.model.capture import LayerTaps, capture_scores, check_complete
from prunetool.model.metrics import angular_distance_matrix
from prunetool.model.loading import input_device

if TYPE_CHECKING:
    from prunetool.select.calibration import CalibrationSet

LAYER_METRICS = ("q_similarity", "q_similarity_post_rope", "q_similarity_lag1", "block_influence")
# measured across one sublayer, in plain pre-norm layers only (prune --unit attention|mlp ranks by them)
SUBLAYER_METRICS = ("attention_influence", "mlp_influence", "attention_angular", "mlp_angular")


@dataclass
class Scores:
    """Everything `prunetool score` reports; `to_json` is the documented file format."""

    model: str
    num_layers: int
    num_heads: int
    calibration: dict
    layers: list[dict]  # one {"index", metric...} per layer, 0-based original indices
    heads: dict[str, list[list[float]]]  # metric -> L x H
    angular_distance: list[list[float]]  # (L+1) x (L+1)
    meta: dict = field(default_factory=dict)

    def column(self, metric: str) -> list[float]:
        return [layer[metric] for layer in self.layers]

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "calibration": self.calibration,
            "layers": self.layers,
            "heads": self.heads,
            "angular_distance": self.angular_distance,
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, data: dict) -> "Scores":
        return cls(**{key: data[key] for key in cls.__dataclass_fields__ if key in data})


def _per_window(chunks: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(chunks, dim=0).double()  # (W, ...) in window order


def summarise_taps(taps: list[LayerTaps]) -> tuple[list[dict], dict, list[list[float]]]:
    """Mean over heads then windows (TAPPA's order), per-head means, and the angular distance matrix."""
    layers, heads = [], {"q_similarity": [], "q_similarity_post_rope": [], "q_similarity_lag1": []}
    for index, layer in enumerate(taps):
        pre, post, lag1 = _per_window(layer.q_pre), _per_window(layer.q_post), _per_window(layer.q_lag1)
        layers.append({
            "index": index,
            "q_similarity": pre.mean(1).mean(0).item(),
            "q_similarity_post_rope": post.mean(1).mean(0).item(),
            "q_similarity_lag1": lag1.mean(1).mean(0).item(),
            "block_influence": _per_window(layer.block_influence).mean().item(),
        })
        for name in SUBLAYER_METRICS:
            if getattr(layer, name):
                layers[-1][name] = _per_window(getattr(layer, name)).mean().item()
        for name, values in zip(heads, (pre, post, lag1)):
            heads[name].append(values.mean(0).tolist())
    states = [_per_window(layer.last_input) for layer in taps] + [_per_window(taps[-1].last_output)]
    angular = angular_distance_matrix(torch.stack(states, dim=1)).tolist()  # (W, L+1, d) -> (L+1, L+1)
    return layers, heads, angular


@torch.inference_mode()
def score_model(
    model: torch.nn.Module,
    calibration: "CalibrationSet",
    *,
    model_name: str,
    batch_size: int = 1,
    on_batch: Callable[[int], None] | None = None,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> Scores:
    """Run every calibration window through the decoder stack (no LM head: scores need none)."""
    layout = inspect_decoder(model)
    decoder = model.get_decoder()
    device = device or input_device(model)  # given when the model streams its layers from disk
    dtype = dtype or next(model.parameters()).dtype
    windows = calibration.input_ids
    started = time.perf_counter()
    with capture_scores(layout) as taps:
        batches = 0
        for start in range(0, len(windows), batch_size):
            batch = windows[start : start + batch_size].to(device)
            decoder(input_ids=batch, use_cache=False)
            batches += 1
            if on_batch:
                on_batch(len(batch))
    check_complete(taps, batches)
    layers, heads, angular = summarise_taps(taps)
    return Scores(
        model=model_name,
        num_layers=layout.num_layers,
        num_heads=layout.num_heads,
        calibration=calibration.describe(),
        layers=layers,
        heads=heads,
        angular_distance=angular,
        meta={
            "model_type": layout.model_type,
            "head_dim": layout.head_dim,
            "dtype": str(dtype).removeprefix("torch."),
            "device": str(device),
            "batch_size": batch_size,
            "forward_seconds": round(time.perf_counter() - started, 3),
            "prunetool_version": __version__,
        },
    )


def score_streamed(source, calibration, *, model_name: str, dtype: torch.dtype, device: torch.device,
                   batch_size: int = 1, on_batch=None):
    """Scores equal to `score_model` on the loaded model (to float rounding), with one layer in memory."""
    from prunetool.model.streaming import build_streamed

    streamed = build_streamed(source, calibration.input_ids, dtype=dtype, device=device)
    renumbered = dataclasses.replace(calibration, input_ids=streamed.remapped_ids)
    scores = score_model(streamed.model, renumbered, model_name=model_name, batch_size=batch_size,
                         on_batch=on_batch, device=device, dtype=dtype)
    scores.meta["low_memory"] = True
    return scores
