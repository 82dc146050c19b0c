"""The checkpoint's tensors after layer removal: find the decoder's keys, renumber them, drop the rest.

Names are found by one generic rule rather than per-family tables: the decoder stack is the unique
`...layers.` prefix whose indices are exactly 0..num_hidden_layers-1 (`model.layers.`, legacy
multimodal `language_model.model.layers.`, ...), ignoring vision/audio encoders and MTP heads.
Everything else (embeddings, final norm, lm_head, vision tower) is copied unchanged.
"""

import json
import re
from collections.abc import Callable
from pathlib import Path

from prunetool.checkpoint_io import TensorEntry
from prunetool.errors import UnsupportedModelError
from prunetool.sources.checks import SAFETENSORS_INDEX
from prunetool.sources.weights import WeightSet
from prunetool.checkpoint.surgery.safetensors_io import verify_shard, write_shard

def renamer(prefix: str, index_map: dict[int, int]) -> Callable[[str], str | None]:
    """name -> new name, or None for a removed layer's tensor; names outside the prefix pass through."""
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)(\..*)$", re.DOTALL)

    def rename(name: str) -> str | None:
        match = pattern.match(name)
        if not match:
            return name
        new = index_map.get(int(match[1]))
        return None if new is None else f"{prefix}{new}{match[2]}"

    return rename


def check_replacements(weights: WeightSet, rename, replacements: dict | None) -> None:
    """Every replaced tensor must exist in the source, be kept by the cut, and match its source shape."""
    entries = {entry.name: entry for shard in weights.shards for entry in shard.entries}
    for name, tensor in (replacements or {}).items():
        entry = entries.get(name)
        if entry is None:
            raise UnsupportedModelError(f"cannot replace {name}: the source checkpoint has no such tensor")
        if rename(name) is None:
            raise UnsupportedModelError(f"cannot replace {name}: it belongs to a removed layer")
        if list(tensor.shape) != [int(dim) for dim in entry.info["shape"]]:
            raise UnsupportedModelError(f"replacement for {name} has shape {list(tensor.shape)}, the source "
                                        f"{entry.info['shape']}")


def source_tensors(weights: WeightSet, prefix: str, relative: list[str]) -> dict[str, TensorEntry]:
    """Decoder-relative names ("layers.3.mlp.down_proj.weight", "embed_tokens.weight") -> source entries.

    The decoder's on-disk prefix is the layer prefix without its "layers." ("model.", legacy multimodal
    "language_model.model."), so the names follow whatever layout the source uses.
    """
    base = prefix[: -len("layers.")]
    entries = {entry.name: entry for shard in weights.shards for entry in shard.entries}
    found = {}
    for name in relative:
        entry = entries.get(base + name)
        if entry is None:
            raise UnsupportedModelError(f"the source checkpoint has no tensor {base + name} to patch")
        found[name] = entry
    return found


def write_weights(weights: WeightSet, rename, target: Path, on_shard=None, replacements: dict | None = None) -> None:
    """Write every shard (same file name) with renamed tensors, then the index; skip emptied shards.

    `replacements` ({source name: tensor}) swap the data of a few kept tensors (see write_shard).
    """
    check_replacements(weights, rename, replacements)
    weight_map: dict[str, str] = {}
    total_size = total_params = 0
    for shard in weights.shards:
        pairs = [(entry, rename(entry.name)) for entry in shard.entries]
        pairs = [(entry, new) for entry, new in pairs if new is not None]
        if pairs or weights.index is None:  # a single-file checkpoint always keeps its file
            out = target / shard.path.name
            total_size += write_shard(shard, pairs, out, replacements)
            verify_shard(out, [new for _, new in pairs])
            total_params += sum(entry.numel for entry, _ in pairs)
            weight_map.update({new: shard.path.name for _, new in pairs})
        if on_shard is not None:
            on_shard(shard.path.name)
    if weights.index is not None:
        index = pruned_index(weights.index, weight_map, total_size, total_params)
        (target / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def pruned_index(index: dict, weight_map: dict[str, str], total_size: int, total_params: int) -> dict:
    """The source index with the new weight_map and sizes; other keys and metadata kept as they were.

    `total_parameters` (written by transformers 5) is recomputed too when present, since it would
    otherwise describe the unpruned model.
    """
    out = dict(index)
    metadata = dict(index.get("metadata") or {})
    metadata["total_size"] = total_size
    if "total_parameters" in metadata:
        metadata["total_parameters"] = total_params
    out["metadata"] = metadata
    out["weight_map"] = dict(sorted(weight_map.items()))
    return out
