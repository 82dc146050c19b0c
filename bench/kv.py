"""KV-cache budgets applied: long-context accuracy against average cache per layer, per schedule.

For one model, every document of every task is prefilled once (prunetool.kv.snapkv, SnapKV-style scoring
with a 32-token observation window); the full cache and each schedule's cache at each average budget are
built from that prefill, and every choice is scored through each (prunetool.evaluation.kv_eval, the code
`prunetool eval --kv-budget` runs). Schedules: uniform, pyramid (PyramidKV), tappa (TAPPA's 1 - q-similarity
of the prompt's last 32 post-RoPE queries), tappa-floor (full-attention layers get at least the average),
tappa-cake (1 - q-similarity times the window's attention entropy, after CAKE).

Tasks (prunetool/evaluation/long_context.py): needle and multi-key retrieval in WikiText-2 text at 1k, 2k
and 4k tokens (10 documents each: every needle depth twice), and the hop probes at 2048 items (20
documents each). Nothing here is fitted or chosen: the schedules' rules are fixed in advance.

Also reported: seconds of the prefill, of the compression step (schedule + top-k + gather) and of the
scoring, and the memory the window scoring needs against a full attention matrix.

Run:   nice .venv/bin/python bench/kv.py --model smollm2-135m      (and --model gemma3-270m)
       .venv/bin/python bench/kv.py --plot                          (docs/kv.png; also make docs)
       .venv/bin/python bench/kv.py --layers --model gemma3-270m     (per-layer budgets of each schedule)
Writes bench/results/kv-MODEL.json (and kv_layers-MODEL.json); `table`, `goals` and `layers_table` render them
for docs/kv.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
DATA = ROOT.parent / "shared" / "data"
TASKS = "needle_1024,multikey_1024,needle_2048,multikey_2048,needle_4096,multikey_4096,hop_name_2048,hop_number_2048"
SCHEDULES = "uniform,pyramid,tappa,tappa-floor,tappa-cake"
BUDGETS = "64,128,256,512"
PLOT = ROOT / "docs" / "kv.png"
MODELS = ("smollm2-135m", "gemma3-270m")
SIMILARITY_SCHEDULES = ("tappa", "tappa-floor", "tappa-cake")
SCHEDULE_ORDER = ("uniform", "pyramid", *SIMILARITY_SCHEDULES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", default=TASKS)
    parser.add_argument("--schedules", default=SCHEDULES)
    parser.add_argument("--budgets", default=BUDGETS)
    parser.add_argument("--limit", type=int, default=10, help="documents per needle/multikey task")
    parser.add_argument("--hop-limit", type=int, default=20, help="documents per hop task")
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--name", default=None)
    args = parser.parse_args()

    import torch
    from rich.console import Console

    from prunetool.evaluation.kv_eval import evaluate_long_context
    from prunetool.evaluation.long_context import load_haystack, parse_name
    from prunetool.kv.schedules import parse_schedule
    from prunetool.model.loading import load_model
    from prunetool.sources import resolve_model
    from provenance import write_results

    console = Console(stderr=True)
    model, tokenizer = load_model(resolve_model(args.model), dtype=args.dtype, device="cpu")
    text = model.config.get_text_config(decoder=True)
    layers, context = text.num_hidden_layers, text.max_position_embeddings
    schedules = [parse_schedule(f"{kind}:{budget}", num_layers=layers, max_context=context)
                 for budget in args.budgets.split(",") for kind in args.schedules.split(",")]
    haystack, source = load_haystack(DATA)
    results = {"setting": {"model": args.model, "layers": layers, "context": context, "window": args.window,
                           "dtype": args.dtype, "haystack": source, "schedules": args.schedules.split(","),
                           "budgets": [int(b) for b in args.budgets.split(",")],
                           "threads": torch.get_num_threads(),
                           "sliding_window": getattr(text, "sliding_window", None),
                           "kv_heads": text.num_key_value_heads, "heads": text.num_attention_heads,
                           "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads},
               "tasks": {}, "cache": {}, "seconds": {"prefill": 0.0, "compress": 0.0, "score": 0.0}}
    clock = time.perf_counter()
    for name in args.tasks.split(","):
        task = parse_name(name)
        limit = args.hop_limit if task.kind.startswith("hop") else args.limit
        started = time.perf_counter()
        result = evaluate_long_context(
            model, tokenizer, [task], schedules, window=args.window, haystack=haystack, limit=limit,
            on_document=lambda t, n, total: console.print(f"  {t} {n}/{total} {time.perf_counter() - started:.0f}s",
                                                          highlight=False))
        results["tasks"][name] = result["tasks"][name] | {"cache": result["cache"], "seconds": result["seconds"]}
        for key, value in result["seconds"].items():
            results["seconds"][key] += value
        results["columns"] = result["columns"]
        console.print(f"{name}: {result['tasks'][name]['accuracy']}", highlight=False)
        results["total_seconds"] = round(time.perf_counter() - clock, 1)
        write_results(args.name or f"kv-{args.model}", results)


def layer_main() -> None:
    """--layers: per-layer budgets each schedule gives at one average budget, over the first needle documents."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", action="store_true")
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--task", default="needle_2048")
    parser.add_argument("--documents", type=int, default=5)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--schedules", default=SCHEDULES)
    args = parser.parse_args()

    from prunetool.evaluation.kv_eval import document_inputs
    from prunetool.evaluation.long_context import documents_for, load_haystack, parse_name
    from prunetool.kv import snapkv
    from prunetool.kv.schedules import layer_budgets, parse_schedule
    from prunetool.model.loading import load_model
    from prunetool.sources import resolve_model
    from provenance import write_results

    model, tokenizer = load_model(resolve_model(args.model), dtype="float32", device="cpu")
    haystack, _ = load_haystack(DATA)
    documents = documents_for(parse_name(args.task), tokenizer, haystack, args.documents)
    kinds = args.schedules.split(",")
    totals: dict[str, list[float]] = {}
    similarity, full_attention = None, None
    for document in documents:
        context, _ = document_inputs(tokenizer, document)
        prefilled = snapkv.prefill(model, context)
        full_attention = prefilled.full_attention
        similarity = [a + b for a, b in zip(similarity or [0.0] * len(prefilled.layers), prefilled.q_similarity)]
        for kind in kinds:
            schedule = parse_schedule(f"{kind}:{args.budget}", num_layers=len(prefilled.layers), max_context=2**31)
            budgets = layer_budgets(schedule, prefilled.caps, q_similarity=prefilled.q_similarity,
                                    preference=prefilled.preference, full_attention=prefilled.full_attention)
            totals[kind] = [a + b for a, b in zip(totals.get(kind, [0.0] * len(budgets)), budgets)]
    count = len(documents)
    write_results(f"kv_layers-{args.model}", {
        "setting": {"model": args.model, "task": args.task, "documents": count, "budget": args.budget},
        "layers": [{"index": i, "full_attention": full_attention[i], "q_similarity": similarity[i] / count,
                    "budgets": {kind: totals[kind][i] / count for kind in kinds}} for i in range(len(full_attention))]})


