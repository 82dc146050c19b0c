"""Raw bench results -> bench/results/NAME.json, stamped with how they were made.

Every table in docs/ is rendered from these files (bench/render_docs.py), so each file carries the
command line, date, machine and library versions that produced it: a reader can rerun it, and a
table never outlives the record of where its numbers came from.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PACKAGES = ("torch", "transformers", "safetensors", "lm_eval", "prunetool")


def provenance() -> dict:
    """How this process was started and on what: enough to rerun it and to know when not to compare."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    script = Path(sys.argv[0])
    script = script.resolve().relative_to(ROOT) if script.resolve().is_relative_to(ROOT) else script
    return {
        "command": " ".join(["python", str(script), *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPUs, {_memory_gib()} GiB RAM, {platform.machine()}, {platform.system()}",
        "python": platform.python_version(),
        "versions": versions,
    }


def _memory_gib() -> int:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    except (ValueError, OSError):
        return 0


def write_results(name: str, results: dict) -> Path:
    """bench/results/NAME.json with a `provenance` section; written to a temporary name, then renamed."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    target = RESULTS / f"{name}.json"
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps({"provenance": provenance(), **results}, indent=1) + "\n")
    tmp.replace(target)
    print(f"results written to {target.relative_to(ROOT)}", file=sys.stderr)
    return target
