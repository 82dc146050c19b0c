"""Budgets, not counts: for each target, the mixed cut `prune --target` finds beside the best block-only and
attention-only cuts that meet the same target.

SmolLM2-135M (float32, CPU) at params=0.90,kv=0.80; params=0.85; kv=0.70; decode=1.15x, and Gemma 3 270M at
the same targets over whole blocks only (its sublayers have no nemotron-nas form, so its mixed search is a
block search). Each row runs the search prune --target runs (select.budget_search: damage of every single
removal on the first 4 of 16 C4 calibration windows, the exact solve, the measured local search, speed
targets timed whole), restricted to the row's kind; "best block-only" and "best attention-only" are that
search with `--unit block` or `--unit attention`. Every cut is then judged on text no search saw: WikiText-2
test (16 x 512 tokens) and the C4 windows after the calibration ones (16 x 512); `--accuracy` adds lm-eval
mean accuracy on the four local tasks (500 documents each). Parameters and KV bytes per token are exact
(select.costs); decode speed-up is the cut timed whole against the base (one token after 512 cached, batch 1,
5 interleaved repeats, median). Selection time is the search's wall time in this process.

Run:   .venv/bin/python bench/budget.py              # perplexity, costs, speed, selection time (cached per row)
       .venv/bin/python bench/budget.py --accuracy   # adds lm-eval accuracy to every row
       .venv/bin/python bench/budget.py --report     # the table and docs/budget-frontier.png from the cache only
Results: bench/results/budget.json (delete a row to measure it again).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "bench" / "results" / "budget.json"
PLOT = ROOT / "docs" / "budget-frontier.png"
MODELS = {"smollm2-135m": ("mixed", "block-only", "attention-only"), "gemma3-270m": ("block-only",)}
TARGETS = ("params=0.90,kv=0.80", "params=0.85", "kv=0.70", "decode=1.15x")
KINDS = {"mixed": ("block", "attention", "mlp"), "block-only": ("block",), "attention-only": ("attention",)}
SEQ_LEN, SAMPLES, EVAL_WINDOWS, MEASURE_WINDOWS = 512, 16, 16, 4
CALIBRATION = "c4_en_sample_1000.jsonl"
FRONTIER_TARGET = "params=0.85"


def say(message: str) -> None:
    print(f"budget: {message}", file=sys.stderr, flush=True)


def load_results() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {"rows": {}}


def save_results(results: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    temporary = RESULTS.with_suffix(".tmp")
    temporary.write_text(json.dumps(results, indent=1) + "\n")
    temporary.replace(RESULTS)


def run_model(name: str, results: dict, args) -> None:
    import torch

    from prunetool.cut import Cut
    from prunetool.model.loading import load_model
    from prunetool.model.runner import cut_perplexity
    from prunetool.select.budget import Candidates, Meter, parse_targets
    from prunetool.select.budget_search import frontier, search_budget
    from prunetool.select.calibration import load_calibration
    from prunetool.select.costs import checkpoint_costs
    from prunetool.select.cut_engine import CutEngine
    from prunetool.select.speed import Workload, cut_seconds, sublayer_timing
    from prunetool.sources import resolve_model

    torch.manual_seed(0)
    source = resolve_model(name)
    model, tokenizer = load_model(source, dtype="float32", device="cpu")
    device = torch.device("cpu")
    wikitext = load_calibration(str(DATA / "wikitext2-test.raw"), tokenizer, seq_len=SEQ_LEN, samples=EVAL_WINDOWS)
    calibration = load_calibration(str(DATA / CALIBRATION), tokenizer, seq_len=SEQ_LEN, samples=SAMPLES,
                                   holdout=EVAL_WINDOWS)
    engine = CutEngine(model, calibration.input_ids[:MEASURE_WINDOWS])
    n = engine.cut.num_layers
    workload = Workload("decode", 512, 1)
    meter = Meter(checkpoint_costs(source.path))
    say(f"{name}: timing every sublayer")
    meter.timings["decode"] = sublayer_timing(model, workload, device)
    rows = results["rows"]

    def judge(key: str, cut: Cut, extra: dict) -> None:
        row = rows.setdefault(key, {"model": name} | extra)
        if "wikitext2" not in row:
            row["cut"] = cut.to_json()
            row["wikitext2"] = cut_perplexity(model, wikitext.input_ids, cut)
            row["c4_held_out"] = cut_perplexity(model, calibration.held_out, cut)
            costs = meter.costs
            row["params"] = costs.params(cut) / costs.total_params
            row["kv"] = costs.kv(cut) / costs.kv(Cut(n))
            save_results(results)
        if "decode_speedup" not in row and not cut.empty:
            base, mine = cut_seconds(model, [None, cut], workload, device)
            row["decode_speedup"] = base["median"] / mine["median"]
            row["decode_range"] = [base["min"] / mine["max"], base["max"] / mine["min"]]
            save_results(results)
        if args.accuracy and "accuracy" not in row:
            from sublayer import accuracy

            row["accuracy"] = accuracy(model, tokenizer, cut, "block", args.accuracy_limit)
            save_results(results)
        say(f"{key}: {cut.describe()}; WikiText-2 {row['wikitext2']:.2f}, C4 {row['c4_held_out']:.2f}")

    judge(f"{name}|base", Cut(n), {"target": None, "kind": "base"})
    for text in TARGETS:
        targets = parse_targets(text)

        def measure(cut):
            base, mine = cut_seconds(model, [None, cut], workload, device)
            return {"decode": base["median"] / mine["median"]}

        for kind in MODELS[name]:
            key = f"{name}|{text}|{kind}"
            if key in rows and "cut" in rows[key]:
                cut = Cut.from_json(rows[key]["cut"])
            else:
                candidates = Candidates.build(n, KINDS[kind])
                engine.set_cut(Cut(n))
                started = time.perf_counter()
                try:
                    found = search_budget(engine, meter, targets, candidates, measure_speed=measure)
                except Exception as error:  # an unreachable target for this kind: recorded, not fatal
                    rows[key] = {"model": name, "target": text, "kind": kind, "unreachable": str(error)}
                    save_results(results)
                    say(f"{key}: {error}")
                    continue
                rows[key] = {"model": name, "target": text, "kind": kind,
                             "select_seconds": round(time.perf_counter() - started, 1), "reports": found.reports,
                             "resolves": found.resolves, "evaluations": found.evaluations}
                cut = found.cut
                if text == FRONTIER_TARGET and kind == "mixed" and name == "smollm2-135m":
                    results["frontier"] = {"model": name, "target": targets[0].to_json(),
                                           "points": frontier(engine, found, meter, targets[0], candidates),
                                           "chosen": {"x": meter.report(targets[0], cut)["ratio"],
                                                      "perplexity": found.perplexity,
                                                      "describe": cut.describe()},
                                           "quality": f"calibration perplexity on {MEASURE_WINDOWS} C4 windows"}
            judge(key, cut, {"target": text, "kind": kind})


def table(results: dict) -> str:
    rows = results["rows"]
    lines = ["| model | target | cut | WikiText-2 (x base) | C4 held-out (x base) | accuracy | params | KV | decode "
             "(measured) | met | selection |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in MODELS:
        base = rows.get(f"{name}|base")
        if not base:
            continue
        accuracy = base.get("accuracy", {}).get("mean")
        lines.append(f"| {name} | - | base | {base['wikitext2']:.2f} | {base['c4_held_out']:.2f} | "
                     f"{accuracy:.4f} |" if accuracy is not None else
                     f"| {name} | - | base | {base['wikitext2']:.2f} | {base['c4_held_out']:.2f} | - |")
        lines[-1] += " 1.00x | 1.00x | 1.00x | | |"
        for key, row in rows.items():
            if row.get("model") != name or row.get("kind") == "base":
                continue
            if "unreachable" in row:
                lines.append(f"| {name} | {row['target']} | {row['kind']}: none meets it | | | | | | | | |")
                continue
            acc = row.get("accuracy", {}).get("mean")
            met = "yes" if all(r["met"] for r in row.get("reports", [])) else "no"
            speed = row.get("decode_speedup")
            lines.append(
                f"| {name} | {row['target']} | {row['kind']}: {row['cut']['describe']} | "
                f"{row['wikitext2']:.2f} ({row['wikitext2'] / base['wikitext2']:.2f}x) | "
                f"{row['c4_held_out']:.2f} ({row['c4_held_out'] / base['c4_held_out']:.2f}x) | "
                f"{'-' if acc is None else f'{acc:.4f}'} | {row['params']:.3f}x | {row['kv']:.3f}x | "
                f"{'-' if speed is None else f'{speed:.2f}x'} | {met} | {row.get('select_seconds', math.nan):.0f} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accuracy", action="store_true")
    parser.add_argument("--accuracy-limit", type=int, default=500)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--report", action="store_true", help="render from the cache only")
    args = parser.parse_args()
    results = load_results()
    if not args.report:
        results["provenance"] = provenance()
        for name in args.models.split(","):
            run_model(name, results, args)
        save_results(results)
    if results.get("frontier"):
        sys.path.insert(0, str(ROOT))
        from prunetool.output.plots import plot_pareto

        plot_pareto(results["frontier"], PLOT, title="SmolLM2-135M: calibration perplexity against parameters")
    print(table(results))


if __name__ == "__main__":
    main()
