"""Attention sublayers against whole blocks: what each cut keeps of quality, and what it saves.

SmolLM2-135M (float32, CPU): remove attention sublayers at N = 6, 9, 12 and whole blocks at N = 3, 6, 9.
Attention cuts are chosen by the default search (halving, sublayers as candidates), by q-similarity
alone (the TAPPA signal, no measuring), by TAPPA's BI' mix, by BI and angular distance measured across
the attention sublayer, and by a BlockPruner-style perplexity greedy over sublayers (the ppl criterion
at --unit attention), each with its selection time. Block cuts are chosen by the default search.
Every selection sees only the first 16 x 512-token C4 windows. Every cut is applied in memory and
judged on two held-out texts no selection saw: the usual WikiText-2 test windows (16 x 512 tokens)
and the next 16 x 512-token C4 windows after the selection ones (same domain as the calibration).
Parameters, KV-cache bytes per token and decode tokens/s (eval's efficiency measurement) are measured
for every row in one process; with `--efficiency`, in 3 interleaved passes (`--rounds`); a speed is the median over passes of the row's
ratio to the base of the same pass, and the table shows its range, which is this CPU's noise.
`--accuracy` adds lm-eval mean accuracy on the four local tasks (500 documents each) for the base
and the default cuts (`--accuracy-rows all` for every row, or a comma-separated list of row keys).

Run:   .venv/bin/python bench/sublayer.py                 # perplexity, efficiency, selection time
       .venv/bin/python bench/sublayer.py --accuracy      # adds lm-eval accuracy
       .venv/bin/python bench/sublayer.py --efficiency    # every row's speeds again (3 passes, ~17 min)
       .venv/bin/python bench/sublayer.py --report        # tables and docs/sublayer.png from the cache only
Results are cached in bench/results/sublayer.json (delete a row to measure it again).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from provenance import provenance

from prunetool.cut import Cut

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "bench" / "results" / "sublayer.json"
MODEL = "smollm2-135m"
SEQ_LEN, SAMPLES, EVAL_WINDOWS, PPL_WINDOWS = 512, 16, 16, 4
CALIBRATION = "c4_en_sample_1000.jsonl"
ATTENTION_DROPS, BLOCK_DROPS = (6, 9, 12), (3, 6, 9)
ATTENTION_CRITERIA = ("halving", "qsim", "tappa", "bi", "angular", "ppl")
EFFICIENCY_REPEATS, EFFICIENCY_PASSES = 3, 3
SPEEDS = ("prefill_tokens_per_second", "decode_tokens_per_second")
PLOT = ROOT / "docs" / "sublayer.png"
TASKS = ("lambada_openai", "arc_easy", "piqa", "winogrande")


def load_results() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {"rows": {}}


def save_results(results: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    temporary = RESULTS.with_suffix(".tmp")
    temporary.write_text(json.dumps(results, indent=1) + "\n")
    temporary.replace(RESULTS)


def select(criterion: str, unit: str, drop: int, scores, model, calibration) -> tuple[list[int], float]:
    from prunetool.select.ranking import SelectionRequest
    from prunetool.select.selection import CRITERIA

    windows = calibration.input_ids[:PPL_WINDOWS] if criterion == "ppl" else calibration.input_ids
    started = time.perf_counter()
    chosen = CRITERIA[criterion].select(SelectionRequest(scores.num_layers, drop, scores, model=model,
                                                         windows=windows, unit=unit))
    return sorted(chosen.removed), time.perf_counter() - started


def efficiency(model, removed: list[int], unit: str) -> dict:
    from prunetool.evaluation.efficiency import measure_efficiency
    from prunetool.model.runner import removed_units

    with removed_units(model, Cut.of(unit, removed, len(model.model.layers))):
        return measure_efficiency(model, repeats=EFFICIENCY_REPEATS)


def accuracy(model, tokenizer, removed, unit: str, limit: int) -> dict:
    """lm-eval mean accuracy with `removed` (layer indices of `unit`, or a Cut) gone in memory."""
    from prunetool.evaluation.runner import TaskManagers, evaluate_tasks, make_lm
    from prunetool.evaluation.tasks import data_dir_from, plan_tasks
    from prunetool.model.runner import removed_units

    data_dir = data_dir_from(DATA)
    cut = removed if isinstance(removed, Cut) else Cut.of(unit, removed, len(model.model.layers))
    with removed_units(model, cut):
        lm = make_lm(model, tokenizer, "auto", None)
        results, _ = evaluate_tasks(lm, plan_tasks(list(TASKS), data_dir), TaskManagers(data_dir), limit=limit,
                                    num_fewshot=None)
    scores = {task: results["results"][task]["acc,none"] for task in TASKS}
    return {"tasks": scores, "mean": sum(scores.values()) / len(scores), "limit": limit}


def run(args) -> None:
    import torch

    from prunetool.model.loading import load_model
    from prunetool.cut import Cut
    from prunetool.model.runner import cut_perplexity
    from prunetool.select.calibration import load_calibration
    from prunetool.select.scoring import score_model
    from prunetool.sources import resolve_model

    torch.manual_seed(0)
    results = load_results()
    results["provenance"] = provenance()  # the run that measured the rows still missing
    model, tokenizer = load_model(resolve_model(MODEL), dtype="float32", device="cpu")
    evals = load_calibration(str(DATA / "wikitext2-test.raw"), tokenizer, seq_len=SEQ_LEN, samples=EVAL_WINDOWS)
    calibration = load_calibration(str(DATA / CALIBRATION), tokenizer, seq_len=SEQ_LEN, samples=SAMPLES,
                                   holdout=EVAL_WINDOWS)
    scores = score_model(model, calibration, model_name=MODEL)
    results["held_out"], results["calibration"] = evals.describe(), calibration.describe()
    results["c4_held_out"] = {"windows": len(calibration.held_out), "seq_len": SEQ_LEN,
                              "first_window": SAMPLES, "file": CALIBRATION}
    jobs = [("base", "block", 0)] + [(c, "attention", n) for n in ATTENTION_DROPS for c in ATTENTION_CRITERIA]
    jobs += [("halving", "block", n) for n in BLOCK_DROPS]
    for criterion, unit, drop in jobs:
        key = "base" if drop == 0 else f"{unit}:{criterion}@{drop}"
        row = results["rows"].setdefault(key, {"unit": unit, "criterion": criterion, "drop": drop})
        if "perplexity" not in row:
            removed, seconds = ([], 0.0) if drop == 0 else select(criterion, unit, drop, scores, model, calibration)
            row |= {"removed": removed, "select_seconds": round(seconds, 1),
                    "perplexity": cut_perplexity(model, evals.input_ids, Cut.of(unit, removed, scores.num_layers))}
            row.pop("efficiency", None)
            print(f"{key}: {removed} ppl {row['perplexity']:.3f} in {seconds:.0f}s", file=sys.stderr, flush=True)
            save_results(results)
        if "c4_perplexity" not in row:
            row["c4_perplexity"] = cut_perplexity(model, calibration.held_out,
                                                  Cut.of(unit, row["removed"], scores.num_layers))
            save_results(results)
        wanted = (args.accuracy_rows == "all" or (args.accuracy_rows == "default" and criterion == "halving")
                  or drop == 0 or key in args.accuracy_rows.split(","))
        if args.accuracy and wanted and "accuracy" not in row:
            row["accuracy"] = accuracy(model, tokenizer, row["removed"], unit, args.accuracy_limit)
            print(f"{key}: accuracy {row['accuracy']['mean']:.4f}", file=sys.stderr, flush=True)
            save_results(results)
    if args.efficiency or any("efficiency" not in row for row in results["rows"].values()):
        measure_rounds(results, model, args.rounds)
        save_results(results)


def measure_rounds(results: dict, model, rounds: int) -> None:
    """Every row's efficiency in `rounds` interleaved passes of this process (odd passes in reverse order, so
    drift of the machine lands on every row alike); speeds are each row's ratio to the base of the same pass,
    median over passes, with the range kept to show the noise."""
    keys = list(results["rows"])
    passes = []
    for index in range(rounds):
        measured = {}
        for key in keys if index % 2 == 0 else keys[::-1]:
            row = results["rows"][key]
            measured[key] = efficiency(model, row["removed"], row["unit"])
            print(f"pass {index + 1}/{rounds} {key}: decode {measured[key]['decode_tokens_per_second']:.1f} tok/s",
                  file=sys.stderr, flush=True)
        passes.append(measured)
    for key, row in results["rows"].items():
        first = dict(passes[0][key])
        for name in SPEEDS:
            first[name] = statistics.median(p[key][name] for p in passes)
            row[f"{name}_ratios"] = [p[key][name] / p["base"][name] for p in passes]
        first["setting"] = first["setting"] | {"passes": rounds}
        row["efficiency"] = first


def ordered(results: dict) -> list[tuple[str, dict]]:
    """Rows in reading order: base, attention by N then criterion, blocks by N."""
    rank = {criterion: i for i, criterion in enumerate(ATTENTION_CRITERIA)}
    rows = results["rows"].items()
    return sorted(rows, key=lambda item: (item[1]["drop"] > 0, item[1]["unit"] != "attention", item[1]["drop"],
                                          rank.get(item[1]["criterion"], 0)))


def ratio(row: dict, base: dict, name: str) -> float:
    """row / base; for speeds, the median of the per-pass ratios where the passes were kept."""
    passes = row.get(f"{name}_ratios")
    return statistics.median(passes) if passes else row["efficiency"][name] / base["efficiency"][name]


def speed_cell(row: dict, base: dict, name: str) -> str:
    """The speed ratio with its range over passes: the measurement's noise, on the same row."""
    passes = row.get(f"{name}_ratios")
    spread = f" ({min(passes):.2f}-{max(passes):.2f})" if passes and len(passes) > 1 and row["drop"] else ""
    return f"{ratio(row, base, name):.2f}x{spread}"


