"""`prunetool heads` on the real models -> bench/results/heads-MODEL.json and the heatmaps shown in docs/heads.md.

Run: .venv/bin/python bench/heads_results.py [--models smollm2-135m,gemma3-270m]

Each model runs as its own process (WikiText-2 test text, 4 windows x 512 tokens, --kv-budget 128);
its wall time and peak RSS come from os.wait4, which reports that child alone. The results file holds
the command's heads.json as written plus those two numbers; bench/heads_markdown.py renders its tables.
The heatmaps docs/heads.md shows are copied from the report folder, so they come from the same run.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import write_results

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT.parent / "shared" / "data" / "wikitext2-test.raw"
SHORT = {"smollm2-135m": "smollm2", "gemma3-270m": "gemma3"}
SHOWN = {"smollm2-135m": ((18, 8), (11, 1)), "gemma3-270m": ((2, 3), (17, 0))}  # (layer, head) in docs/heads.md


def run(model: str, folder: Path) -> dict:
    """One `prunetool heads` process: its heads.json, wall seconds and peak RSS."""
    command = [sys.executable, "-m", "prunetool", "heads", model, "--calib", str(TEXT), "--kv-budget", "128",
               "--output-dir", str(folder), "--force"]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed: {process.stderr.read().decode()[-2000:]}")
    return {"model": model, "command": f"prunetool heads {model} --calib {TEXT.name} --kv-budget 128",
            "seconds": seconds, "peak_rss_bytes": usage.ru_maxrss * 1024,
            "heads": json.loads((folder / "heads.json").read_text())}


def copy_heatmaps(model: str, folder: Path) -> None:
    """docs/heads/SHORT_L{layer}_H{head}_{overview,zoom}.png from this run's report folder."""
    for layer, head in SHOWN[model]:
        for part in ("overview", "zoom"):
            found = folder / "heatmaps" / f"L{layer}_H{head}_{part}.png"
            if not found.is_file():
                raise SystemExit(f"{model}: the report has no heatmap of layer {layer} head {head}; "
                                 "update SHOWN and the text of docs/heads.md")
            shutil.copyfile(found, ROOT / "docs" / "heads" / f"{SHORT[model]}_L{layer}_H{head}_{part}.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(SHORT))
    for model in parser.parse_args().models.split(","):
        with tempfile.TemporaryDirectory() as scratch:
            folder = Path(scratch) / "heads"
            results = run(model, folder)
            copy_heatmaps(model, folder)
        write_results(f"heads-{SHORT[model]}", results)
        print(f"{model}: {results['seconds']:.0f} s, peak RSS {results['peak_rss_bytes'] / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
