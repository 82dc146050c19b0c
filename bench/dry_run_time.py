"""Wall time of `prunetool prune smollm2-135m --drop 6 --dry-run` per criterion (the dry-run time goal).

Each criterion runs as the user runs it: a fresh `prunetool` process, the default calibration (the
model's own generated text, cached after its first use, so the first criterion pays no generation that
the others do not), no recorded scores in the run (the cache folder is a fresh temporary one, with the
converted model and the generated text linked in). Wall time from process start to exit, so it includes
loading the model and text, scoring when the criterion needs scores, and the search.

Run on an otherwise idle machine:   .venv/bin/python bench/dry_run_time.py
Writes bench/results/dry_run_time.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def table(results: dict) -> str:
    setting = results["setting"]
    lines = [f"`prunetool prune {setting['model']} --drop {setting['drop']} --dry-run --criterion C`, a fresh process each, "
             f"{setting['threads']} CPU threads.", "",
             "| criterion | screens in | wall time | removes |", "|---|---|---:|---|"]
    for row in results["rows"]:
        flags = "".join(f", `{flag}`" for flag in row.get("flags", []))
        lines.append(f"| {row['criterion']}{' (default)' if row['default'] and not flags else ''}{flags} | "
                     f"{row.get('screened_in') or '-'} | {row['seconds']:.0f} s | {', '.join(map(str, row['removed']))} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--drop", type=int, default=6)
    parser.add_argument("--criteria", default="halving,halving:model,guided",
                        help="comma-separated; NAME:DTYPE adds --screen-dtype DTYPE (halving)")
    args = parser.parse_args()

    import json

    import torch

    from prunetool.commands.prune import PruneRequest
    from prunetool.paths import CACHE_ENV, cache_dir
    from provenance import write_results

    user_cache = cache_dir()
    rows = []
    with tempfile.TemporaryDirectory(prefix="prunetool-dry-run-") as folder:
        for name in ("models", "calibration"):  # converted checkpoints and generated text, not the run record
            if (user_cache / name).exists():
                os.symlink(user_cache / name, Path(folder) / name)
        for item in args.criteria.split(","):
            criterion, _, screen_dtype = item.partition(":")
            flags = ["--screen-dtype", screen_dtype] if screen_dtype else []
            command = [str(Path(sys.executable).with_name("prunetool")), "prune", args.model, "--drop", str(args.drop),
                       "--dry-run", "--criterion", criterion, *flags, "--json"]
            clock = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, CACHE_ENV: folder})
            seconds = time.perf_counter() - clock
            if done.returncode != 0:
                raise SystemExit(f"{criterion}: {done.stderr.strip().splitlines()[-1]}")
            plan = json.loads(done.stdout)["plan"]
            rows.append({"criterion": criterion, "flags": [" ".join(flags)] if flags else [],
                         "seconds": round(seconds, 1), "removed": plan["removed"],
                         "screened_in": plan["parameters"].get("screened_in"),
                         "default": criterion == PruneRequest(model="m", drop=1).criterion})
            print(rows[-1], file=sys.stderr)
    write_results("dry_run_time", {"setting": {"model": args.model, "drop": args.drop, "threads": torch.get_num_threads()},
                                   "rows": rows})


if __name__ == "__main__":
    main()
