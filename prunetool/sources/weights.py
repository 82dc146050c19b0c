"""A checkpoint's safetensors files as a set of headers, and where its decoder stack's tensors are.

Names are found by one generic rule rather than per-family tables: the decoder stack is the unique
`...layers.` prefix whose indices are exactly 0..num_hidden_layers-1 (`model.layers.`, legacy
multimodal `language_model.model.layers.`, ...), ignoring vision/audio encoders and MTP heads.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

from prunetool.checkpoint_io import ShardHeader, read_header
from prunetool.errors import ModelSourceError, UnsupportedModelError
from prunetool.sources.checks import SAFETENSORS_INDEX

SINGLE_FILE = "model.safetensors"
LAYER_KEY = re.compile(r"^(?P<prefix>.*?\blayers\.)(?P<idx>\d+)\.")
NOT_DECODER = re.compile(r"vision|visual|audio|encoder|mtp", re.IGNORECASE)


@dataclass(frozen=True)
class WeightSet:
    """The safetensors files of a checkpoint, headers read, plus its index (None when single-file)."""

    folder: Path
    shards: tuple[ShardHeader, ...]
    index: dict | None

    @property
    def names(self) -> list[str]:
        return [entry.name for shard in self.shards for entry in shard.entries]


def has_safetensors(folder: Path) -> bool:
    return (folder / SAFETENSORS_INDEX).is_file() or (folder / SINGLE_FILE).is_file()


def read_weights(folder: Path) -> WeightSet:
    """Headers of every shard the index names (or of model.safetensors); no tensor data is read."""
    index_path = folder / SAFETENSORS_INDEX
    if not index_path.is_file():
        return WeightSet(folder, (read_header(folder / SINGLE_FILE),), None)
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelSourceError(f"{index_path} is not valid JSON ({e}); re-download it") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelSourceError(f"{index_path} has no weight_map; re-download it")
    shards = []
    for name in sorted(set(weight_map.values())):
        if not (folder / name).is_file():
            raise ModelSourceError(f"shard {name} named in {index_path} is missing; re-download the model")
        shards.append(read_header(folder / name))
    _check_index(index_path, weight_map, shards)
    return WeightSet(folder, tuple(shards), index)


def _check_index(index_path: Path, weight_map: dict, shards: list[ShardHeader]) -> None:
    """Every tensor the index names must be in the shard it names; otherwise loading would fail later."""
    found = {entry.name: shard.path.name for shard in shards for entry in shard.entries}
    for name, shard in weight_map.items():
        if found.get(name) != shard:
            raise ModelSourceError(f"{index_path} puts {name} in {shard}, but that shard does not hold it; re-download")


def _describe(indices: set[int]) -> str:
    ordered = sorted(indices)
    if ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}..{ordered[-1]}" if len(ordered) > 1 else str(ordered[0])
    return ",".join(map(str, ordered))


def find_decoder_prefix(names: list[str], num_layers: int) -> str:
    """The key prefix of the decoder stack, or a refusal that lists every `layers.` prefix found."""
    groups: dict[str, set[int]] = {}
    for name in names:
        match = LAYER_KEY.match(name)
        if match:
            groups.setdefault(match["prefix"], set()).add(int(match["idx"]))
    found = "; ".join(f"{prefix}{{{_describe(idx)}}}" for prefix, idx in sorted(groups.items())) or "none"
    candidates = {prefix: idx for prefix, idx in groups.items() if not NOT_DECODER.search(prefix)}
    wanted = set(range(num_layers))
    extra = {prefix: idx - wanted for prefix, idx in candidates.items() if idx > wanted}
    if extra:
        prefix, indices = next(iter(extra.items()))
        raise UnsupportedModelError(
            f"{prefix} has layers {_describe(indices)} beyond num_hidden_layers={num_layers} (MTP or extra "
            "layers); pruning such checkpoints is not supported"
        )
    exact = [prefix for prefix, idx in candidates.items() if idx == wanted]
    if len(exact) != 1:
        what = "no" if not exact else "several"
        raise UnsupportedModelError(
            f"{what} decoder layer prefix with indices 0..{num_layers - 1} found; tensors with layer indices: {found}"
        )
    return exact[0]
