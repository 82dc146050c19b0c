"""What a cut saves, exactly: parameters and bytes from the checkpoint's tensors, KV cache from the config.

Pure functions of a {tensor name: element count} map and config.json, so a budget can be checked before
anything loads. A removed sublayer takes its input norm with it (the nemotron-nas format writes neither); a
removed block takes every tensor under its layer prefix, sandwich norms included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from prunetool.cut import Cut

# the sublayer's module and the norm that feeds it, as the writers remove them (model.sublayers.SUBLAYER_MODULES)
SUBLAYER_PARTS = {"attention": ("self_attn.", "input_layernorm."), "mlp": ("mlp.", "post_attention_layernorm.")}


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer parameter counts and KV bytes per token of one model."""

    total_params: int
    attention_params: tuple[int, ...]  # attention + its input norm, per layer
    mlp_params: tuple[int, ...]  # MLP + its input norm, per layer
    block_params: tuple[int, ...]  # every tensor of the layer
    kv_bytes: tuple[float, ...]  # KV cache bytes one token adds at this layer (at the stated context)
    bytes_per_param: float  # the checkpoint's mean, for weight memory

    @property
    def num_layers(self) -> int:
        return len(self.block_params)

    def params_removed(self, cut: Cut) -> int:
        blocks = set(cut.blocks)
        return (sum(self.block_params[i] for i in blocks)
                + sum(self.attention_params[i] for i in cut.attention if i not in blocks)
                + sum(self.mlp_params[i] for i in cut.mlp if i not in blocks))

    def params(self, cut: Cut) -> int:
        return self.total_params - self.params_removed(cut)

    def kv(self, cut: Cut) -> float:
        """KV cache bytes per token of the cut model."""
        gone = set(cut.attention)
        return sum(value for index, value in enumerate(self.kv_bytes) if index not in gone)

    def memory(self, cut: Cut, context: int, batch: int) -> float:
        """Weights plus a full KV cache for `batch` sequences of `context` tokens, in bytes."""
        return self.params(cut) * self.bytes_per_param + self.kv(cut) * context * batch


def layer_params(numel: dict[str, int], prefix: str, num_layers: int) -> tuple[list[int], list[int], list[int]]:
    """(attention, MLP, block) parameter counts per layer from tensor names under the decoder `prefix`."""
    attention, mlp, block = [0] * num_layers, [0] * num_layers, [0] * num_layers
    for name, count in numel.items():
        if not name.startswith(prefix):
            continue
        index, _, rest = name[len(prefix):].partition(".")
        if not index.isdigit() or int(index) >= num_layers:
            continue
        layer = int(index)
        block[layer] += count
        if rest.startswith(SUBLAYER_PARTS["attention"]):
            attention[layer] += count
        elif rest.startswith(SUBLAYER_PARTS["mlp"]):
            mlp[layer] += count
    return attention, mlp, block


def kv_bytes_per_layer(text_config: dict, bytes_per_value: float, context: int | None = None) -> list[float]:
    """Bytes of keys and values one token adds per layer; a sliding-window layer holds at most its window, so at
    `context` tokens its share per token is window / context."""
    layers = text_config["num_hidden_layers"]
    heads = text_config["num_attention_heads"]
    kv_heads = text_config.get("num_key_value_heads") or heads
    head_dim = text_config.get("head_dim") or text_config["hidden_size"] // heads
    full = 2 * kv_heads * head_dim * bytes_per_value
    window = text_config.get("sliding_window")
    kinds = text_config.get("layer_types") or ["full_attention"] * layers
    values = []
    for kind in kinds:
        if kind == "sliding_attention" and window and context:
            values.append(full * min(1.0, window / context))
        else:
            values.append(float(full))
    return values


def layer_costs(numel: dict[str, int], prefix: str, text_config: dict, bytes_per_param: float,
                kv_bytes_per_value: float, context: int | None = None) -> LayerCosts:
    num_layers = text_config["num_hidden_layers"]
    attention, mlp, block = layer_params(numel, prefix, num_layers)
    return LayerCosts(sum(numel.values()), tuple(attention), tuple(mlp), tuple(block),
                      tuple(kv_bytes_per_layer(text_config, kv_bytes_per_value, context)), bytes_per_param)


def checkpoint_costs(folder, context: int | None = None, kv_dtype_bytes: float | None = None) -> LayerCosts:
    """LayerCosts of a safetensors folder from its headers (no tensor data is read). The KV cache is counted in
    the checkpoint's own precision unless `kv_dtype_bytes` says otherwise."""
    from prunetool.checkpoint_io import DTYPE_BYTES, text_num_layers, text_section
    from prunetool.sources.weights import find_decoder_prefix, read_weights

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    weights = read_weights(folder)
    entries = [entry for shard in weights.shards for entry in shard.entries]
    numel = {entry.name: entry.numel for entry in entries}
    prefix = find_decoder_prefix(list(numel), text_num_layers(config))
    total_bytes = sum(entry.nbytes for entry in entries)
    per_param = total_bytes / max(1, sum(numel.values()))
    layer_dtypes = [DTYPE_BYTES[entry.info["dtype"]] for entry in entries if entry.name.startswith(prefix)]
    kv_bytes = kv_dtype_bytes or (max(layer_dtypes) if layer_dtypes else per_param)
    return layer_costs(numel, prefix, text_section(config), per_param, kv_bytes, context)
