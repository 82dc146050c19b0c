"""Peak memory of `prunetool score` with and without --low-memory, and whether the scores agree.

Run: .venv/bin/python bench/score_memory.py [--model gemma3-270m] [--calib ../shared/data/c4_en_sample_1000.jsonl]

Each run is its own process (`python -m prunetool score ... --json -o FILE`); its peak resident set
comes from os.wait4, which reports that child alone. Both runs use the same calibration windows
(16 x 512 tokens by default) and a throw-away PRUNETOOL_CACHE_DIR, so the user's current run is not
touched. The model is given as its cached folder so the cache redirection does not re-convert it.
Writes bench/results/score_memory.json; `table` renders it for docs/benchmarks.md.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import write_results

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CALIB = ROOT.parent / "shared" / "data" / "c4_en_sample_1000.jsonl"


def run(command: list[str], env: dict) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one child process."""
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed: {process.stderr.read().decode()[-2000:]}")
    return seconds, usage.ru_maxrss * 1024


def max_difference(a: dict, b: dict) -> float:
    pairs = [(x[k], y[k]) for x, y in zip(a["layers"], b["layers"]) for k in x]
    pairs += [(u, v) for name in a["heads"] for r, s in zip(a["heads"][name], b["heads"][name]) for u, v in zip(r, s)]
    pairs += [(u, v) for r, s in zip(a["angular_distance"], b["angular_distance"]) for u, v in zip(r, s)]
    return max(abs(u - v) for u, v in pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--calib", default=str(DEFAULT_CALIB))
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()

    from prunetool.sources import resolve_model

    folder = resolve_model(args.model).path
    checkpoint = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    with tempfile.TemporaryDirectory() as scratch:
        env = os.environ | {"PRUNETOOL_CACHE_DIR": scratch, "HF_HUB_OFFLINE": "1"}
        rows, scores = {}, {}
        for label, extra in (("default", []), ("--low-memory", ["--low-memory"])):
            out = Path(scratch) / f"{label.strip('-')}.json"
            command = [sys.executable, "-m", "prunetool", "score", str(folder), "--calib", args.calib,
                       "--samples", str(args.samples), "--seq-len", str(args.seq_len), "--dtype", "float32",
                       "--device", "cpu", "--json", "-o", str(out), *extra]
            rows[label] = run(command, env)
            scores[label] = json.loads(out.read_text())
    results = {"model": args.model, "checkpoint_bytes": checkpoint, "calibration": Path(args.calib).name,
               "samples": args.samples, "seq_len": args.seq_len,
               "max_abs_difference": max_difference(scores["default"], scores["--low-memory"]),
               "runs": [{"mode": label, "peak_rss_bytes": peak, "seconds": seconds}
                        for label, (seconds, peak) in rows.items()]}
    write_results("score_memory", results)
    print(table(results))


def table(results: dict) -> str:
    """The docs table: peak RSS of each mode against the checkpoint, and whether the scores agree."""
    checkpoint = results["checkpoint_bytes"]
    lines = [f"{results['model']}, {results['samples']} x {results['seq_len']} tokens of {results['calibration']}:", "",
             f"| mode | peak RSS MB | share of the {checkpoint / 1e6:.0f} MB checkpoint | wall s |",
             "|---|---|---|---|"]
    for run in results["runs"]:
        mode = "default (`prunetool score`)" if run["mode"] == "default" else f"`{run['mode']}`"
        lines.append(f"| {mode} | {run['peak_rss_bytes'] / 1e6:.0f} | {run['peak_rss_bytes'] / checkpoint:.2f} | "
                     f"{run['seconds']:.1f} |")
    lines += ["", "Max |difference| over every score (per layer, per head, angular matrix): "
              f"{results['max_abs_difference']:.1e}."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