def layers_table(results: dict) -> str:
    """Mean budget per layer under each schedule (full-attention layers in bold)."""
    setting, layers = results["setting"], results["layers"]
    kinds = list(layers[0]["budgets"])
    lines = [f"{setting['model']}, average budget {setting['budget']}, mean over the first {setting['documents']} "
             f"{setting['task']} documents (q-sim: the prompt's last 32 post-RoPE queries):", "",
             "| layer | attention | q-sim | " + " | ".join(kinds) + " |", "|---:|---|---:|" + "---:|" * len(kinds)]
    for layer in layers:
        kind = "**full**" if layer["full_attention"] else "sliding"
        lines.append(f"| {layer['index']} | {kind} | {layer['q_similarity']:.3f} | "
                     + " | ".join(f"{layer['budgets'][k]:.0f}" for k in kinds) + " |")
    return "\n".join(lines)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def mean_accuracy(results: dict, column: str) -> float:
    """Accuracy averaged over the tasks (each task weighs the same)."""
    return _mean([task["accuracy"][column] for task in results["tasks"].values()])


def share_of_full(results: dict, column: str) -> float:
    """Kept positions over what the full cache holds, over all documents of all tasks."""
    kept = [task["cache"][column]["share_of_full"] * task["documents"] for task in results["tasks"].values()]
    return sum(kept) / sum(task["documents"] for task in results["tasks"].values())


