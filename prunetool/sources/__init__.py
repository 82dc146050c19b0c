"""MODEL -> local Hugging Face folder (config.json + safetensors + tokenizer).

MODEL may be a demo alias, a folder, a .gguf file or a Hub id; everything downstream sees only folders.
"""

import hashlib
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from prunetool.errors import ModelSourceError
from prunetool.sources import demo, gguf, hub
from prunetool.sources.checks import validate_folder
from prunetool.sources.demo import DEMO_MODELS, DemoModel, list_demo_models
from prunetool.sources.progress import note

__all__ = ["DEFAULT_MODEL", "DEMO_MODELS", "DemoModel", "ModelSource", "list_demo_models", "model_key", "resolve_model"]

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ModelSource:
    """A resolved MODEL: always a validated local folder, whatever the user typed."""

    spec: str  # what the user typed: alias, folder path, hub id, or .gguf path
    kind: str  # "folder" | "hub" | "gguf" | "alias"
    path: Path  # a local Hugging Face folder
    config: dict  # the parsed config.json
    notes: tuple[str, ...] = ()  # non-fatal remarks (e.g. only .bin weights), already shown on stderr


def model_key(source: ModelSource) -> str:
    """A filesystem-safe, stable name for caches derived from a model (e.g. its generated calibration text)."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(source.spec).name or source.spec).strip("-")[:48] or "model"
    return f"{stem}-{hashlib.sha1(str(Path(source.path).resolve()).encode()).hexdigest()[:8]}"


def resolve_model(spec: str | None = None, *, trust_remote_code: bool = False) -> ModelSource:
    """Dispatch on what MODEL looks like; aliases first, since they are not paths."""
    spec = DEFAULT_MODEL if spec is None else str(spec).strip()
    if not spec:
        raise ModelSourceError(
            "MODEL is empty; pass a folder, a .gguf file, a hub id or a demo alias (prunetool models)"
        )
    alias = demo.find_alias(spec)
    if alias is not None:
        return _cached(spec, "alias", lambda: demo.ensure_demo(alias))
    path = Path(spec).expanduser()
    if path.is_dir():
        return _checked(spec, "folder", path.resolve(), trust_remote_code)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _cached(spec, "gguf", lambda: gguf.ensure_gguf_folder(path, spec))
        raise ModelSourceError(
            f"{spec} is a file, not a model folder or .gguf file; pass the folder that holds config.json"
        )
    if hub.looks_like_hub_id(spec):
        folder = hub.download(spec, trust_remote_code=trust_remote_code)
        return _checked(spec, "hub", folder, trust_remote_code)
    raise ModelSourceError(
        f"model not found: {spec} (not a folder, .gguf file, demo alias or hub id; see 'prunetool models')"
    )


def _checked(spec: str, kind: str, folder: Path, trust_remote_code: bool) -> ModelSource:
    report = validate_folder(folder, trust_remote_code=trust_remote_code)
    for line in report.notes:
        note(line)
    return ModelSource(spec, kind, folder, report.config, tuple(report.notes))


def _cached(spec: str, kind: str, build) -> ModelSource:
    """A cache folder we wrote ourselves: if it was damaged since (disk full, edits), rebuild it once."""
    folder = build()
    try:
        return _checked(spec, kind, folder, False)
    except ModelSourceError as e:
        note(f"cached conversion {folder} is damaged ({e}); converting again")
    shutil.rmtree(folder, ignore_errors=True)
    return _checked(spec, kind, build(), False)
