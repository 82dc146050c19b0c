"""Cache folders under models_dir(): built in a temp folder beside the target and renamed at the end,
so an interrupted download or conversion never leaves a half-written model behind."""

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SOURCE_RECORD = "prunetool_source.json"
STALE_TEMP_SECONDS = 6 * 3600


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    """Streamed, so multi-GB files never sit in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def is_complete(folder: Path) -> bool:
    """A finished cache folder has its record; the record is written last, before the rename."""
    return (folder / SOURCE_RECORD).is_file() and (folder / "config.json").is_file()


def read_record(folder: Path) -> dict:
    try:
        data = json.loads((folder / SOURCE_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_record(folder: Path, record: dict) -> None:
    record = {**record, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (folder / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def _sweep_stale(parent: Path, prefix: str) -> None:
    """Temp folders of runs killed hard (SIGKILL, power loss) are removed once they are old."""
    now = time.time()
    for old in parent.glob(f"{prefix}*"):
        try:
            if old.is_dir() and now - old.stat().st_mtime > STALE_TEMP_SECONDS:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass


@contextmanager
def building(final: Path) -> Iterator[Path]:
    """Yield a scratch folder on the same filesystem as `final`.

    The block writes the finished model into `<scratch>/model`; on success it is renamed to `final`.
    The scratch folder is removed whatever happens, Ctrl-C included.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".tmp-{final.name}-"
    _sweep_stale(final.parent, prefix)
    scratch = Path(tempfile.mkdtemp(prefix=prefix, dir=final.parent))
    try:
        yield scratch
        _publish(scratch / "model", final)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _publish(built: Path, final: Path) -> None:
    """Rename into place; if a concurrent run got there first, keep its copy."""
    if final.exists() and not is_complete(final):
        shutil.rmtree(final, ignore_errors=True)
    try:
        os.rename(built, final)
    except OSError:
        if not is_complete(final):
            raise


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def transformers_version() -> str:
    """Recorded in prunetool_source.json: conversions may differ between transformers releases."""
    from importlib.metadata import version

    return version("transformers")
