"""Where prunetool keeps converted models, generated calibration text and the current run."""

import os
from pathlib import Path

CACHE_ENV = "PRUNETOOL_CACHE_DIR"


def cache_dir() -> Path:
    """The user cache root: $PRUNETOOL_CACHE_DIR, else the platform's user cache folder."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("prunetool"))


def models_dir() -> Path:
    return cache_dir() / "models"


def calibration_cache_dir() -> Path:
    return cache_dir() / "calibration"


def runs_dir() -> Path:
    return cache_dir() / "runs"


def presets_dir() -> Path:
    """The shipped `calibration/` folder: inside the wheel, or at the repository root in a checkout."""
    packaged = Path(__file__).parent / "_calibration"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "calibration"
