"""Forward hooks that reduce each layer's queries and hidden states to scores as the model runs.

Three taps per decoder layer, installed by `capture_scores` and always removed on exit:
- the query projection's output (pre-RoPE, before any q_norm): per-head self-similarity and lag-1;
- the attention kernel's `query` argument (after q_norm and RoPE), by wrapping the active attention
  function in transformers' attention registry: per-head self-similarity;
- the decoder layer's input and output: Block Influence, and the last token's input for the angular
  distance matrix;
- the MLP norm's input (the residual stream between the two sublayers) in plain pre-norm layers: Block
  Influence and angular distance across each sublayer, which rank attention or MLP sublayers.
Each hook keeps only (B, H) or (B, d) results, never (T, T) matrices or whole hidden states.
"""

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from prunetool.model.architecture import DecoderLayout
from prunetool.errors import UnsupportedModelError
from prunetool.model.metrics import (angular_distance_per_window, block_influence_per_window, mean_consecutive_cosine,
                                     mean_pairwise_cosine)
from prunetool.model.sublayers import SUBLAYER_MODULES, check_sublayer_layout


@dataclass
class LayerTaps:
    """Per-batch results for one layer, in the order the batches ran."""

    q_pre: list = field(default_factory=list)  # (B, H) each
    q_post: list = field(default_factory=list)  # (B, H)
    q_lag1: list = field(default_factory=list)  # (B, H)
    block_influence: list = field(default_factory=list)  # (B,)
    last_input: list = field(default_factory=list)  # (B, d)
    last_output: list = field(default_factory=list)  # (B, d)
    # across each sublayer, only in plain pre-norm layers (the stream between the sublayers is then the MLP norm's input)
    attention_influence: list = field(default_factory=list)  # (B,)
    mlp_influence: list = field(default_factory=list)  # (B,)
    attention_angular: list = field(default_factory=list)  # (B,)
    mlp_angular: list = field(default_factory=list)  # (B,)


def _hidden_from(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _output_tensor(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


def _query_hook(taps: LayerTaps, layout: DecoderLayout):
    def hook(_module, _inputs, output):
        batch, tokens, _ = output.shape
        q = output[..., : layout.query_width].view(batch, tokens, layout.num_heads, layout.head_dim)
        q = q.transpose(1, 2)  # (B, H, T, D)
        taps.q_pre.append(mean_pairwise_cosine(q).cpu())
        taps.q_lag1.append(mean_consecutive_cosine(q).cpu())

    return hook


def _layer_hooks(taps: LayerTaps, pending: dict):
    def pre_hook(module, args, kwargs):
        pending[module] = _hidden_from(args, kwargs)

    def post_hook(module, args, kwargs, output):
        layer_in, layer_out = pending.pop(module), _output_tensor(output)
        taps.block_influence.append(block_influence_per_window(layer_in, layer_out).cpu())
        middle = pending.pop(("middle", module), None)
        if middle is not None:
            for unit, (start, end) in (("attention", (layer_in, middle)), ("mlp", (middle, layer_out))):
                getattr(taps, f"{unit}_influence").append(block_influence_per_window(start, end).cpu())
                getattr(taps, f"{unit}_angular").append(angular_distance_per_window(start[:, -1], end[:, -1]).cpu())
        # copies: a bare slice would keep the whole (B, T, d) hidden state of every layer alive
        taps.last_input.append(layer_in[:, -1, :].to("cpu", torch.float32, copy=True))
        taps.last_output.append(layer_out[:, -1, :].to("cpu", torch.float32, copy=True))

    return pre_hook, post_hook


def _middle_hook(layer, pending: dict):
    """Keeps the residual stream between attention and MLP, the input of the MLP's norm."""
    def hook(_module, args, kwargs):
        pending[("middle", layer)] = _hidden_from(args, kwargs)

    return hook


def plain_pre_norm(layer) -> bool:
    """Whether each sublayer is one residual branch behind its own norm (what a sublayer cut removes)."""
    try:
        check_sublayer_layout(layer, "attention")
        check_sublayer_layout(layer, "mlp")
    except UnsupportedModelError:
        return False
    return True


@contextmanager
def attention_tap(layout: DecoderLayout, tap):
    """Pass every attention call's post-RoPE query and key and its result through `tap(module, query, key, result)`.

    Wraps the attention function registered for the model's implementation (eager included), so the
    tap sees exactly what the kernel received. Taps nest: leaving restores whatever was registered before.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # here: importing it costs 1-2 s

    implementation = layout.attentions[0].config._attn_implementation or "eager"
    before = ALL_ATTENTION_FUNCTIONS.get(implementation)

    def wrapper(module, query, key, value, attention_mask, **kwargs):
        function = before or sys.modules[type(module).__module__].eager_attention_forward
        result = function(module, query, key, value, attention_mask, **kwargs)
        tap(module, query, key, result)
        return result

    ALL_ATTENTION_FUNCTIONS[implementation] = wrapper
    try:
        yield
    finally:
        del ALL_ATTENTION_FUNCTIONS[implementation]
        if ALL_ATTENTION_FUNCTIONS.get(implementation) is not before:
            ALL_ATTENTION_FUNCTIONS[implementation] = before


@contextmanager
def capture_scores(layout: DecoderLayout):
    """Install the taps for every layer; yields one LayerTaps per layer."""
    taps = [LayerTaps() for _ in range(layout.num_layers)]
    taps_by_attention = dict(zip(layout.attentions, taps))
    pending: dict = {}
    handles = []
    for layer, projection, layer_taps in zip(layout.layers, layout.query_projections, taps):
        handles.append(projection.register_forward_hook(_query_hook(layer_taps, layout)))
        pre_hook, post_hook = _layer_hooks(layer_taps, pending)
        handles.append(layer.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(layer.register_forward_hook(post_hook, with_kwargs=True))
        if plain_pre_norm(layer):
            norm = getattr(layer, SUBLAYER_MODULES["mlp"][1])
            handles.append(norm.register_forward_pre_hook(_middle_hook(layer, pending), with_kwargs=True))

    def post_rope_query(module, query, _key, _result):
        layer_taps = taps_by_attention.get(module)
        if layer_taps is not None:
            layer_taps.q_post.append(mean_pairwise_cosine(query).cpu())  # query: (B, H, T, D)

    try:
        with attention_tap(layout, post_rope_query):
            yield taps
    finally:
        for handle in handles:
            handle.remove()


def check_complete(taps: list[LayerTaps], batches: int) -> None:
    """Every tap must have fired once per batch; otherwise the model bypassed a hook and scores would lie."""
    for index, layer_taps in enumerate(taps):
        for name in ("q_pre", "q_post", "block_influence"):
            if len(getattr(layer_taps, name)) != batches:
                raise UnsupportedModelError(
                    f"unsupported architecture: layer {index} did not pass its {name.replace('_', ' ')} "
                    f"through the capture hooks ({len(getattr(layer_taps, name))} of {batches} batches)"
                )
        if len(layer_taps.attention_influence) not in (0, batches):
            raise UnsupportedModelError(f"unsupported architecture: layer {index} ran its MLP norm in only "
                                        f"{len(layer_taps.attention_influence)} of {batches} batches")
