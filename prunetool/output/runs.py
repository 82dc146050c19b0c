"""The current run: what `prunetool score` and `prune` last recorded, so later commands can omit MODEL.

Every command that starts from the current run asks here (`current_model`, `current_scores`,
`current_pruned`), so the rules for a missing or stale record live in one place.
"""

import json
from pathlib import Path

from prunetool.checkpoint_io import write_json_atomic
from prunetool.errors import PrunetoolError
from prunetool.paths import runs_dir


def current_run_path() -> Path:
    return runs_dir() / "current.json"


def record_current_run(model_spec: str, model_path: Path, scores: dict | None, options: dict,
                       pruned: dict | None = None) -> Path:
    """Remember the model, its scores and (after `prune`) the pruned folder; later commands start from here."""
    record = {"model": model_spec, "model_path": str(model_path), "options": options, "scores": scores,
              "pruned": pruned}
    write_json_atomic(current_run_path(), record)
    return current_run_path()


def load_current_run() -> dict:
    path = current_run_path()
    if not path.exists():
        raise PrunetoolError("no current run: run `prunetool score MODEL` first, or pass MODEL")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise PrunetoolError(f"the current run record {path} is not valid JSON ({error}); rerun `prunetool score`")


def current_model() -> str | None:
    """The current run's model, or None when there is no usable record (the caller picks a default)."""
    try:
        return load_current_run()["model"]
    except (PrunetoolError, KeyError, TypeError):
        return None


def current_scores() -> tuple[str, dict, dict]:
    """(model, scores JSON, the options they were computed with) of the current run; an error without scores."""
    run = load_current_run()
    if run.get("scores") is None:
        raise PrunetoolError("the current run has no scores: run `prunetool score MODEL` first, or pass MODEL")
    return run["model"], run["scores"], run.get("options") or {}


def current_pruned() -> tuple[dict, Path]:
    """The current run's record and its pruned folder; an error when none was written or it is gone."""
    run = load_current_run()
    pruned = run.get("pruned")
    if not pruned:
        raise PrunetoolError("the current run has no pruned model: run `prunetool prune --drop N` first, "
                             "or pass the models to evaluate")
    folder = Path(pruned["path"])
    if not folder.is_dir():
        raise PrunetoolError(f"the current run's pruned model {folder} no longer exists; prune again or pass MODEL")
    return run, folder