def table(results: dict) -> str:
    """Mean accuracy per schedule (rows) and average budget (columns), then accuracy per task."""
    setting, tasks = results["setting"], results["tasks"]
    budgets, schedules = setting["budgets"], setting["schedules"]
    full = mean_accuracy(results, "full")
    lines = [f"{setting['model']}: mean accuracy over {len(tasks)} tasks ({sum(t['documents'] for t in tasks.values())} "
             f"documents; full cache {full:.3f}); in brackets, the cache kept as a share of the full cache.", "",
             "| schedule | " + " | ".join(f"{b} / layer" for b in budgets) + " |",
             "|---|" + "---:|" * len(budgets)]
    for kind in schedules:
        cells = [f"{mean_accuracy(results, f'{kind}:{b}'):.3f} ({share_of_full(results, f'{kind}:{b}'):.0%})"
                 for b in budgets]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines += ["", "| task | tokens | full | " + " | ".join(f"{k}:{b}" for b in budgets for k in schedules) + " |",
              "|---|---:|---:|" + "---:|" * (len(budgets) * len(schedules))]
    for name, task in tasks.items():
        cells = [f"{task['accuracy'][f'{k}:{b}']:.2f}" for b in budgets for k in schedules]
        lines.append(f"| {name} ({task['documents']}) | {task['mean_prompt_tokens']:.0f} | {task['accuracy']['full']:.2f} | "
                     + " | ".join(cells) + " |")
    seconds = results["seconds"]
    documents = sum(t["documents"] for t in tasks.values())
    configurations = len(results["columns"]) - 1
    longest = max(t["mean_prompt_tokens"] for t in tasks.values())
    heads, window = setting["heads"], setting["window"]
    lines += ["", f"Cost on this CPU ({setting['threads']} threads, {setting['dtype']}): prefill "
              f"{seconds['prefill'] / documents:.2f} s per document (all prompt tokens through the model once, window "
              f"scores included); the compression step (schedule, top-k, gather) {1000 * seconds['compress'] / (documents * configurations):.1f} ms "
              f"per document and schedule; scoring the choices through one cache {seconds['score'] / (documents * (configurations + 1)):.2f} s. "
              f"The window scores need {window} x T logits per head and layer: {heads * window * longest * 4 / 2**20:.1f} MiB "
              f"at the longest prompts ({longest:.0f} tokens) against {heads * longest * longest * 4 / 2**20:.0f} MiB for the full "
              "T x T attention of one layer."]
    return "\n".join(lines)


def at_twelve_percent(results: dict, kind: str) -> float:
    """Accuracy over tasks, each at the grid budget nearest 12.5% of its prompt (the full cache for `full`)."""
    budgets = results["setting"]["budgets"]
    values = []
    for task in results["tasks"].values():
        if kind == "full":
            values.append(task["accuracy"]["full"])
            continue
        budget = min(budgets, key=lambda b: abs(b - task["mean_prompt_tokens"] / 8))
        values.append(task["accuracy"][f"{kind}:{budget}"])
    return _mean(values)


