"""Shared pytest fixtures: tiny checkpoints, an isolated prunetool cache, the shared data folder."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
# `import tiny_models` / `import reference` and `from tests.reference import ...` both work,
# also under a bare `pytest` (which, unlike `python -m pytest`, does not put the cwd on sys.path).
for _p in (TESTS_DIR, REPO_ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from tiny_models import make_tiny_checkpoint  # noqa: E402

CACHE_ENV = "PRUNETOOL_CACHE_DIR"


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory `tiny_checkpoint(arch, num_layers=6, max_shard_size=None) -> Path`.

    Each distinct argument set is built once per session (building costs ~0.5 s and tests
    must not modify the returned folder; copy it first if a test needs to write into it).
    """
    built: dict[tuple, Path] = {}

    def factory(arch: str, num_layers: int = 6, max_shard_size: str | None = None) -> Path:
        key = (arch, num_layers, max_shard_size)
        if key not in built:
            name = f"{arch}-L{num_layers}" + (f"-shard{max_shard_size}" if max_shard_size else "")
            path = tmp_path_factory.mktemp(name, numbered=True)
            built[key] = make_tiny_checkpoint(arch, path, num_layers=num_layers, max_shard_size=max_shard_size)
        return built[key]

    return factory


@pytest.fixture(scope="session")
def _session_cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("prunetool-cache")


@pytest.fixture(autouse=True)
def _isolated_cache(request, monkeypatch, _session_cache_dir):
    """Point PRUNETOOL_CACHE_DIR at a per-session temp folder, except for `slow` tests.

    Fast tests must never read or pollute the user's cache; slow tests load real models and
    deliberately reuse the real cache so expensive conversions are done once per machine.
    """
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setenv(CACHE_ENV, str(_session_cache_dir))
    yield


@pytest.fixture(autouse=True)
def _single_thread_for_tiny_models(request):
    """Run fast (tiny-model) tests with one intra-op thread, restoring the setting afterwards.

    Tiny matmuls gain nothing from threading, and on a busy 2-core machine OpenMP worker
    hand-off made a 64-wide model ~100x slower (12 s instead of 0.1 s per generate test).
    Slow tests keep the default so real models still use every core.
    """
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The project's shared data folder (next to the repository), or skip when it is absent."""
    path = (REPO_ROOT / ".." / "shared" / "data").resolve()
    if not path.is_dir():
        pytest.skip(f"shared data folder {path} not found")
    return path


from engine_models import engine_folder, llamacpp_engine, vllm_engine  # noqa: E402,F401  (serving-engine fixtures)
