"""Which layers should go? Every criterion side by side on real models, judged on held-out text.

For each model: score once per calibration source (16 windows x 512 tokens), select layers with every
criterion at each drop count, remove them in memory, and measure WikiText-2 test perplexity on fixed
windows that no criterion ever sees. Results are cached in a JSON file keyed by model, criterion and
drop count, so a rerun only computes what is missing (delete the file to start over).

Run:   .venv/bin/python bench/quality.py                       # perplexity, both models (about 1.5 h on 2 cores)
       .venv/bin/python bench/quality.py --accuracy            # adds lm-eval accuracy for the accuracy configs
       .venv/bin/python bench/quality.py --report              # tables + plot from the cached results only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

from provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "bench" / "results" / "quality.json"
PLOT = ROOT / "docs" / "quality.png"

MODELS = {"smollm2-135m": (3, 6, 9), "gemma3-270m": (2, 4, 6)}
CALIBRATIONS = {"c4": "c4_en_sample_1000.jsonl", "shakespeare": "tinyshakespeare_input.txt", "self": None}
MAIN_CALIBRATION = "c4"
SEQ_LEN, SAMPLES = 512, 16  # prunetool score's defaults
EVAL_WINDOWS = 16  # fixed WikiText-2 test windows of SEQ_LEN tokens: the first 16 x 512 tokens
RANDOM_SEEDS = 5
PPL_WINDOWS = 4  # SLEB's greedy measures the same few calibration windows guided refines on (its default)
ACCURACY_TASKS = "lambada_openai,arc_easy,piqa,winogrande"
DEFAULT = "halving"  # prunetool prune's default criterion since the SLEB comparison (guided before)
PATCH_OBJECTIVE = "down_proj"  # prune --patch's default; --patched fits it on the 16 C4 calibration windows


def criteria(beta_values=(0.1, 0.3, 1.0)) -> dict[str, dict]:
    """Name -> how to select. `greedy` ones are sequential, so the largest drop count's order gives every smaller one."""
    table = {"guided": {"criterion": "guided"}, "qsim": {"criterion": "qsim"}}
    for beta in beta_values:
        table[f"tappa-{beta:g}"] = {"criterion": "tappa", "beta": beta}
    table |= {"bi": {"criterion": "bi"}, "angular": {"criterion": "angular"}, "last": {"criterion": "last"},
              "ppl": {"criterion": "ppl"}, "halving": {"criterion": "halving"},
              "halving-patch": {"criterion": "halving", "patch_objective": PATCH_OBJECTIVE}}
    return table


def load_results() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {}


