"""Calibration windows -> per-head evidence: attention profiles, RoPE channel mass, swap-test agreement.

One eager-attention forward pass per window, inside the same capture hooks `prunetool score` uses (so
the per-head q-similarities are the score machinery's own), plus one attention tap that reduces each
(H, T, T) attention map to its two profiles at once and keeps only small things: the profiles, the
last token's attention row, channel norms, and two thumbnails of the first window's maps. After each
window the swap test reruns each analysed layer on a batch of swapped copies of its input.
"""

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from prunetool.model.architecture import DecoderLayout, inspect_decoder
from prunetool.model.capture import LayerTaps, attention_tap, capture_scores, check_complete
from prunetool.errors import UnsupportedModelError
from prunetool.kv.schedules import RECENT_QUERIES
from prunetool.heads.patterns import attention_profiles, profile_rows
from prunetool.heads.rope import channel_norms, channel_thetas, rope_angles
from prunetool.heads.swap import SwapTally, block_size, choose_swaps, swapped_states
from prunetool.model.metrics import mean_pairwise_cosine
from prunetool.model.loading import input_device

OVERVIEW = 128  # thumbnail of the whole map, average-pooled to at most this many pixels a side
ZOOM = 64  # exact top-left corner: the first tokens, the sink column, short diagonals
SWAP_ATTENTION_BYTES = 1 << 30  # swapped copies per rerun: as many as keep its attention weights under 1 GiB


@dataclass
class LayerEvidence:
    """Sums over windows for one analysed layer (divide by `windows` for means)."""

    column: torch.Tensor | None = None  # (H, T - rows)
    offset: torch.Tensor | None = None  # (H, T - rows)
    query_norms: torch.Tensor | None = None  # (H, C)
    key_norms: torch.Tensor | None = None  # (H_kv, C)
    thetas: torch.Tensor | None = None  # (C,), None when the layer gets no cos/sin tables
    overview: torch.Tensor | None = None  # (H, <=OVERVIEW, <=OVERVIEW), first window
    zoom: torch.Tensor | None = None  # (H, <=ZOOM, <=ZOOM), first window
    last_row: torch.Tensor | None = None  # (H, T), current window only
    swaps: SwapTally = field(default_factory=SwapTally)
    windows: int = 0


@dataclass
class _Probe:
    """What the hooks share: mode, the analysed layers, each layer's input in the current window."""

    layout: DecoderLayout
    selected: dict[int, LayerEvidence]
    recent: list[list[torch.Tensor]]  # per layer: (B, H) post-RoPE q-similarity of the last queries
    rows: int
    mode: str = "probe"  # or "swap"
    inputs: dict = field(default_factory=dict)  # layer -> (hidden, other layer kwargs, rotary dims)
    swapped: dict = field(default_factory=dict)  # layer -> (S, H, T) last rows of the swapped batch
    first_window: bool = True


