"""Measurements per second of the cut engine against full forwards (the SLEB comparison's first step).

One SLEB round on each demo model: every layer removed alone (on top of an optional current cut), the
calibration perplexity of the 16 x 512 C4 windows measured (a) by a full forward of the cut model
(in_memory.layers_removed + perplexity, what `ppl` did before) and (b) by prunetool.select.cut_engine, whose
time includes building it (a capture forward and the self-check forward). Both give the same numbers
(checked here to 1e-5 relative); only the time differs.

Run on an otherwise idle machine:   nice .venv/bin/python bench/cut_engine_speed.py
Writes bench/results/cut_engine_speed.json.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
DATA = ROOT.parent / "shared" / "data"
CUTS = {"smollm2-135m": (13, 14, 15), "gemma3-270m": (8, 9)}  # a partial cut, as in a later greedy round


def table(results: dict) -> str:
    setting = results["setting"]
    lines = [f"One SLEB round (every kept layer removed in turn), {setting['windows']} C4 windows x {setting['seq_len']} "
             f"tokens, {setting['dtype']}, {setting['threads']} thread{'s' if setting['threads'] > 1 else ''}. Engine time includes "
             "building it (one capture forward and one self-check forward).", "",
             "| model | current cut | candidates | full forwards | engine (incl. build) | measurements/s: full | engine | speed-up | largest rel. diff |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in results["rows"]:
        lines.append(f"| {row['model']} | {', '.join(map(str, row['cut'])) or 'none'} | {row['candidates']} | "
                     f"{row['full_seconds']:.1f} s | {row['engine_seconds']:.1f} s | "
                     f"{row['candidates'] / row['full_seconds']:.2f} | {row['candidates'] / row['engine_seconds']:.2f} | "
                     f"{row['full_seconds'] / row['engine_seconds']:.2f}x | {row['max_rel_diff']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()

    import torch

    from prunetool.select.calibration import load_calibration
    from prunetool.select.cut_engine import CutEngine
    from prunetool.model.in_memory import layers_removed
    from prunetool.model.loading import load_model
    from prunetool.model.perplexity import perplexity
    from prunetool.sources import resolve_model
    from provenance import write_results

    rows = []
    for alias, partial in CUTS.items():
        model, tokenizer = load_model(resolve_model(alias), dtype="float32", device="cpu")
        windows = load_calibration(str(DATA / "c4_en_sample_1000.jsonl"), tokenizer, seq_len=args.seq_len,
                                   samples=args.windows).input_ids
        for cut in ((), partial):
            candidates = [i for i in range(model.config.num_hidden_layers) if i not in cut]
            clock = time.perf_counter()
            full = {}
            for layer in candidates:
                with layers_removed(model, sorted({*cut, layer})):
                    full[layer] = perplexity(model, windows)
            full_seconds = time.perf_counter() - clock
            clock = time.perf_counter()
            engine = CutEngine(model, windows)
            engine.remove(cut)
            fast = {layer: engine.perplexity_without([layer]) for layer in candidates}
            engine_seconds = time.perf_counter() - clock
            del engine
            diff = max(abs(fast[i] - full[i]) / full[i] for i in candidates if math.isfinite(full[i]))
            rows.append({"model": alias, "cut": list(cut), "candidates": len(candidates),
                         "full_seconds": full_seconds, "engine_seconds": engine_seconds, "max_rel_diff": diff})
            print(rows[-1], file=sys.stderr)
        del model
    write_results("cut_engine_speed", {"setting": {"windows": args.windows, "seq_len": args.seq_len,
                                                   "threads": torch.get_num_threads(), "dtype": "float32"},
                                       "rows": rows})


if __name__ == "__main__":
    main()
