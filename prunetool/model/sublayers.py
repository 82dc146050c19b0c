"""Skip attention or MLP sublayers of a loaded model: the unit of `prune --unit attention|mlp`.

A pre-norm decoder layer computes h + attn(norm1(h)), then h' + mlp(norm2(h')). Skipping a sublayer
makes its residual branch zero, so the stream passes through unchanged, which is what a nemotron-nas
checkpoint's `no_op` block does. The sublayer and its input norm are swapped for modules that cost
nothing (the norm for Identity, the sublayer for one that returns zeros), so measuring a candidate cut
also runs faster, and swapped back, by identity, on exit.

Only the plain pre-norm layout is expressible: layers whose sublayer has a second, post-sublayer norm
(Gemma 2/3's sandwich norms) are refused, since skipping them there is not what the format can write.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from prunetool.errors import OptionError, UnsupportedModelError
from prunetool.model.architecture import decoder_of

UNITS = ("block", "attention", "mlp")
# unit -> (the sublayer's attribute on a decoder layer, the attribute of the norm that feeds it)
SUBLAYER_MODULES = {"attention": ("self_attn", "input_layernorm"), "mlp": ("mlp", "post_attention_layernorm")}
SANDWICH_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


class ZeroAttention(nn.Module):
    """An attention sublayer that contributes nothing and keeps no KV cache."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        return torch.zeros_like(hidden_states), None


class ZeroMLP(nn.Module):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(hidden_states)


def check_unit(unit: str) -> str:
    if unit not in UNITS:
        raise OptionError(f"--unit must be one of {', '.join(UNITS)}, got {unit!r}")
    return unit


def check_sublayer_layout(layer: nn.Module, unit: str) -> None:
    """Refuse layers whose sublayer cannot be skipped as a plain pre-norm residual branch."""
    module, norm = SUBLAYER_MODULES[unit]
    if not isinstance(getattr(layer, module, None), nn.Module) or not isinstance(getattr(layer, norm, None), nn.Module):
        raise UnsupportedModelError(f"--unit {unit} needs decoder layers with `{module}` and `{norm}`; "
                                    f"{type(layer).__name__} has other names")
    found = [name for name in SANDWICH_NORMS if isinstance(getattr(layer, name, None), nn.Module)]
    if found:
        raise UnsupportedModelError(f"--unit {unit}: {type(layer).__name__} has sandwich norms ({', '.join(found)}), "
                                    "which a skipped sublayer in the nemotron-nas format cannot express")


@contextmanager
def sublayer_skipped(layer: nn.Module, unit: str):
    """Run the body with `layer`'s attention (or MLP) sublayer and its input norm skipped."""
    module, norm = SUBLAYER_MODULES[unit]
    saved = (getattr(layer, module), getattr(layer, norm))
    setattr(layer, module, ZeroAttention() if unit == "attention" else ZeroMLP())
    setattr(layer, norm, nn.Identity())
    try:
        yield
    finally:
        setattr(layer, module, saved[0])
        setattr(layer, norm, saved[1])


def check_sublayers(removed: Iterable[int], num_layers: int, unit: str) -> tuple[int, ...]:
    """Sorted distinct layer indices whose `unit` sublayer goes; every attention sublayer may not go."""
    removed = tuple(removed)
    if any(isinstance(i, bool) or not isinstance(i, int) for i in removed) or len(set(removed)) != len(removed):
        raise OptionError(f"sublayer indices must be distinct integers, got {list(removed)}")
    if any(i < 0 or i >= num_layers for i in removed):
        raise OptionError(f"{unit} sublayer indices must be in 0..{num_layers - 1} (0-based), got {list(removed)}")
    if unit == "attention" and len(removed) >= num_layers:
        raise OptionError(f"cannot remove all {num_layers} attention sublayers; at least one must stay")
    return tuple(sorted(removed))


@contextmanager
def sublayers_removed(model: nn.Module, removed: Iterable[int], unit: str):
    """Run the body with the `unit` sublayers of the given original 0-based layers skipped."""
    layers = decoder_of(model).layers
    removed = check_sublayers(removed, len(layers), unit)
    with ExitStack() as stack:
        for index in removed:
            check_sublayer_layout(layers[index], unit)
            stack.enter_context(sublayer_skipped(layers[index], unit))
        yield removed

