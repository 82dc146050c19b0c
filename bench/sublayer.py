"""Attention sublayers against whole blocks: what each cut keeps of quality, and what it saves.

SmolLM2-135M (float32, CPU): remove attention sublayers at N = 6, 9, 12 and whole blocks at N = 3, 6, 9.
Attention cuts are chosen by the default search (halving, sublayers as candidates), by q-similarity
alone (the TAPPA signal, no measuring) and by a BlockPruner-style perplexity greedy over sublayers
(the ppl criterion at --unit attention), each with its selection time. Block cuts are chosen by the
default search. Every cut is applied in memory and judged on the usual held-out WikiText-2 windows
(16 x 512 tokens, never seen by any selection); parameters, KV-cache bytes per token and decode
tokens/s (eval's efficiency measurement, median of 3) are measured on the same process and machine.
`--accuracy` adds lm-eval mean accuracy on the four local tasks (500 documents each).

Run:   .venv/bin/python bench/sublayer.py                 # perplexity, efficiency, selection time
       .venv/bin/python bench/sublayer.py --accuracy      # adds lm-eval accuracy for every cut
       .venv/bin/python bench/sublayer.py --report        # tables from the cached results only
Results are cached in bench/results/sublayer.json (delete a row to measure it again).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "bench" / "results" / "sublayer.json"
MODEL = "smollm2-135m"
SEQ_LEN, SAMPLES, EVAL_WINDOWS, PPL_WINDOWS = 512, 16, 16, 4
CALIBRATION = "c4_en_sample_1000.jsonl"
ATTENTION_DROPS, BLOCK_DROPS = (6, 9, 12), (3, 6, 9)
ATTENTION_CRITERIA = ("halving", "qsim", "ppl")
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


def measure(model, evals, removed: list[int], unit: str) -> dict:
    from prunetool.evaluation.efficiency import measure_efficiency
    from prunetool.model.runner import cut_perplexity, removed_units

    with removed_units(model, removed, unit):
        efficiency = measure_efficiency(model)
    return {"perplexity": cut_perplexity(model, evals.input_ids, removed=removed, unit=unit),
            "efficiency": efficiency}


def accuracy(model, tokenizer, removed: list[int], unit: str, limit: int) -> dict:
    from prunetool.evaluation.runner import evaluate_tasks, make_lm
    from prunetool.evaluation.tasks import TaskManagers, data_dir_from, plan_tasks
    from prunetool.model.runner import removed_units

    data_dir = data_dir_from(DATA)
    with removed_units(model, removed, unit):
        lm = make_lm(model, tokenizer, "auto", None)
        results, _ = evaluate_tasks(lm, plan_tasks(list(TASKS), data_dir), TaskManagers(data_dir), limit=limit,
                                    num_fewshot=None)
    scores = {task: results["results"][task]["acc,none"] for task in TASKS}
    return {"tasks": scores, "mean": sum(scores.values()) / len(scores), "limit": limit}


def run(args) -> None:
    import torch

    from prunetool.model.loading import load_model
    from prunetool.select.calibration import load_calibration
    from prunetool.select.scoring import score_model
    from prunetool.sources import resolve_model

    torch.manual_seed(0)
    results = load_results()
    results["provenance"] = provenance()  # the run that measured the rows still missing
    model, tokenizer = load_model(resolve_model(MODEL), dtype="float32", device="cpu")
    evals = load_calibration(str(DATA / "wikitext2-test.raw"), tokenizer, seq_len=SEQ_LEN, samples=EVAL_WINDOWS)
    calibration = load_calibration(str(DATA / CALIBRATION), tokenizer, seq_len=SEQ_LEN, samples=SAMPLES)
    scores = score_model(model, calibration, model_name=MODEL)
    results["held_out"], results["calibration"] = evals.describe(), calibration.describe()
    jobs = [("base", "block", 0)] + [(c, "attention", n) for n in ATTENTION_DROPS for c in ATTENTION_CRITERIA]
    jobs += [("halving", "block", n) for n in BLOCK_DROPS]
    for criterion, unit, drop in jobs:
        key = "base" if drop == 0 else f"{unit}:{criterion}@{drop}"
        row = results["rows"].setdefault(key, {"unit": unit, "criterion": criterion, "drop": drop})
        if "perplexity" not in row:
            removed, seconds = ([], 0.0) if drop == 0 else select(criterion, unit, drop, scores, model, calibration)
            row |= {"removed": removed, "select_seconds": round(seconds, 1)} | measure(model, evals, removed, unit)
            print(f"{key}: {removed} ppl {row['perplexity']:.3f} in {seconds:.0f}s", file=sys.stderr, flush=True)
            save_results(results)
        if args.accuracy and "accuracy" not in row:
            row["accuracy"] = accuracy(model, tokenizer, row["removed"], unit, args.accuracy_limit)
            print(f"{key}: accuracy {row['accuracy']['mean']:.4f}", file=sys.stderr, flush=True)
            save_results(results)


def table(results: dict) -> str:
    return markdown(results)


def markdown(results: dict) -> str:
    """The comparison table: every cut's quality and savings relative to the base."""
    rows = results["rows"]
    base = rows["base"]
    lines = ["| unit | criterion | N | removed | WikiText-2 ppl (x base) | mean acc | KV bytes/token | parameters | "
             "decode tok/s | selection s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key, row in rows.items():
        efficiency, reference = row["efficiency"], base["efficiency"]
        acc = row.get("accuracy", {}).get("mean")

        def ratio(name):
            return f"{efficiency[name] / reference[name]:.2f}x"

        lines.append(f"| {row['unit'] if row['drop'] else 'base'} | {row['criterion'] if row['drop'] else '-'} | "
                     f"{row['drop']} | {row['removed'] or '-'} | {row['perplexity']:.2f} "
                     f"({row['perplexity'] / base['perplexity']:.2f}x) | {'-' if acc is None else f'{acc:.4f}'} | "
                     f"{ratio('kv_cache_bytes_per_token')} | {ratio('parameters')} | "
                     f"{ratio('decode_tokens_per_second')} | {row['select_seconds']:.0f} |")
    setting = base["efficiency"]["setting"]
    lines.append("")
    lines.append(f"Efficiency relative to the base on {setting['device']} ({setting['dtype']}, batch 1, decode "
                 f"{setting['decode_tokens']} tokens after {setting['decode_prompt_tokens']}, median of "
                 f"{setting['repeats']}); held-out text: {results['held_out']['windows']} x "
                 f"{results['held_out']['seq_len']} tokens of WikiText-2 test.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accuracy", action="store_true")
    parser.add_argument("--accuracy-limit", type=int, default=500)
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args()
    if not args.report:
        run(args)
    print(markdown(load_results()))


if __name__ == "__main__":
    main()