def save_results(results: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(RESULTS)


def eval_windows(tokenizer):
    from prunetool.select.calibration import load_calibration

    return load_calibration(str(DATA / "wikitext2-test.raw"), tokenizer, seq_len=SEQ_LEN, samples=EVAL_WINDOWS)


def select(name: str, spec: dict, scores, model, calibration, drops, memo: dict) -> tuple[dict, float, dict]:
    """{drop: removed} for one criterion, the seconds the selection took, and those seconds by drop count.

    SLEB's greedy is sequential, so the largest drop count's order gives every smaller one. guided runs
    once per drop count with a memo of measured sets (per number of windows), so shared greedy prefixes
    are measured once; its time is the sum, an upper bound on what one drop count costs.
    """
    from prunetool.select.ranking import GUIDED_BETA, GUIDED_WINDOWS, TAPPA_BETA, SelectionRequest
    from prunetool.select.selection import CRITERIA

    criterion = CRITERIA[spec["criterion"]]
    default_beta = GUIDED_BETA if spec["criterion"] == "guided" else TAPPA_BETA
    sequential = spec["criterion"] == "ppl"
    windows = spec.get("refine_windows", PPL_WINDOWS if sequential else GUIDED_WINDOWS)
    started = time.perf_counter()
    out, by_drop = {}, {}
    for drop in ([max(drops)] if sequential else drops):
        clock = time.perf_counter()
        options = {k: spec[k] for k in ("shortlist", "refine_windows", "blocks", "screen_tokens", "patch_objective")
                   if k in spec}
        request = SelectionRequest(scores.num_layers, drop, scores, beta=spec.get("beta", default_beta), model=model,
                                   windows=calibration.input_ids[:windows] if sequential else calibration.input_ids,
                                   measured=memo.setdefault(windows, {}), **options)
        chosen = criterion.select(request)
        if sequential:
            order = chosen.extra["greedy_order"]
            out = {d: sorted(order[:d]) for d in drops}
        else:
            out[drop] = sorted(chosen.removed)
        by_drop[drop] = round(time.perf_counter() - clock, 1)
    return out, time.perf_counter() - started, by_drop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--only", default=None, help="comma-separated criteria to (re)compute")
    parser.add_argument("--report", action="store_true", help="print tables and draw the plot from cached results")
    parser.add_argument("--variant", action="append", default=[],
                        help='a method experiment, NAME=JSON, e.g. g2={"criterion":"guided","beta":0.3}')
    parser.add_argument("--shift-guided", action="store_true",
                        help="also run guided on the other calibration texts and report how its choice moves")
    parser.add_argument("--patched", action="store_true",
                        help="also measure every selection after --patch's fit (on the calibration windows)")
    parser.add_argument("--accuracy", action="store_true",
                        help="lm-eval accuracy at the middle drop count; with --only none, nothing else is measured")
    parser.add_argument("--accuracy-limit", type=int, default=500)
    parser.add_argument("--accuracy-configs", default=None,
                        help="comma-separated: only these (criteria, or base), e.g. to split them over processes")
    args = parser.parse_args()
    if args.report:
        report(load_results())
        return
    results = load_results()
    results.setdefault("provenance", []).append(provenance())  # one record per measuring run; entries are cached
    save_results(results)
    for alias in args.models.split(","):
        run_model(alias, args)


def run_model(alias: str, args) -> None:
    import torch

    from prunetool.select.calibration import load_calibration
    from prunetool.model.in_memory import layers_removed
    from prunetool.model.loading import load_model
    from prunetool.model.perplexity import perplexity
    from prunetool.select.scoring import Scores, score_model
    from prunetool.sources import resolve_model
    from prunetool.sources import model_key

    torch.manual_seed(0)
    results = load_results()
    entry = results.setdefault(alias, {"scores": {}, "configs": {}})
    source = resolve_model(alias)
    model, tokenizer = load_model(source, dtype="float32", device="cpu")
    drops = MODELS[alias]
    evals = eval_windows(tokenizer)

    def ppl(removed) -> float:
        with layers_removed(model, removed):
            return perplexity(model, evals.input_ids)

    if "base" not in entry:
        entry["base"] = ppl([])
        entry["eval"] = evals.describe()
        save_results(results)
    log(f"{alias}: base perplexity {entry['base']:.2f}")
    if args.accuracy and args.only == "none":  # accuracy of the recorded cuts alone: no calibration text needed
        run_accuracy(alias, model, tokenizer, entry, results, args.accuracy_limit, accuracy_names(args))
        return

    calibrations, scores = {}, {}
    for label, file in CALIBRATIONS.items():
        spec = None if file is None else str(DATA / file)
        calibrations[label] = load_calibration(spec, tokenizer, seq_len=SEQ_LEN, samples=SAMPLES, model=model,
                                               model_key=model_key(source))
        if label not in entry["scores"]:
            started = time.perf_counter()
            entry["scores"][label] = score_model(model, calibrations[label], model_name=alias).to_json()
            log(f"{alias}: scored {label} in {time.perf_counter() - started:.0f}s")
            save_results(results)
        scores[label] = Scores.from_json(entry["scores"][label])

    calibration = calibrations[MAIN_CALIBRATION]
    wanted = criteria()
    extra = entry.setdefault("variants", {})  # method experiments recorded beside the criteria
    for item in args.variant:
        name, _, spec = item.partition("=")
        extra[name] = json.loads(spec)
    wanted |= {name: spec for name, spec in extra.items()}
    only = set(args.only.split(",")) if args.only else None
    for name, spec in wanted.items():
        if only is not None and name not in only:
            continue
        done = entry["configs"].get(name)
        if done and all(str(d) in done["drops"] for d in drops) and only is None:
            continue
        # each criterion measures alone: a memo of measured sets is shared across its drop counts only
        chosen, seconds, by_drop = select(name, spec, scores[MAIN_CALIBRATION], model, calibration, drops, {})
        row = {"spec": spec, "select_seconds": seconds, "select_seconds_by_drop": by_drop, "threads": torch.get_num_threads(),
               "drops": {}}
        for drop, removed in chosen.items():
            row["drops"][str(drop)] = {"removed": removed, "ppl": ppl(removed)}
        entry["configs"][name] = row
        save_results(results)
        log(f"{alias}: {name:12s} " + "  ".join(f"{d}:{row['drops'][str(d)]['ppl']:.1f}" for d in drops)
            + f"  ({seconds:.0f}s selecting)")

    if "random" not in entry["configs"] or (only and "random" in only):
        row = {"spec": {"seeds": RANDOM_SEEDS}, "drops": {}}
        for drop in drops:
            runs = []
            for seed in range(RANDOM_SEEDS):
                removed = sorted(random.Random(seed).sample(range(scores[MAIN_CALIBRATION].num_layers), drop))
                runs.append({"removed": removed, "ppl": ppl(removed)})
            row["drops"][str(drop)] = {"ppl": statistics.mean(r["ppl"] for r in runs), "runs": runs}
        entry["configs"]["random"] = row
        save_results(results)
        log(f"{alias}: random " + "  ".join(f"{d}:{row['drops'][str(d)]['ppl']:.1f}" for d in drops))

    if args.patched:
        patched_rows(alias, model, calibration, evals, entry, results)
    entry["calibration_shift"] = calibration_shift(scores, model, calibrations, drops)
    if args.shift_guided and "guided" in entry["configs"]:
        for label in calibrations:
            if label == MAIN_CALIBRATION:
                continue
            chosen, _, _ = select("guided", {"criterion": "guided"}, scores[label], model, calibrations[label], drops, {})
            entry["calibration_shift"][label]["overlap_guided"] = {
                str(d): overlap(chosen[d], entry["configs"]["guided"]["drops"][str(d)]["removed"]) for d in drops}
            entry["calibration_shift"][label]["guided_removed"] = {str(d): chosen[d] for d in drops}
            log(f"{alias}: guided on {label} calibration: " + "  ".join(f"{d}:{chosen[d]}" for d in drops))
    save_results(results)
    if args.accuracy:
        run_accuracy(alias, model, tokenizer, entry, results, args.accuracy_limit, accuracy_names(args))


PATCHED_CONFIGS = ("guided", "qsim", "tappa-0.3", "bi", "angular", "last", "ppl", "halving", "halving-patch")


def patched_rows(alias, model, calibration, evals, entry, results) -> None:
    """WikiText-2 perplexity of the criteria's cuts after `prune --patch`'s fit, fitted on the 16 C4
    calibration windows (the text the criteria chose on), never on WikiText-2. One capture pass serves
    every cut; a cut that several criteria chose is fitted and measured once."""
    from prunetool.repair.judge import patched_perplexities

    wanted = {(name, d): tuple(cell["removed"]) for name in PATCHED_CONFIGS if name in entry["configs"]
              for d, cell in entry["configs"][name]["drops"].items() if "patched_ppl" not in cell}
    if not wanted:
        return
    started = time.perf_counter()
    values = patched_perplexities(model, set(wanted.values()), calibration.input_ids, evals.input_ids, PATCH_OBJECTIVE)
    for (name, d), cut in wanted.items():
        entry["configs"][name]["drops"][d]["patched_ppl"] = values[cut]
    entry["patched_seconds"] = round(time.perf_counter() - started, 1)
    save_results(results)
    log(f"{alias}: {len(set(wanted.values()))} cuts measured after the patch in {entry['patched_seconds']:.0f}s")


def calibration_shift(scores: dict, model, calibrations: dict, drops) -> dict:
    """How much the layer choice moves with the calibration text: Spearman of the per-layer signals, and
    overlap of the removed sets (|A & B| / N) against the main calibration."""
    from prunetool.select.ranking import SelectionRequest
    from prunetool.select.selection import CRITERIA

    out = {}
    main = scores[MAIN_CALIBRATION]
    for label, other in scores.items():
        if label == MAIN_CALIBRATION:
            continue
        row = {metric: spearman(main.column(metric), other.column(metric))
               for metric in ("q_similarity", "q_similarity_post_rope", "block_influence")}
        for name in ("bi", "tappa", "qsim"):
            row[f"overlap_{name}"] = {
                str(d): overlap(CRITERIA[name].select(SelectionRequest(main.num_layers, d, main)).removed,
                                CRITERIA[name].select(SelectionRequest(main.num_layers, d, other)).removed)
                for d in drops}
        out[label] = row
    return out


def spearman(a: list[float], b: list[float]) -> float:
    import torch

    from prunetool.model.metrics import rank01

    ra, rb = rank01(torch.tensor(a)), rank01(torch.tensor(b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / math.sqrt(float((ra * ra).sum() * (rb * rb).sum())))


def overlap(a, b) -> float:
    return len(set(a) & set(b)) / len(a)


ACCURACY_CONFIGS = ("halving", "ppl", "guided", "bi", "angular")  # at the middle drop count, beside the base model


def accuracy_names(args) -> tuple[str, ...] | None:
    return tuple(args.accuracy_configs.split(",")) if args.accuracy_configs else None


def save_accuracy(alias: str, key: str, row: dict) -> None:
    """One accuracy row into the results file as it is now, so runs on other configs (other processes,
    `--accuracy-configs`) keep theirs."""
    fresh = load_results()
    fresh[alias].setdefault("accuracy", {})[key] = row
    save_results(fresh)


def run_accuracy(alias, model, tokenizer, entry, results, limit: int, names: tuple[str, ...] | None = None) -> None:
    """lm-eval accuracy (local task copies) for the base and the ACCURACY_CONFIGS at the middle drop count."""
    from prunetool.evaluation.runner import TaskManagers, evaluate_tasks, make_lm
    from prunetool.evaluation.tasks import plan_tasks
    from prunetool.model.in_memory import layers_removed

    plans, managers = plan_tasks(ACCURACY_TASKS.split(","), DATA), TaskManagers(DATA)
    middle = str(MODELS[alias][1])
    table = entry.setdefault("accuracy", {})
    for name in names or ACCURACY_CONFIGS + ("base",):  # the default first, the base last: a cut-short run keeps what matters
        removed = [] if name == "base" else entry["configs"][name]["drops"][middle]["removed"]
        key = "base" if name == "base" else f"{name}@{middle}"
        if table.get(key, {}).get("limit") == limit and table[key].get("removed") == removed:
            continue
        twin = next((other for other, row in table.items() if row.get("limit") == limit and row.get("removed") == removed
                     and "same_as" not in row), None)
        if twin is not None:  # another criterion chose the same layers: the same model, evaluated once
            table[key] = {**table[twin], "same_as": twin}
            save_accuracy(alias, key, table[key])
            continue
        measured_there = repair_bench_accuracy(alias, removed, limit)
        if measured_there is not None:
            table[key] = measured_there
            save_accuracy(alias, key, table[key])
            continue
        started = time.perf_counter()
        with layers_removed(model, removed):
            merged, _ = evaluate_tasks(make_lm(model, tokenizer, "auto"), plans, managers, limit=limit, num_fewshot=None)
        metrics = {task: {k.split(",")[0]: v for k, v in values.items()
                          if k.split(",")[0] in ("acc", "acc_norm", "perplexity") and not k.startswith("alias")}
                   for task, values in merged["results"].items()}
        table[key] = {"removed": removed, "limit": limit, "metrics": metrics,
                      "seconds": round(time.perf_counter() - started, 1)}
        save_accuracy(alias, key, table[key])
        log(f"{alias}: accuracy {key} " + ", ".join(f"{t} {m.get('acc', float('nan')):.3f}" for t, m in metrics.items()))


def repair_bench_accuracy(alias: str, removed: list[int], limit: int) -> dict | None:
    """The same tasks on the same cut, already run by bench/repair_heal.py (its base row, or its plain cut:
    a written checkpoint, equal to the in-memory removal), so no model is evaluated twice."""
    for path in sorted((RESULTS.parent).glob(f"repair_heal-{alias}-*.json")):
        other = json.loads(path.read_text())
        setting = other["setting"]
        if setting["limit"] != limit or setting["tasks"] != ACCURACY_TASKS.split(","):
            continue
        for row in other["rows"]:
            cut = [] if row["row"] == "base" else setting["removed"] if row["row"] == "plain" else None
            if cut == removed and "accuracy" in row:
                return {"removed": removed, "limit": limit, "from": f"{path.name} ({row['row']} row)",
                        "metrics": {task: {"acc": value} for task, value in row["accuracy"].items()}}
    return None


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


PEERS = ("bi", "angular", "tappa-0.3", "last")  # the q-similarity default's bar: no worse than the best of these
LABELS = {"halving": "halving (default)", "guided": "guided (the previous default)", "tappa-0.3": "tappa (beta 0.3, as published)", "ppl": "ppl (SLEB greedy)",
          "random": "random (mean of 5 seeds)"}


def measured(results: dict) -> list[tuple[str, dict]]:
    """(model, entry) pairs of the results file, without its provenance records."""
    return [(alias, entry) for alias, entry in results.items() if alias in MODELS]


def default_removal(results: dict, alias: str, drop: int) -> list[int]:
    """The layers the default criterion removed from `alias` at `drop`, as measured here."""
    return results[alias]["configs"][DEFAULT]["drops"][str(drop)]["removed"]


def fmt(value: float) -> str:
    return f"{value:.1f}" if value < 1e4 else f"{value:.1e}"


def report(results: dict) -> None:
    """Markdown tables (stdout) and the perplexity-against-drop plot (docs/quality.png)."""
    print(report_markdown(results))
    plot(results)


def report_markdown(results: dict) -> str:
    """The tables of docs/benchmarks.md, from the cached results alone (bench/render_docs.py calls this)."""
    out: list[str] = []  # blocks of lines, joined by newlines as print would
    for alias, entry in measured(results):
        drops = MODELS[alias]
        configs = entry["configs"]
        out.append(f"\n### {alias}: WikiText-2 perplexity after removing N layers (base {entry['base']:.2f})\n")
        out.append("| criterion | " + " | ".join(f"N = {d}" for d in drops) + " | selection s (all N) |")
        out.append("|---|" + "---|" * (len(drops) + 1))
        order = ["halving", "guided", "qsim", "tappa-0.1", "tappa-0.3", "tappa-1", "bi", "angular", "last", "ppl", "random"]
        order += [name for name in configs if name not in order]
        for name in order:
            if name not in configs:
                continue
            row = configs[name]
            cells = [fmt(row["drops"][str(d)]["ppl"]) if str(d) in row["drops"] else "-" for d in drops]
            seconds = f"{row['select_seconds']:.0f}" if "select_seconds" in row else "-"
            out.append(f"| {LABELS.get(name, name)} | " + " | ".join(cells) + f" | {seconds} |")
        best = [min(configs[p]["drops"][str(d)]["ppl"] for p in PEERS if p in configs) for d in drops]
        ours = [configs["guided"]["drops"][str(d)]["ppl"] for d in drops] if "guided" in configs else None
        out.append("| best of bi, angular, tappa, last | " + " | ".join(fmt(v) for v in best) + " | |")
        if ours:
            verdict = ["yes" if o <= b * (1 + 1e-9) else f"no (+{100 * (o / b - 1):.1f}%)" for o, b in zip(ours, best)]
            out.append("| guided no worse than the best peer? | " + " | ".join(verdict) + " | |")
        out.append(f"\nRemoved layers (0-based):\n")
        out.append("| criterion | " + " | ".join(f"N = {d}" for d in drops) + " |")
        out.append("|---|" + "---|" * len(drops))
        for name in order:
            if name in configs and name != "random":
                out.append(f"| {name} | " + " | ".join(
                    ",".join(map(str, configs[name]["drops"][str(d)]["removed"])) for d in drops) + " |")
        accuracy = entry.get("accuracy", {})
        if accuracy:
            tasks = ACCURACY_TASKS.split(",")
            limits = sorted({row["limit"] for row in accuracy.values()})
            out.append(f"\nlm-eval accuracy, first {'/'.join(map(str, limits))} documents per task (local copies; "
                       "0-shot; acc, with acc_norm in brackets where lm-eval reports it)\n")
            out.append("| model | " + " | ".join(tasks) + " | mean acc |")
            out.append("|---|" + "---|" * (len(tasks) + 1))
            for key, row in accuracy.items():
                cells, accs = [], []
                for task in tasks:
                    metric = row["metrics"].get(task, {})
                    accs.append(metric.get("acc", float("nan")))
                    norm = f" ({metric['acc_norm']:.3f})" if "acc_norm" in metric else ""
                    cells.append(f"{metric.get('acc', float('nan')):.3f}{norm}")
                out.append(f"| {key} | " + " | ".join(cells) + f" | {sum(accs) / len(accs):.3f} |")
        shift = entry.get("calibration_shift", {})
        if shift:
            out.append(f"\nCalibration sensitivity against {MAIN_CALIBRATION}: Spearman of per-layer scores, and the "
                       "share of removed layers in common at each N\n")
            kinds = ("guided", "bi", "tappa", "qsim")
            out.append("| calibration | q-sim | post-RoPE q-sim | BI | " + " | ".join(f"{c} overlap" for c in kinds) + " |")
            out.append("|---|---|---|---|" + "---|" * len(kinds))
            for label, row in shift.items():
                overlaps = ["/".join(f"{row[f'overlap_{c}'][str(d)]:.2f}" for d in drops) if f"overlap_{c}" in row
                            else "-" for c in kinds]
                out.append(f"| {label} | {row['q_similarity']:.3f} | {row['q_similarity_post_rope']:.3f} | "
                           f"{row['block_influence']:.3f} | " + " | ".join(overlaps) + " |")
    return "\n".join(out).strip("\n")


SEARCH_ROWS = ("guided", "bi", "angular", "ppl", "halving", "halving-patch")


def search_markdown(results: dict) -> str:
    """The SLEB comparison: every search plain and patched at each drop count, selection time, goals."""
    out: list[str] = []
    for alias, entry in measured(results):
        drops, configs = MODELS[alias], entry["configs"]
        if DEFAULT not in configs or "ppl" not in configs:
            continue
        out.append(f"\n{alias} (base {entry['base']:.2f}): WikiText-2 perplexity after removing N layers, plain cut / "
                   "after `--patch`'s fit; selection seconds at each N (measured alone)\n")
        out.append("| criterion | " + " | ".join(f"N = {d}" for d in drops) + " | " + " | ".join(f"s at N = {d}" for d in drops) + " |")
        out.append("|---|" + "---|" * (2 * len(drops)))
        for name in SEARCH_ROWS:
            if name not in configs:
                continue
            row = configs[name]
            cells = []
            for d in drops:
                cell = row["drops"].get(str(d), {})
                patched = f" / {fmt(cell['patched_ppl'])}" if "patched_ppl" in cell else ""
                cells.append(f"{fmt(cell['ppl'])}{patched}" if cell else "-")
            seconds = row.get("select_seconds_by_drop", {})
            if name == "ppl":  # one greedy run to the largest N gives every smaller N
                times = [f"{row['select_seconds']:.0f} (all N)" if d == max(drops) else "" for d in drops]
            elif seconds:
                mark = "†" if row.get("threads") == 1 else ""
                times = [f"{seconds[str(d)] if str(d) in seconds else seconds[d]:.0f}{mark}" for d in drops]
            else:
                times = ["" for d in drops]
            label = {"halving-patch": "halving, judged after the patch (`--patch`)", DEFAULT: f"{DEFAULT} (default)"}
            out.append(f"| {label.get(name, LABELS.get(name, name))} | " + " | ".join(cells) + " | " + " | ".join(times) + " |")
    if any(row.get("threads") == 1 for _, entry in measured(results) for row in entry["configs"].values()):
        out.append("\n† measured on one thread (the other core ran another benchmark); the others on two.")
    goals = search_goals(results)
    if goals:
        out.append("\nAgainst the SLEB comparison's goals:\n")
        out.extend(goals)
    return "\n".join(out).strip("\n")


def search_goals(results: dict) -> list[str]:
    """Each goal checked against the measured rows: met, or missed by how much."""
    lines = []
    for alias, entry in measured(results):
        configs = entry["configs"]
        if DEFAULT not in configs or "ppl" not in configs:
            continue
        drops = MODELS[alias]
        ours = [configs[DEFAULT]["drops"][str(d)]["ppl"] for d in drops]
        sleb = [configs["ppl"]["drops"][str(d)]["ppl"] for d in drops]
        same = [configs[DEFAULT]["drops"][str(d)]["removed"] == configs["ppl"]["drops"][str(d)]["removed"] for d in drops]
        verdicts = [f"N = {d}: " + ("the same layers" if alike else f"{o:.2f} against {b:.2f}"
                                     + ("" if o <= b else f" (**missed** by {100 * (o / b - 1):.2f}%)"))
                    for d, o, b, alike in zip(drops, ours, sleb, same)]
        met = all(alike or o <= b for o, b, alike in zip(ours, sleb, same))
        lines.append(f"- {alias}: no worse than SLEB at every N ({'**met**' if met else '**missed**'}): " + "; ".join(verdicts) + ".")
        deepest = max(drops)
        by_drop = configs[DEFAULT].get("select_seconds_by_drop", {})
        mine = by_drop.get(str(deepest), by_drop.get(deepest))
        if mine is not None:
            share = mine / configs["ppl"]["select_seconds"]
            lines.append(f"- {alias}: selection time at N = {deepest} at most 25% of SLEB's: {mine:.0f} s against "
                         f"{configs['ppl']['select_seconds']:.0f} s, {100 * share:.0f}% ({'**met**' if share <= 0.25 else '**missed**'}).")
        gain = 0.0 if same[-1] else 1 - ours[-1] / sleb[-1]
        lines.append(f"- {alias}, stretch: at least 10% better than SLEB at N = {deepest}: "
                     + ("the same layers" if same[-1] else f"{100 * gain:+.1f}%") + f" ({'**met**' if gain >= 0.10 else '**missed**'}).")
        accuracy = entry.get("accuracy", {})
        middle = MODELS[alias][1]
        peers = {name: accuracy.get(f"{name}@{middle}") for name in ("bi", "angular", "ppl")}
        mine = accuracy.get(f"{DEFAULT}@{middle}")
        if mine is not None and all(peers.values()):
            mean = lambda row: statistics.mean(row["metrics"][t]["acc"] for t in ACCURACY_TASKS.split(","))
            best = max(peers, key=lambda n: mean(peers[n]))
            bar = mean(peers[best]) - 0.01
            ok = mean(mine) >= bar
            lines.append(f"- {alias}: mean accuracy at N = {middle} no worse than the best of BI, angular and SLEB minus "
                         f"0.01: {mean(mine):.4f} against {best}'s {mean(peers[best]):.4f} - 0.01 = {bar:.4f} ("
                         + ("**met**" if ok else f"**missed** by {bar - mean(mine):.4f}") + ").")
    return lines


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = measured(results)
    figure, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5))
    axes = [axes] if len(models) == 1 else axes
    styles = {DEFAULT: ("black", "-", 2.5), "ppl": ("tab:gray", "--", 1.5), "random": ("tab:gray", ":", 1.5)}
    for axis, (alias, entry) in zip(axes, models):
        drops = (0,) + MODELS[alias]
        for name in [DEFAULT, "guided", "qsim", "tappa-0.3", "bi", "angular", "last", "ppl", "random"]:
            if name not in entry["configs"]:
                continue
            values = [entry["base"]] + [entry["configs"][name]["drops"][str(d)]["ppl"] for d in drops[1:]]
            color, line, width = styles.get(name, (None, "-", 1.2))
            axis.plot(drops, values, marker="o", label=LABELS.get(name, name), color=color, linestyle=line,
                      linewidth=width)
        axis.set_yscale("log")
        axis.set_ylim(entry["base"] * 0.8, entry["base"] * 200)
        axis.set_xticks(drops)
        axis.set_xlabel("layers removed")
        axis.set_ylabel("WikiText-2 perplexity (log scale)")
        axis.set_title(f"{alias} ({len(entry['scores'][MAIN_CALIBRATION]['layers'])} layers), C4 calibration")
        axis.grid(alpha=0.3)
    axes[-1].legend(fontsize=8, loc="upper left")
    figure.tight_layout()
    figure.savefig(PLOT, dpi=110)
    print(f"\nplot written to {PLOT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
