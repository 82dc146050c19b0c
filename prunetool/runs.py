"""The current run: what `prunetool score` last recorded, so later commands can omit MODEL."""

import json
import os
import tempfile
from pathlib import Path

from prunetool.errors import PrunetoolError
from prunetool.paths import runs_dir


def write_json_atomic(path: Path, data: dict) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as stream:
            json.dump(data, stream, indent=1)
            stream.write("\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def current_run_path() -> Path:
    return runs_dir() / "current.json"


def record_current_run(model_spec: str, model_path: Path, scores: dict | None, options: dict,
                       pruned: dict | None = None) -> Path:
    """Remember the model, its scores and (after `prune`) the pruned folder; later commands start from here."""
    record = {"model": model_spec, "model_path": str(model_path), "options": options, "scores": scores,
              "pruned": pruned}
    write_json_atomic(current_run_path(), record)
    return current_run_path()


def mark_pruned(pruned: dict) -> None:
    """Add the pruned model to the current run, so `eval` with no MODEL compares it with its base."""
    record = load_current_run()
    record["pruned"] = pruned
    write_json_atomic(current_run_path(), record)


def load_current_run() -> dict:
    path = current_run_path()
    if not path.exists():
        raise PrunetoolError("no current run: run `prunetool score MODEL` first, or pass MODEL")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise PrunetoolError(f"the current run record {path} is not valid JSON ({error}); rerun `prunetool score`")
