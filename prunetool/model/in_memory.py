"""Remove decoder layers from a loaded model, temporarily (a context manager) or for good.

transformers 5.x ties a layer's behaviour to its position in three places (notes, section 1): the
attention module's `layer_idx` indexes the KV cache, the config's per-layer lists (`layer_types`) pick
the mask and RoPE by the layer's *new* position, and `num_hidden_layers` sizes the cache. So removal
is: a new ModuleList of the kept layers, `layer_idx` renumbered on every submodule that has one, every
per-layer config list sliced by the kept original indices (each survivor keeps its own sliding/full
type, fixed at construction), index lists remapped, Qwen's `max_window_layers` recounted.

The temporary form exists for the perplexity search (SLEB-style, one model, hundreds of trial
removals): it must hand back the model exactly as it was, so every changed object is recorded first
and put back, by identity, on exit.
"""

from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch import nn

from prunetool.model.architecture import decoder_of
from prunetool.errors import OptionError

# Config lists holding layer *indices* rather than one entry per layer: remapped, never sliced.
INDEX_LISTS = ("mlp_only_layers",)


@dataclass
class _Saved:
    """Everything a removal changes, as it was before (originals by identity)."""

    decoder: nn.Module
    layers: nn.ModuleList
    layer_idx: list[tuple[nn.Module, int]] = field(default_factory=list)
    config: object = None
    fields: dict = field(default_factory=dict)  # config attribute -> original value


def _check_removed(removed: Iterable[int], num_layers: int) -> tuple[int, ...]:
    removed = tuple(removed)
    if any(isinstance(i, bool) or not isinstance(i, int) for i in removed):
        raise OptionError(f"layer indices must be integers, got {list(removed)}")
    if len(set(removed)) != len(removed):
        raise OptionError(f"layer indices must be distinct, got {list(removed)}")
    if any(i < 0 or i >= num_layers for i in removed):
        raise OptionError(f"layer indices must be in 0..{num_layers - 1} (0-based), got {list(removed)}")
    if len(removed) >= num_layers:
        raise OptionError(f"cannot remove all {num_layers} layers; at least one must stay")
    return tuple(sorted(removed))


def config_edits(config, keep: list[int], num_layers: int) -> dict:
    """New values for every layer-dependent config field, given the kept original indices.

    Generic rule (style note 4): a list field whose name mentions "layer" and whose length is the layer
    count is per-layer (layer_types, mlp_layer_types, no_rope_layers, ...) and is sliced; known index
    lists are remapped. Only "layer" names are considered so that e.g. a 2-entry `eos_token_id` list on
    a 2-layer model is never mistaken for a per-layer list.
    """
    new_index = {old: new for new, old in enumerate(keep)}
    edits: dict = {}
    for name, value in vars(config).items():
        if not isinstance(value, (list, tuple)) or "layer" not in name:
            continue
        if name in INDEX_LISTS:
            edits[name] = type(value)(new_index[i] for i in value if i in new_index)
        elif len(value) == num_layers:
            edits[name] = type(value)(value[i] for i in keep)
    window = getattr(config, "max_window_layers", None)
    if isinstance(window, int):  # Qwen2/3: layers below it use full attention; count the survivors
        edits["max_window_layers"] = sum(1 for i in keep if i < window)
    edits["num_hidden_layers"] = len(keep)
    return edits


def _apply(model: nn.Module, removed: Iterable[int]) -> tuple[_Saved, list[int]]:
    """Remove the layers; returns what to restore. On any failure the model is restored first."""
    decoder = decoder_of(model)
    config = model.config.get_text_config(decoder=True)
    num_layers = len(decoder.layers)
    gone = set(_check_removed(removed, num_layers))
    keep = [i for i in range(num_layers) if i not in gone]
    edits = config_edits(config, keep, num_layers)
    saved = _Saved(decoder, decoder.layers, config=config, fields={k: getattr(config, k) for k in edits})
    for layer in decoder.layers:
        saved.layer_idx += [(m, m.layer_idx) for m in layer.modules() if hasattr(m, "layer_idx")]
    try:
        decoder.layers = nn.ModuleList([saved.layers[i] for i in keep])
        for new, layer in enumerate(decoder.layers):
            for module in layer.modules():
                if hasattr(module, "layer_idx"):
                    module.layer_idx = new
        for name, value in edits.items():  # strict configs check only the type on assignment
            setattr(config, name, value)
    except BaseException:
        _restore(saved)
        raise
    return saved, keep


def _restore(saved: _Saved) -> None:
    saved.decoder.layers = saved.layers
    for module, index in saved.layer_idx:
        module.layer_idx = index
    for name, value in saved.fields.items():
        setattr(saved.config, name, value)


@contextmanager
def layers_removed(model: nn.Module, removed: Iterable[int]):
    """Run the body with the given original 0-based layers gone; on exit the model is exactly as before.

    Yields the kept original indices (new index i is original layer keep[i]). Works on the decoder of
    plain causal LMs and of multimodal wrappers (Gemma 3) through get_decoder() and the decoder's
    text config. Indices refer to the model as it is when entered.
    """
    saved, keep = _apply(model, removed)
    try:
        yield tuple(keep)
    finally:
        _restore(saved)


def prune_in_memory(model: nn.Module, removed: Iterable[int]) -> tuple[int, ...]:
    """Remove the layers for good (same edits as `layers_removed`); returns the kept original indices.

    The removed layers' modules are dropped with the old ModuleList, so their memory is freed once
    nothing else refers to them. The config is left consistent, so save_pretrained validates and a
    reload rebuilds the same model.
    """
    _, keep = _apply(model, removed)
    return tuple(keep)