def markdown(results: dict) -> str:
    """The comparison table: every cut's quality and savings relative to the base."""
    base = results["rows"]["base"]
    lines = ["| unit | criterion | N | removed | WikiText-2 ppl (x base) | C4 held-out ppl (x base) | mean acc | "
             "KV bytes/token | parameters | decode tok/s | selection s |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for _, row in ordered(results):
        acc = row.get("accuracy", {}).get("mean")
        c4 = row.get("c4_perplexity")
        c4_cell = "-" if c4 is None else f"{c4:.2f} ({c4 / base['c4_perplexity']:.2f}x)"
        lines.append(f"| {row['unit'] if row['drop'] else 'base'} | {row['criterion'] if row['drop'] else '-'} | "
                     f"{row['drop']} | {', '.join(map(str, row['removed'])) or '-'} | {row['perplexity']:.2f} "
                     f"({row['perplexity'] / base['perplexity']:.2f}x) | "
                     f"{c4_cell} | "
                     f"{'-' if acc is None else f'{acc:.4f}'} | "
                     f"{ratio(row, base, 'kv_cache_bytes_per_token'):.2f}x | {ratio(row, base, 'parameters'):.2f}x | "
                     f"{speed_cell(row, base, 'decode_tokens_per_second')} | {row['select_seconds']:.0f} |")
    setting = base["efficiency"]["setting"]
    c4 = results.get("c4_held_out", {})
    lines.append("")
    lines.append(f"Efficiency relative to the base on {setting['device']} ({setting['dtype']}, batch 1, decode "
                 f"{setting['decode_tokens']} tokens after {setting['decode_prompt_tokens']}, "
                 + (f"median over {setting['passes']} interleaved passes of one process of each pass's ratio to the "
                    f"base (range in brackets), each pass's speed the median of {setting['repeats']}"
                    if "passes" in setting else f"median of {setting['repeats']}, every row in one pass of one process")
                 + "). Selection saw the first "
                 f"{results['calibration'].get('windows', SAMPLES)} x {SEQ_LEN}-token windows of {CALIBRATION}; "
                 f"held out: {results['held_out']['windows']} x {results['held_out']['seq_len']} tokens of "
                 f"WikiText-2 test, and C4 windows {c4.get('first_window', SAMPLES)}-"
                 f"{c4.get('first_window', SAMPLES) + c4.get('windows', EVAL_WINDOWS) - 1} of the same file.")
    return "\n".join(lines)


def goals(results: dict) -> str:
    """The goals for attention cuts, read off the rows: each line says what was measured against what was asked."""
    rows, base = results["rows"], results["rows"]["base"]
    lines = []
    six = rows.get("attention:halving@6")
    if six:
        lines.append(f"- Attention N=6, default search: WikiText-2 perplexity {six['perplexity'] / base['perplexity']:.2f}x "
                     f"the base (goal at most 1.25x); whole-block N=6: "
                     f"{rows['block:halving@6']['perplexity'] / base['perplexity']:.2f}x.")
    for drop in ATTENTION_DROPS:
        default = rows.get(f"attention:halving@{drop}")
        peers = {c: rows[f"attention:{c}@{drop}"] for c in ATTENTION_CRITERIA[1:] if f"attention:{c}@{drop}" in rows}
        if not default or not peers:
            continue
        for text, name in (("WikiText-2", "perplexity"), ("C4 held-out", "c4_perplexity")):
            if name not in default:
                continue
            beaten = [c for c, row in peers.items() if row.get(name, float("inf")) < default[name]]
            lines.append(f"- Attention N={drop}, {text}: default {default[name]:.2f}; "
                         + ", ".join(f"{c} {row[name]:.2f}" for c, row in peers.items() if name in row)
                         + (f" (better than the default: {', '.join(beaten)})" if beaten else " (no peer better)"))
        ppl = peers.get("ppl")
        if ppl and ppl["select_seconds"]:
            lines.append(f"- Attention N={drop}: default selection {default['select_seconds']:.0f} s against the "
                         f"perplexity greedy's {ppl['select_seconds']:.0f} s "
                         f"({default['select_seconds'] / ppl['select_seconds']:.2f}x; goal at most 0.25x).")
    scored = [(key, row) for key, row in rows.items() if row["drop"] and "accuracy" in row]
    if scored:
        for unit in ("attention", "block"):
            best = [(ratio(row, base, "decode_tokens_per_second"), row["accuracy"]["mean"], key)
                    for key, row in scored if row["unit"] == unit]
            lines.append(f"- {unit} cuts with accuracy: " + "; ".join(
                f"{key} decode {speed:.2f}x, acc {acc:.4f}" for speed, acc, key in sorted(best)))
    return "\n".join(lines)


def table(results: dict) -> str:
    """The region bench/render_docs.py writes into docs: the comparison and the goals read off it."""
    return markdown(results) + "\n\n" + goals(results)


def plot(results: dict) -> None:
    """docs/sublayer.png: quality against KV saved and against decode speed, attention and block cuts on one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = results["rows"]["base"]
    measures = [("perplexity", "WikiText-2 perplexity (x base)")]
    if any("accuracy" in row for row in results["rows"].values()):
        measures.append(("accuracy", "mean accuracy, 4 tasks"))
    figure, axes = plt.subplots(len(measures), 2, figsize=(11, 4 * len(measures)), squeeze=False)
    styles = {("attention", "halving"): ("tab:blue", "o", "attention, default (halving)"),
              ("attention", "qsim"): ("tab:orange", "s", "attention, q-similarity"),
              ("attention", "ppl"): ("tab:green", "^", "attention, ppl greedy"),
              ("block", "halving"): ("black", "D", "blocks, default (halving)")}
    for row_axes, (measure, label) in zip(axes, measures):
        for (unit, criterion), (color, marker, name) in styles.items():
            cut = sorted((row for row in results["rows"].values()
                          if row["unit"] == unit and row["criterion"] == criterion and row["drop"]
                          and (measure != "accuracy" or "accuracy" in row)), key=lambda row: row["drop"])
            if not cut:
                continue
            values = [row["perplexity"] / base["perplexity"] if measure == "perplexity" else row["accuracy"]["mean"]
                      for row in cut]
            kv_saved = [1 - ratio(row, base, "kv_cache_bytes_per_token") for row in cut]
            speed = [ratio(row, base, "decode_tokens_per_second") for row in cut]
            for axis, xs in zip(row_axes, (kv_saved, speed)):
                axis.plot(xs, values, marker=marker, color=color, label=name)
                for x, y, row in zip(xs, values, cut):
                    axis.annotate(f"N={row['drop']}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        reference = 1.0 if measure == "perplexity" else base.get("accuracy", {}).get("mean")
        for axis, xlabel in zip(row_axes, ("KV cache saved (fraction of the base)", "decode tokens/s (x base)")):
            if reference is not None:
                axis.axhline(reference, color="tab:red", linestyle=":", label="base")
            if measure == "perplexity":
                axis.set_yscale("log")
            axis.set_xlabel(xlabel)
            axis.set_ylabel(label)
            axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.suptitle(f"{MODEL}: attention sublayers against whole blocks")
    figure.tight_layout()
    figure.savefig(PLOT, dpi=110)
    print(f"plot written to {PLOT.relative_to(ROOT)}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accuracy", action="store_true")
    parser.add_argument("--accuracy-limit", type=int, default=500)
    parser.add_argument("--accuracy-rows", default="default",
                        help="default: the base and the halving rows; all: every row; or row keys, comma-separated "
                             "(block:halving@6,...)")
    parser.add_argument("--efficiency", action="store_true", help="measure every row's efficiency again")
    parser.add_argument("--rounds", type=int, default=EFFICIENCY_PASSES,
                        help="interleaved efficiency passes over all rows (speeds: median of per-pass ratios)")
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args()
    if not args.report:
        run(args)
    results = load_results()
    plot(results)
    print(table(results))


if __name__ == "__main__":
    main()
