"""Cheap checks of a local Hugging Face folder, run before any weights are loaded.

Each failure is one actionable line naming the file, so users see "re-download X" instead of a
traceback from deep inside transformers minutes later. No tensor data is read.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from prunetool.checkpoint_io import read_header
from prunetool.errors import ModelSourceError, UnsupportedModelError
from prunetool.sources.cache import transformers_version

SAFETENSORS_INDEX = "model.safetensors.index.json"
CAUSAL_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")
ENCODER_ONLY_TYPES = {
    "albert", "bert", "big-bird", "camembert", "canine", "convbert", "data2vec-text", "deberta",
    "deberta-v2", "distilbert", "electra", "ernie", "esm", "flaubert", "fnet", "funnel", "ibert",
    "layoutlm", "longformer", "luke", "megatron-bert", "mobilebert", "modernbert", "mpnet", "mra",
    "nezha", "nomic-bert", "nystromformer", "rembert", "roberta", "roberta-prelayernorm", "roc-bert",
    "roformer", "splinter", "squeezebert", "xlm", "xlm-roberta", "xlm-roberta-xl", "xmod", "yoso",
}  # fmt: skip
ENCODER_DECODER_TYPES = {
    "bart", "bigbird-pegasus", "blenderbot", "blenderbot-small", "encoder-decoder", "fsmt", "led",
    "longt5", "m2m-100", "marian", "mbart", "mt5", "nllb-moe", "pegasus", "pegasus-x", "plbart",
    "prophetnet", "seamless-m4t", "speech-to-text", "switch-transformers", "t5", "t5gemma", "umt5",
    "whisper",
}  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass
class FolderReport:
    """What validation learned: the parsed config and remarks worth showing the user."""

    config: dict
    notes: list[str] = field(default_factory=list)


def validate_folder(folder: Path, *, trust_remote_code: bool = False) -> FolderReport:
    """All folder checks in the order a user would fix them: config, weights, architecture."""
    config = read_config(folder)
    notes = check_weights(folder)
    check_causal_lm(config, str(folder))
    notes += check_custom_code(config, folder, trust_remote_code)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        notes.append(f"{folder} has no tokenizer files; scoring needs a tokenizer")
    return FolderReport(config, notes)


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelSourceError(f"{folder} is not a model folder: no config.json")
    data = _read_json(path, "config.json")
    if not isinstance(data, dict):
        raise ModelSourceError(f"{path} is not a JSON object (found {type(data).__name__}); re-download it")
    return data


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ModelSourceError(f"{path} is not valid JSON: not UTF-8 text at byte {e.start}; re-download it") from e
    except json.JSONDecodeError as e:
        where = f"line {e.lineno} column {e.colno} (char {e.pos})"
        raise ModelSourceError(f"{path} is not valid JSON: {e.msg} at {where}; fix or re-download {what}") from e


def check_weights(folder: Path) -> list[str]:
    """Find the safetensors files (single or sharded) and check each header; .bin only gets a note."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        files = _shards_from_index(index)
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
        if bins:
            return [f"{folder} has only PyTorch .bin weights ({bins[0]}); prune needs safetensors weights"]
        raise ModelSourceError(
            f"{folder} has no weights: expected model.safetensors or {SAFETENSORS_INDEX} with its shards"
        )
    for path in files:
        check_safetensors_file(path)
    return []


def _shards_from_index(index: Path) -> list[Path]:
    data = _read_json(index, SAFETENSORS_INDEX)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelSourceError(f"{index} has no weight_map; re-download it")
    shards = [index.parent / name for name in sorted(set(map(str, weight_map.values())))]
    for shard in shards:
        if not shard.is_file():
            raise ModelSourceError(
                f"shard {shard.name} named in {index} is missing from {index.parent}; re-download the model"
            )
    return shards


def check_safetensors_file(path: Path) -> None:
    """Parse the header and check the file size is exactly 8 + header + data (catches truncation)."""
    read_header(path)


def _norm(model_type) -> str:
    return str(model_type or "").lower().replace("_", "-")


def check_causal_lm(config: dict, where: str) -> None:
    """Refuse encoder-only, encoder-decoder and head-less checkpoints before anything is loaded."""
    model_type = config.get("model_type")
    archs = [str(a) for a in config.get("architectures") or []]
    described = f"model_type {model_type!r}, architectures {', '.join(archs) or 'none listed'}"
    need = "prunetool needs a decoder-only causal LM"
    if config.get("is_encoder_decoder") or _norm(model_type) in ENCODER_DECODER_TYPES:
        raise UnsupportedModelError(f"{where} holds an encoder-decoder model ({described}); {need}")
    masked = any("ForMaskedLM" in a for a in archs)
    if _norm(model_type) in ENCODER_ONLY_TYPES or masked:
        raise UnsupportedModelError(f"{where} holds an encoder-only model ({described}); {need}")
    if archs and not any(a.endswith(CAUSAL_SUFFIXES) for a in archs):
        raise UnsupportedModelError(
            f"{where} holds a model without a language-model head ({described}); {need} (*ForCausalLM)"
        )


def check_custom_code(config: dict, folder: Path, trust_remote_code: bool) -> list[str]:
    """The model_type must be one transformers knows, unless the repo ships its own code (auto_map).

    Running shipped code needs explicit consent. When transformers has a built-in class for the
    model_type it ignores auto_map unless trust_remote_code is set, so that case only gets a note.
    """
    model_type = config.get("model_type")
    if not config.get("auto_map"):
        if model_type and model_type not in _known_model_types():
            raise UnsupportedModelError(
                f"{folder}/config.json has model_type {model_type!r}, unknown to transformers "
                f"{transformers_version()}; upgrade transformers"
            )
        return []
    if trust_remote_code or ships_our_code(folder):
        return []
    if model_type and model_type in _known_model_types():
        return [f"{folder}/config.json has auto_map (custom code); using transformers' built-in {model_type!r}"]
    raise UnsupportedModelError(
        f"{folder}/config.json needs custom modeling code (auto_map, model_type {model_type!r}); "
        "review it and pass --trust-remote-code to run it"
    )


# the code prunetool writes beside a nemotron-nas folder (checkpoint/nemotron_nas), read here as files
OUR_CODE = Path(__file__).resolve().parents[1] / "checkpoint" / "nemotron_nas"
OUR_CODE_FILES = ("configuration_decilm.py", "modeling_decilm.py")


def ships_our_code(folder: Path) -> bool:
    """The folder's custom code is byte for byte the code this prunetool writes, so running it needs no
    --trust-remote-code (it is ours, not the checkpoint author's)."""
    return all((Path(folder) / name).is_file() and (Path(folder) / name).read_bytes() == (OUR_CODE / name).read_bytes()
               for name in OUR_CODE_FILES)


def _known_model_types() -> set[str]:
    """The generated model_type table; importing it alone avoids loading torch for a folder check."""
    try:
        from transformers.models.auto.auto_mappings import CONFIG_MAPPING_NAMES
    except ImportError:  # older transformers keeps the table in configuration_auto
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    return set(CONFIG_MAPPING_NAMES)