def _add(total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value if total is None else total + value


def _observe(probe: _Probe, layer: int, query, key, weights) -> None:
    evidence = probe.selected.get(layer)
    if probe.mode == "swap":
        if evidence is not None:
            probe.swapped[layer] = weights[:, :, -1, :].float().cpu()
        return
    probe.recent[layer].append(mean_pairwise_cosine(query[..., -RECENT_QUERIES:, :]).cpu())
    if evidence is None:
        return
    weights = weights[0].float()  # one window per pass: (H, T, T)
    column, offset = attention_profiles(weights, probe.rows)
    evidence.column, evidence.offset = _add(evidence.column, column.cpu()), _add(evidence.offset, offset.cpu())
    rotary_dims = probe.inputs[layer][2]
    evidence.query_norms = _add(evidence.query_norms, channel_norms(query, rotary_dims).cpu())
    evidence.key_norms = _add(evidence.key_norms, channel_norms(key, rotary_dims).cpu())
    evidence.last_row = weights[:, -1, :].cpu()
    if probe.first_window:
        side = min(OVERVIEW, weights.shape[-1])
        evidence.overview = F.adaptive_avg_pool2d(weights, side).cpu()
        evidence.zoom = weights[:, :ZOOM, :ZOOM].cpu().clone()
    evidence.windows += 1


def _layer_input_hook(probe: _Probe, layer: int):
    def hook(_module, args, kwargs):
        if probe.mode != "probe":
            return
        hidden = args[0] if args else kwargs["hidden_states"]
        rest = {name: value for name, value in kwargs.items() if name != "hidden_states"}
        embeddings = kwargs.get("position_embeddings")
        evidence = probe.selected[layer]
        rotary_dims = probe.layout.head_dim
        if embeddings is not None:
            cos, sin = embeddings
            rotary_dims = cos.shape[-1]
            if evidence.thetas is None:
                evidence.thetas = channel_thetas(rope_angles(cos, sin).cpu(), probe.layout.head_dim)
        probe.inputs[layer] = (hidden, rest, rotary_dims)

    return hook


def _swap_test(probe: _Probe, layer: int) -> None:
    """Rerun one layer on swapped copies of this window's input; tally against the unswapped last row."""
    evidence = probe.selected[layer]
    hidden, kwargs, _ = probe.inputs[layer]
    block = block_size(hidden.shape[1])
    swaps = choose_swaps(evidence.last_row, block)
    if not swaps:
        return
    batch = swapped_states(hidden, swaps, block)
    tokens = hidden.shape[1]
    per_pass = max(1, SWAP_ATTENTION_BYTES // (probe.layout.num_heads * tokens * tokens * 4))
    rows = []
    probe.mode = "swap"
    try:
        for start in range(0, len(swaps), per_pass):  # bound the eager (S, H, T, T) weights of one pass
            probe.layout.layers[layer](batch[start : start + per_pass], **kwargs)
            rows.append(probe.swapped.pop(layer))
    finally:
        probe.mode = "probe"
    evidence.swaps.add(evidence.last_row, torch.cat(rows), swaps, block)


@dataclass
class HeadEvidence:
    num_heads: int
    kv_heads: int
    head_dim: int
    selected: dict[int, LayerEvidence]
    recent_similarity: list[list[float]]  # per layer, per head: mean over windows
    taps: list[LayerTaps]  # the score machinery's taps, all windows
    seconds: float


def _kv_heads(layout: DecoderLayout) -> int:
    config = layout.attentions[0].config
    return getattr(config, "num_key_value_heads", None) or layout.num_heads


@torch.inference_mode()
def probe_heads(model: torch.nn.Module, windows: torch.Tensor, layers: tuple[int, ...],
                on_window: Callable[[], None] | None = None) -> HeadEvidence:
    """Run each window through the decoder with eager attention and collect the evidence for `layers`."""
    layout = inspect_decoder(model)
    if (layout.attentions[0].config._attn_implementation or "eager") != "eager":
        raise UnsupportedModelError("the heads probe needs eager attention (load the model with attn_implementation='eager')")
    decoder = model.get_decoder()
    device = input_device(model)
    probe = _Probe(layout, {index: LayerEvidence() for index in layers}, [[] for _ in range(layout.num_layers)],
                   profile_rows(windows.shape[-1]))
    index_of = {attention: index for index, attention in enumerate(layout.attentions)}

    def tap(module, query, key, result):
        layer = index_of.get(module)
        if layer is None:
            return
        weights = result[1] if isinstance(result, tuple) and len(result) > 1 else None
        if weights is None:
            raise UnsupportedModelError(f"layer {layer}'s attention returned no weights; the heads probe needs eager attention")
        _observe(probe, layer, query, key, weights)

    merged = [LayerTaps() for _ in range(layout.num_layers)]
    handles = [layout.layers[index].register_forward_pre_hook(_layer_input_hook(probe, index), with_kwargs=True)
               for index in layers]
    started = time.perf_counter()
    try:
        with attention_tap(layout, tap):
            for window in windows:
                with capture_scores(layout) as taps:
                    decoder(input_ids=window[None].to(device), use_cache=False)
                check_complete(taps, 1)
                for total, part in zip(merged, taps):
                    for name in vars(total):
                        getattr(total, name).extend(getattr(part, name))
                for index in layers:
                    _swap_test(probe, index)
                probe.inputs.clear()
                probe.first_window = False
                if on_window:
                    on_window()
    finally:
        for handle in handles:
            handle.remove()
    recent = [torch.cat(values).double().mean(0).tolist() for values in probe.recent]
    return HeadEvidence(layout.num_heads, _kv_heads(layout), layout.head_dim, probe.selected, recent, merged,
                        time.perf_counter() - started)
