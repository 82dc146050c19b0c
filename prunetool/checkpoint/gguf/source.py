"""The folder being exported: its text config (defaults filled in) and its decoder's tensors by canonical name.

Tensors are renamed to the plain causal-LM spelling (`model.layers.N...`, `model.embed_tokens`, `model.norm`,
`lm_head`) so one name map serves a Gemma 3 wrapper, whose decoder sits under `model.language_model.`, and
a text-only folder alike. Only headers are read here; tensor bytes are read one at a time while writing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from prunetool.checkpoint.gguf.layout import check_model_type
from prunetool.checkpoint_io import text_section
from prunetool.errors import ModelSourceError, OptionError, UnsupportedModelError
from prunetool.sources.weights import LAYER_KEY, NOT_DECODER, find_decoder_prefix, has_safetensors, read_weights

NEMOTRON_NAS = "nemotron-nas"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved; llama.cpp computes them


@dataclass(frozen=True)
class SourceTensor:
    """Where one tensor's bytes are: the shard, its name there, and its header shape."""

    path: Path
    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Source:
    """A folder as export sees it: the raw config.json, the decoder's transformers config and tensors."""

    folder: Path
    raw_config: dict
    config: object  # the decoder's transformers config (a PretrainedConfig), defaults filled in
    tensors: dict[str, SourceTensor]  # canonical name -> where it is
    left_out: tuple[str, ...]  # tensors outside the decoder (a vision tower), not exported

    @property
    def wrapped(self) -> bool:
        """A multimodal wrapper: the decoder's config sits under text_config."""
        return text_section(self.raw_config) is not self.raw_config


def check_folder(folder: Path) -> Path:
    """A readable Hugging Face folder with config.json and safetensors, else one line saying what is missing."""
    folder = Path(folder).expanduser()
    if not folder.exists():
        raise OptionError(f"{folder} does not exist; pass the folder prune or heal wrote")
    if not folder.is_dir():
        raise OptionError(f"{folder} is not a folder; pass the folder prune or heal wrote (config.json, safetensors)")
    if not (folder / "config.json").is_file():
        raise ModelSourceError(f"{folder} has no config.json; pass the folder prune or heal wrote")
    if not has_safetensors(folder):
        raise ModelSourceError(f"{folder} has no safetensors weights (model.safetensors or its index); export reads "
                               "only safetensors")
    return folder.resolve()


def read_raw_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelSourceError(f"{folder / 'config.json'} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ModelSourceError(f"{folder / 'config.json'} is not a JSON object")
    return config


def text_model_type(raw: dict) -> str | None:
    """The decoder's model_type: a wrapper's text_config's (gemma3 -> gemma3_text), else the top level's."""
    return text_section(raw).get("model_type") or raw.get("model_type")


def load_text_config(folder: Path, raw: dict):
    """The decoder's config with transformers' defaults, never running code from the folder.

    nemotron-nas folders carry our own configuration class; it is imported from prunetool rather than
    from the folder, so no trust_remote_code is needed (and none is asked for interactively).
    """
    check_model_type(text_model_type(raw))
    if text_model_type(raw) == NEMOTRON_NAS:
        from prunetool.checkpoint.nemotron_nas.configuration_decilm import DeciLMConfig

        return DeciLMConfig(**{key: value for key, value in raw.items() if key not in ("auto_map",)})
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UnsupportedModelError(f"transformers cannot read {folder / 'config.json'} "
                                    f"(model_type {raw.get('model_type')!r}): {first}") from None
    return config.get_text_config(decoder=True)


def canonical_name(name: str, root: str) -> str | None:
    """`{root}layers.3.x` -> `model.layers.3.x`; `lm_head.weight` stays; None for tensors outside the decoder."""
    if name.startswith(root):
        return "model." + name[len(root):]
    if name == "lm_head.weight":
        return name
    return None


def decoder_prefix(names: list[str], num_layers: int, sparse: bool) -> str:
    """The decoder stack's `...layers.` prefix; a sublayer cut may lack layers whose sublayers are all removed."""
    if not sparse:
        return find_decoder_prefix(names, num_layers)
    found = {match["prefix"] for name in names if (match := LAYER_KEY.match(name)) and not NOT_DECODER.search(name)}
    if len(found) != 1:
        raise UnsupportedModelError(f"cannot tell the decoder's layers apart: layer prefixes {sorted(found)}")
    prefix = found.pop()
    beyond = sorted({int(m["idx"]) for name in names if (m := LAYER_KEY.match(name)) and int(m["idx"]) >= num_layers})
    if beyond:
        raise UnsupportedModelError(f"{prefix} has layers {beyond} beyond num_hidden_layers={num_layers}")
    return prefix


def decoder_tensors(folder: Path, num_layers: int, sparse: bool) -> tuple[dict[str, SourceTensor], tuple[str, ...]]:
    """Canonical name -> SourceTensor for the decoder, plus the names left out (vision tower, projector)."""
    weights = read_weights(folder)
    prefix = decoder_prefix(weights.names, num_layers, sparse)
    root = prefix[: -len("layers.")]
    tensors: dict[str, SourceTensor] = {}
    left_out: list[str] = []
    for shard in weights.shards:
        for entry in shard.entries:
            name = canonical_name(entry.name, root)
            if name is None or name.endswith(IGNORED_SUFFIXES):
                left_out.append(entry.name)
                continue
            tensors[name] = SourceTensor(shard.path, entry.name, tuple(int(d) for d in entry.info["shape"]))
    return tensors, tuple(left_out)


def read_source(folder: Path) -> Source:
    """Check and read a folder's config and tensor headers; no tensor data is read."""
    folder = check_folder(folder)
    raw = read_raw_config(folder)
    config = load_text_config(folder, raw)
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        raise UnsupportedModelError(f"{folder / 'config.json'} has no num_hidden_layers for its decoder")
    tensors, left_out = decoder_tensors(folder, layers, sparse=config.model_type == NEMOTRON_NAS)
    return Source(folder, raw, config, tensors, left_out)
