"""How much of a cut's damage does `prune --patch` repair, per objective?

SmolLM2-135M with layers 13-18 removed (the repair goals' setting), float32 on CPU. Each row's patch is
fitted on the first N windows x 256 tokens of C4 calibration (c4_en_sample_1000.jsonl: 497k tokens,
1941 such windows; 32 windows = 8k tokens was the first measurement, 256 = 64k is --patch's default
DEFAULT_PATCH_TOKENS) through the same code path as
`prunetool prune --patch` (commands.prune.patch_model: one hooked pass, fit, new tensors rounded to the
checkpoint's dtype), then judged on WikiText-2 test perplexity over its first 16 non-overlapping
512-token windows (as bench/quality.py cuts them). Each row restores the base weights first.

gap recovered = (log ppl_cut - log ppl_patched) / (log ppl_cut - log ppl_base).

Run:   nice .venv/bin/python bench/repair.py [--rows lstsq:32,cosine:32,...]   (objective:windows)
Writes bench/results/repair.json (bench/results/repair_tokens.json: the same for --rows
down_proj:512,down_proj:1024, renamed by hand).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "bench" / "results" / "repair.json"
MODEL = "smollm2-135m"
REMOVED = tuple(range(13, 19))
EVAL_SEQ_LEN, EVAL_WINDOWS = 512, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="lstsq:32,cosine:32,down_proj:32,lstsq:256,cosine:256,down_proj:256",
                        help="objective:calibration windows, comma-separated")
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()

    import torch
    import transformers
    from rich.console import Console

    from prunetool import __version__
    from prunetool.select.calibration import load_calibration
    from prunetool.commands.prune import PruneRequest, patch_model
    from prunetool.model.in_memory import layers_removed
    from prunetool.model.loading import load_model
    from prunetool.model.perplexity import perplexity
    from prunetool.select.plan import PrunePlan
    from prunetool.sources import resolve_model

    console = Console(stderr=True)
    started = time.perf_counter()
    source = resolve_model(MODEL)
    model, tokenizer = load_model(source, dtype="float32", device="cpu")
    wanted = [(row.split(":")[0], int(row.split(":")[1])) for row in args.rows.split(",")]
    calib = load_calibration(str(DATA / "c4_en_sample_1000.jsonl"), tokenizer, seq_len=args.seq_len,
                             samples=max(n for _, n in wanted))
    evals = load_calibration(str(DATA / "wikitext2-test.raw"), tokenizer, seq_len=EVAL_SEQ_LEN, samples=EVAL_WINDOWS)
    plan = PrunePlan(MODEL, model.config.num_hidden_layers, REMOVED, "manual")
    original = {name: p.detach().clone() for name, p in model.named_parameters()}

    def measure() -> tuple[float, float]:
        clock = time.perf_counter()
        with layers_removed(model, plan.removed):
            value = perplexity(model, evals.input_ids)
        return value, time.perf_counter() - clock

    clock = time.perf_counter()
    base = perplexity(model, evals.input_ids)
    rows = [{"row": "base", "perplexity": base, "seconds": round(time.perf_counter() - clock, 1)}]
    cut, seconds = measure()
    rows.append({"row": "plain cut", "perplexity": cut, "seconds": round(seconds, 1)})
    console.print(f"base {base:.2f}, plain cut {cut:.2f}", highlight=False)
    gap = math.log(cut) - math.log(base)
    for objective, windows in wanted:
        request = PruneRequest(model=MODEL, layers=",".join(map(str, REMOVED)), patch=True,
                               patch_objective=objective, patch_windows=windows)
        _, record = patch_model(model, plan, calib.first(windows), source, request, console)
        patched, seconds = measure()
        recovered = (math.log(cut) - math.log(patched)) / gap
        rows.append({"row": f"patch {objective}, {windows} windows", "objective": objective,
                     "windows": windows, "tokens": windows * args.seq_len, "perplexity": patched,
                     "gap_recovered": round(recovered, 4),
                     "patch_seconds": record["seconds"], "eval_seconds": round(seconds, 1),
                     "runs": record["runs"]})
        console.print(f"patch {objective} {windows} windows: {patched:.2f} ({100 * recovered:.1f}% of the log gap) in "
                      f"{record['seconds']:.1f}s", highlight=False)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                parameter.copy_(original[name])
    result = {
        "command": " ".join(["bench/repair.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": {"prunetool": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "setting": {"model": MODEL, "removed": list(REMOVED), "dtype": "float32", "device": "cpu",
                    "threads": torch.get_num_threads(),
                    "calibration": calib.describe() | {"file": "c4_en_sample_1000.jsonl",
                                                       "note": "each row uses its first `windows` windows"},
                    "eval": evals.describe() | {"file": "wikitext2-test.raw"},
                    "gap_recovered": "(log ppl_cut - log ppl_patched) / (log ppl_cut - log ppl_base)"},
        "rows": rows,
        "total_seconds": round(time.perf_counter() - started, 1),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    console.print(f"wrote {RESULTS}", highlight=False)


if __name__ == "__main__":
    main()