def goals(*files: dict) -> str:
    """The KV-budget goal: at every average budget <= 256, the best q-similarity schedule against uniform and pyramid."""
    lines = ["| model | budget | uniform | pyramid | best q-similarity schedule | goal |", "|---|---:|---:|---:|---|---|"]
    for results in files:
        for budget in [b for b in results["setting"]["budgets"] if b <= 256]:
            uniform = mean_accuracy(results, f"uniform:{budget}")
            pyramid = mean_accuracy(results, f"pyramid:{budget}")
            kinds = [k for k in SIMILARITY_SCHEDULES if k in results["setting"]["schedules"]]
            best = max(kinds, key=lambda k: mean_accuracy(results, f"{k}:{budget}"))
            value = mean_accuracy(results, f"{best}:{budget}")
            met = value >= uniform and value >= pyramid
            lines.append(f"| {results['setting']['model']} | {budget} | {uniform:.3f} | {pyramid:.3f} | {best} {value:.3f} | "
                         + ("met" if met else f"missed by {max(uniform, pyramid) - value:.3f}") + " |")
    lines += ["", "Stretch, each task at the budget nearest 12.5% of its prompt (1k tokens: 128, 2k: 256, 4k: 512):", "",
              "| model | full | " + " | ".join(SCHEDULE_ORDER) + " | best q-similarity schedule within 0.02 of full |",
              "|---|---:|" + "---:|" * len(SCHEDULE_ORDER) + "---|"]
    for results in files:
        full = at_twelve_percent(results, "full")
        values = {kind: at_twelve_percent(results, kind) for kind in SCHEDULE_ORDER if kind in results["setting"]["schedules"]}
        best = max((k for k in values if k in SIMILARITY_SCHEDULES), key=values.get)
        verdict = "met" if values[best] >= full - 0.02 else f"missed by {full - 0.02 - values[best]:.3f}"
        lines.append(f"| {results['setting']['model']} | {full:.3f} | "
                     + " | ".join(f"{values[k]:.3f}" if k in values else "—" for k in SCHEDULE_ORDER)
                     + f" | {best} {values[best]:.3f}: {verdict} |")
    return "\n".join(lines)


def load_results() -> list[dict]:
    import json

    paths = [ROOT / "bench" / "results" / f"kv-{model}.json" for model in MODELS]
    return [json.loads(path.read_text()) for path in paths if path.exists()]


def plot(files: list[dict]) -> None:
    """docs/kv.png: mean accuracy against average cache per layer, one line per schedule, full cache dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(files), figsize=(6 * len(files), 4.2))
    axes = [axes] if len(files) == 1 else axes
    styles = {"uniform": ("black", "-"), "pyramid": ("tab:gray", "--"), "tappa": ("tab:blue", "-"),
              "tappa-floor": ("tab:orange", "-"), "tappa-cake": ("tab:green", "-")}
    for axis, results in zip(axes, files):
        budgets = results["setting"]["budgets"]
        for kind in results["setting"]["schedules"]:
            color, line = styles.get(kind, (None, "-"))
            axis.plot(budgets, [mean_accuracy(results, f"{kind}:{b}") for b in budgets], marker="o", label=kind,
                      color=color, linestyle=line)
        axis.axhline(mean_accuracy(results, "full"), color="tab:red", linestyle=":", label="full cache")
        axis.set_xscale("log", base=2)
        axis.set_xticks(budgets, [str(b) for b in budgets])
        axis.set_ylim(0, 1.02)
        axis.set_xlabel("average cache per layer and KV head (tokens)")
        axis.set_ylabel(f"mean accuracy over {len(results['tasks'])} tasks")
        axis.set_title(f"{results['setting']['model']}: needle, multi-key (1k-4k tokens), hop probes")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    figure.savefig(PLOT, dpi=110)
    print(f"plot written to {PLOT.relative_to(ROOT)}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--plot"]:
        plot(load_results())
    elif "--layers" in sys.argv[1:]:
        layer_main()
    else:
        main()
