"""`prune --low-memory` under a memory cap below the checkpoint's size, against the in-memory prune.

For each model and cut, two processes run `python -m prunetool prune MODEL --drop N --json` with the default
criterion, C4 calibration (16 x 512 tokens, the defaults) and verification on:

- in memory, uncapped;
- `--low-memory` under a cap of the interpreter's baseline (its resident set after importing prunetool,
  torch and transformers, measured in a child first) + --cap x the checkpoint's bytes. The cap is a
  memory cgroup (v1 `memory.limit_in_bytes`; it counts resident memory and the page cache it can
  reclaim) where this machine lets us create one; otherwise RLIMIT_DATA on the data segment, which
  also counts mappings that are never resident (safetensors maps whole files), so it is stricter.

Reported: the layers each chose, whether every written tensor file is byte-identical, peak RSS (os.wait4
of that child alone) and wall time.

Run:   .venv/bin/python bench/low_memory_prune.py [--models gemma3-270m:4,smollm2-135m:6] [--cap 0.6]
Writes bench/results/low_memory_prune.json; `table` renders it for docs/scale.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
C4 = ROOT.parent / "shared" / "data" / "c4_en_sample_1000.jsonl"
GIB = 1024 ** 3
CGROUP = Path("/sys/fs/cgroup/memory/prunetool-bench")
BASELINE = ("import torch, transformers, prunetool.commands.prune\n"
            "from prunetool.memory import status_kib\nprint(status_kib({field!r}) * 1024)")


def baseline_bytes(field: str) -> int:
    """VmRSS or VmData of an interpreter that has imported what prune imports, before it loads anything."""
    out = subprocess.run([sys.executable, "-c", BASELINE.format(field=field)], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return int(out.stdout.strip())


def make_cgroup(limit: int) -> bool:
    """A v1 memory cgroup capped at `limit` bytes; False where this machine does not allow one."""
    try:
        CGROUP.mkdir(exist_ok=True)
        (CGROUP / "memory.limit_in_bytes").write_text(str(limit))
        return int((CGROUP / "memory.limit_in_bytes").read_text()) <= limit
    except OSError:
        return False


def run(command: list[str], env: dict, limit: int | None, how: str) -> tuple[dict, float, int]:
    """prune's --json, wall seconds and peak RSS (bytes) of one child process, capped by `how`."""
    def cap() -> None:
        if limit is None:
            return
        if how == "cgroup":
            (CGROUP / "cgroup.procs").write_text(str(os.getpid()))
        else:
            resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))

    started = time.perf_counter()
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr, preexec_fn=cap, cwd=ROOT)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
        stdout.seek(0)
        stderr.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{' '.join(command)} failed: {stderr.read().decode()[-3000:]}")
        return json.loads(stdout.read()), seconds, usage.ru_maxrss * 1024


def digests(folder: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.glob("*.safetensors"))}


def table(results: dict) -> str:
    lines = ["| model, cut | run | memory cap | layers removed | peak RSS | time | tensors |",
             "|---|---|---:|---|---:|---:|---|"]
    for entry in results["runs"]:
        for label in ("in memory", "--low-memory"):
            run_ = entry[label]
            cap = f"{run_['limit_bytes'] / GIB:.2f} GiB" if run_.get("limit_bytes") else "none"
            same = ("byte-identical" if entry["identical_tensors"] else "**differ**") if label != "in memory" else ""
            lines.append(f"| {entry['model']} -{entry['drop']} (checkpoint {entry['checkpoint_bytes'] / GIB:.2f} GiB) | "
                         f"{label} | {cap} | {', '.join(map(str, run_['removed']))} | "
                         f"{run_['peak_rss_bytes'] / GIB:.2f} GiB | {run_['seconds']:.0f} s | {same} |")
    what = {"cgroup": "a memory cgroup (resident memory and page cache)",
            "rlimit": "RLIMIT_DATA (the data segment)"}[results["limit"]]
    lines += ["", f"Cap: {what} = the interpreter's baseline ({results['baseline_bytes'] / GIB:.2f} GiB after importing "
              f"torch, transformers and prunetool) + {results['cap']:g} x the checkpoint's bytes. Peak RSS is "
              "that child's alone (os.wait4)."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gemma3-270m:4,smollm2-135m:6")
    parser.add_argument("--cap", type=float, default=0.6, help="of the checkpoint's bytes, above the baseline")
    args = parser.parse_args()

    from prunetool.sources import resolve_model
    from provenance import write_results

    how = "cgroup" if make_cgroup(2**40) else "rlimit"
    baseline = baseline_bytes("VmRSS" if how == "cgroup" else "VmData")
    results = {"setting": {"calib": C4.name, "seq_len": 512, "samples": 16, "criterion": "halving (default)"},
               "cap": args.cap, "limit": how, "baseline_bytes": baseline, "runs": []}
    with tempfile.TemporaryDirectory() as scratch:
        env = os.environ | {"PRUNETOOL_CACHE_DIR": str(Path(scratch) / "cache"), "HF_HUB_OFFLINE": "1"}
        for item in args.models.split(","):
            name, drop = item.split(":")
            folder = resolve_model(name).path
            checkpoint = sum(path.stat().st_size for path in folder.glob("*.safetensors"))
            entry = {"model": name, "drop": int(drop), "checkpoint_bytes": checkpoint}
            for label, extra, limit in (("in memory", [], None),
                                        ("--low-memory", ["--low-memory"], baseline + int(args.cap * checkpoint))):
                out = Path(scratch) / f"{name}-{label.strip('-')}"
                command = [sys.executable, "-m", "prunetool", "prune", str(folder), "--drop", drop, "--calib", str(C4),
                           "--output-dir", str(out), "--json", *extra]
                if limit is not None and how == "cgroup":
                    make_cgroup(limit)
                report, seconds, peak = run(command, env, limit, how)
                entry[label] = {"command": " ".join(["prunetool", *command[3:]]), "removed": report["plan"]["removed"],
                                "seconds": round(seconds, 1), "peak_rss_bytes": peak, "limit_bytes": limit,
                                "reported_peak_rss_bytes": report["peak_rss_bytes"], "low_memory": report["low_memory"],
                                "perplexity": report["perplexity"], "verification": report["verification"],
                                "digests": digests(out)}
                print(f"{name} -{drop} {label}: removed {entry[label]['removed']}, peak {peak / GIB:.2f} GiB, "
                      f"{seconds:.0f} s", file=sys.stderr)
            entry["same_layers"] = entry["in memory"]["removed"] == entry["--low-memory"]["removed"]
            entry["identical_tensors"] = entry["in memory"]["digests"] == entry["--low-memory"]["digests"]
            results["runs"].append(entry)
            write_results("low_memory_prune", results)


if __name__ == "__main__":
    main()
