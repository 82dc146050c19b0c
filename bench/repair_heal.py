"""Repair end to end: plain cut, `--patch`, `heal`, patch + heal, cross-entropy LoRA (the repair goals' evidence).

Every row is made by the commands a user runs (commands.prune.run_prune with --remove-layers and
commands.heal.run_heal), so the numbers include their verification and atomic writes. Each written folder
is then judged, like its base, on:

- WikiText-2 test perplexity over its first 16 non-overlapping 512-token windows (bench/quality.py's
  windows; nothing is fitted or chosen on them);
- lm-eval accuracy on lambada_openai, arc_easy, piqa and winogrande (--limit 500 by default), from the
  files in ../shared/data.

Calibration is C4 (c4_en_sample_1000.jsonl) at 256 tokens: prune's selection windows, then its 4 held-out
windows, then heal's training text right after them, all from one stream, never overlapping. Choices made
on text (the heal learning rate, below) are made on prune's C4 held-out windows, never on WikiText-2 or
the tasks. Layers are the default criterion's choice for that cut, read from bench/results/quality.json.

Rows (--rows, comma-separated): `plain`, `patch`, and `[patch+]MODE@TOKENS[/lr=X][/ce=W]` where MODE is
`heal` (forward KL, LoRA; /ce=W mixes in cross-entropy at weight W) or `ce` (cross-entropy only, LoRA:
Gromov et al.'s and Shortened LLaMA's healing), TOKENS like 100k or 1m; /ep=E reads TOKENS / E of text and
passes over it E times (heal --epochs), for budgets beyond the 430k C4 tokens; /bs=N windows per step
(default --batch-size), /train=lora|adjacent|all (heal --train) and /r=N (--lora-rank), in that order. Results are written after every row, so a long run leaves what it finished.

Run:   nice .venv/bin/python bench/repair_heal.py --model smollm2-135m --drop 6
Writes bench/results/repair_heal-MODEL-DROP.json (--name to change).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
DATA = ROOT.parent / "shared" / "data"
C4 = DATA / "c4_en_sample_1000.jsonl"
TASKS = "lambada_openai,arc_easy,piqa,winogrande"
EVAL_SEQ_LEN, EVAL_WINDOWS = 512, 16
ROW = re.compile(r"^(?P<patch>patch\+)?(?P<mode>heal|ce)@(?P<tokens>\d+(?:\.\d+)?[km]?)(?:/lr=(?P<lr>[0-9.e-]+))?"
                 r"(?:/ce=(?P<ce>[0-9.]+))?(?:/ep=(?P<ep>\d+))?(?:/bs=(?P<bs>\d+))?"
                 r"(?:/train=(?P<train>lora|adjacent|all))?(?:/r=(?P<rank>\d+))?$")


def parse_tokens(text: str) -> int:
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1], 1)
    return int(float(text.rstrip("km")) * scale)


def ce_weight_of(match: re.Match) -> float:
    """Cross-entropy share of a heal row's loss: all of it for `ce`, /ce=W (default none) for `heal`."""
    if match["mode"] == "ce":
        return 1.0
    return float(match["ce"]) if match["ce"] else 0.0


def default_layers(model: str, drop: int, criterion: str) -> list[int]:
    quality = json.loads((ROOT / "bench" / "results" / "quality.json").read_text())
    return quality[model]["configs"][criterion]["drops"][str(drop)]["removed"]


def accuracy_of(report: dict) -> dict[str, float]:
    """{task: acc} from one model's lm-eval results (acc, not acc_norm, for every task)."""
    results = report["lm_eval"]["results"]
    return {task: results[task]["acc,none"] for task in TASKS.split(",") if task in results}


def label_of(row: str) -> str:
    """`patch+heal@100k` -> `patch + heal (KL, LoRA), 100k tokens`."""
    if row in ("base", "plain", "patch"):
        return {"base": "base", "plain": "plain cut", "patch": "`--patch`"}[row]
    match = ROW.match(row)
    trains = {"lora": "LoRA", "all": "all weights", "adjacent": "layers next to the cut"}[match["train"] or "lora"]
    if match["rank"]:
        trains += f" r={match['rank']}"
    loss = "KL" if match["mode"] == "heal" else "CE only"
    if match["mode"] == "heal" and match["ce"]:
        loss = f"KL + {float(match['ce']):g} CE"
    what = f"heal ({loss}, {trains})"
    extras = [f"{match['ep']} passes" if match["ep"] and int(match["ep"]) > 1 else "",
              f"{match['bs']} windows per step" if match["bs"] else ""]
    extras = ", ".join(extra for extra in extras if extra)
    return (f"{'patch + ' if match['patch'] else ''}{what}{'' if match['patch'] else ' alone'}, {match['tokens']} tokens"
            + (f" ({extras})" if extras else ""))


def row_label(row: dict, default_lr: float) -> str:
    """label_of, plus the learning rate where it is not the default."""
    label = label_of(row["row"])
    match = ROW.match(row["row"])
    if match and (match["lr"] or (match["train"] or "lora") != "lora"):  # other modes have other defaults
        return f"{label} (lr {row['lr']:g})"
    return label


def cost_of(row: dict) -> str:
    if "tokens_per_second" in row:
        return f"heal {row['heal_seconds'] / 60:.1f} min, {row['tokens_per_second']:.0f} tok/s"
    if row.get("patch_seconds") is not None:
        return f"patch {row['patch_seconds']:.0f} s"
    return ""


def table(results: dict) -> str:
    """Markdown: one line per row, perplexity, accuracy per task, what was recovered, what it cost."""
    setting, rows = results["setting"], results["rows"]
    tasks = setting["tasks"]
    heal = setting["heal"]
    head = ["row", "WikiText-2 ppl", "x base", "gap recovered", *tasks]
    head += ["mean acc", "acc recovered"] if tasks else []
    head.append("cost")
    earlier = [f"`{command}`" for command in results.get("appended", [])]
    lines = ([f"Earlier rows of this file: {'; '.join(earlier)}.", ""] if earlier else []) + [f"{setting['model']}, layers {', '.join(map(str, setting['removed']))} removed ({setting['criterion']}). "
             f"Heal: LoRA r={heal['lora_rank']} on every projection, {heal['batch_size']} x {heal['seq_len']}-token "
             f"windows per step, {heal['dtype']} autocast, learning rate in the row or {heal['default_lr']:g}. "
             + (f"Tasks: lm-eval, first {setting['limit']} documents, acc." if tasks else "No lm-eval tasks (perplexity only).")
             + f" Ran on: {setting.get('hardware') or 'cpu, ' + str(setting['threads']) + ' threads'}.", "",
             "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    base = rows[0]["wikitext2_perplexity"]
    notes: list[str] = []
    for row in rows:
        cells = [row_label(row, heal["default_lr"]),
                 f"{row['wikitext2_perplexity']:.2f}", f"{row['wikitext2_perplexity'] / base:.2f}",
                 f"{100 * row['gap_recovered']:.1f}%" if "gap_recovered" in row else ""]
        if tasks:
            cells += [f"{row['accuracy'][task]:.3f}" if task in row.get("accuracy", {}) else "" for task in tasks]
            cells.append(f"{row['mean_accuracy']:.3f}" if "mean_accuracy" in row else "")
            recovered = row.get("accuracy_recovered")
            cells.append(f"{100 * recovered:.0f}%" if recovered is not None else "")
        cells.append(cost_of(row) + (f" ({len(notes) + 1})" if "note" in row else ""))
        if "note" in row:
            notes.append(row["note"])
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""] + [f"({number}) {note}." for number, note in enumerate(notes, 1)] if notes else []
    return "\n".join(lines)


def goals(results: dict) -> str:
    """The repair goals for SmolLM2 -6, each checked against this file's rows: met, or missed by how much."""
    rows = {row["row"]: row for row in results["rows"]}
    base = rows["base"]

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**missed**"

    lines = []
    if "patch" in rows and "plain" in rows:
        patch, plain = rows["patch"], rows["plain"]
        lines.append(f"- `--patch` recovers at least 25% of the log-perplexity gap: {100 * patch['gap_recovered']:.1f}% "
                     f"({verdict(patch['gap_recovered'] >= 0.25)}); and does not lower mean accuracy: "
                     f"{plain['mean_accuracy']:.3f} -> {patch['mean_accuracy']:.3f} "
                     f"({verdict(patch['mean_accuracy'] >= plain['mean_accuracy'])}).")
    million = [rows[name] for name in rows if ROW.match(name) and ROW.match(name)["patch"]
               and ROW.match(name)["mode"] == "heal" and parse_tokens(ROW.match(name)["tokens"]) == 1_000_000]
    # several 1M heal settings (KL, or KL with some CE): the one a user would pick, by prune's C4 held-out
    # windows, never by WikiText-2 or the tasks
    long = min(million, key=lambda row: row["c4_held_out_perplexity"]["after"], default=None)
    if long is None:
        budgets = sorted((parse_tokens(ROW.match(name)["tokens"]), name) for name in rows
                         if ROW.match(name) and ROW.match(name)["patch"] and ROW.match(name)["mode"] == "heal")
        nearest = ""
        if budgets:
            tokens, name = budgets[-1]
            row = rows[name]
            nearest = (f" The largest budget measured, {label_of(name)}: "
                       f"{row['wikitext2_perplexity'] / base['wikitext2_perplexity']:.2f}x the base, "
                       f"{100 * (row.get('accuracy_recovered') or 0):.0f}% of the lost mean accuracy recovered.")
        lines.append("- patch + heal at 1M tokens within 1.3x of the base's perplexity, with at least 60% of the lost "
                     "mean accuracy recovered: **not measured** in this file: the C4 sample holds 430k tokens after "
                     "prune's windows, so 1M tokens needs `heal --epochs 3` (row `patch+heal@1m/ep=3`)." + nearest)
    else:
        ratio = long["wikitext2_perplexity"] / base["wikitext2_perplexity"]
        recovered = long.get("accuracy_recovered") or 0.0
        chosen = (f"the best of {len(million)} settings by C4 held-out perplexity, " if len(million) > 1 else "")
        lines.append(f"- patch + heal at 1M tokens ({chosen}{label_of(long['row'])}) within 1.3x of the base: {ratio:.2f}x ({verdict(ratio <= 1.3)}"
                     + ("" if ratio <= 1.3 else f" by {ratio - 1.3:.2f}x") + f"); at least 60% of the lost mean accuracy "
                     f"recovered: {100 * recovered:.0f}% ({verdict(recovered >= 0.6)}).")
    short = rows.get("patch+heal@100k")
    if short is not None:
        ratio = short["wikitext2_perplexity"] / base["wikitext2_perplexity"]
        lines.append(f"- patch + heal at 100k tokens beats the naive floor of 1.58x the base: {ratio:.2f}x "
                     f"({verdict(ratio < 1.58)}).")
    for ce in (name for name in rows if ROW.match(name) and ROW.match(name)["mode"] == "ce"):
        same = [name for name in rows if ROW.match(name) and ROW.match(name)["mode"] == "heal"
                and ROW.match(name)["patch"] == ROW.match(ce)["patch"]
                and parse_tokens(ROW.match(name)["tokens"]) == parse_tokens(ROW.match(ce)["tokens"])
                and all(ROW.match(name)[key] == ROW.match(ce)[key] for key in ("ep", "bs", "train", "rank"))]
        if not same:
            continue
        b = rows[ce]
        tried = "; ".join(f"{row_label(rows[name], results['setting']['heal']['default_lr'])}: "
                          f"{rows[name]['wikitext2_perplexity']:.2f}, {rows[name].get('mean_accuracy', float('nan')):.3f}"
                          for name in same)
        ok = any(rows[name]["wikitext2_perplexity"] < b["wikitext2_perplexity"]
                 and rows[name].get("mean_accuracy", 0) >= b.get("mean_accuracy", 0) for name in same)
        lines.append(f"- distillation beats cross-entropy LoRA at equal tokens: {label_of(ce)} "
                     f"{b['wikitext2_perplexity']:.2f} WikiText-2, {b.get('mean_accuracy', float('nan')):.3f} mean accuracy; "
                     f"distillation rows (WikiText-2, mean accuracy): {tried} ({verdict(ok)}).")
    speeds = [f"{row_label(row, results['setting']['heal']['default_lr'])} {row['tokens_per_second']:.0f}"
              for row in rows.values() if "tokens_per_second" in row]
    if speeds:
        where = results["setting"].get("hardware") or "this CPU, 2 threads"
        lines.append(f"- heal throughput on {where} (tokens/s, {results['setting']['heal']['dtype']} autocast): "
                     + "; ".join(speeds) + ".")
    return "\n".join(lines)


def lr_table(results: dict) -> str:
    """The learning-rate choice: judged on prune's C4 held-out windows (WikiText-2 shown, not used)."""
    lines = ["| row | C4 held-out ppl before | after | WikiText-2 ppl | heal tok/s |", "|---|---:|---:|---:|---:|"]
    for row in results["rows"][1:]:
        ppl = row["c4_held_out_perplexity"]
        lines.append(f"| {row['row']} | {ppl['before']:.2f} | {ppl['after']:.2f} | {row['wikitext2_perplexity']:.2f} | "
                     f"{row['tokens_per_second']:.0f} |")
    return "\n".join(lines)


def reuse_base(name: str, args) -> dict | None:
    """The base row of another cut of the same model, measured with the same tasks and limit (it does not
    depend on the cut), so each model's base is evaluated once."""
    for path in sorted((ROOT / "bench" / "results").glob(f"repair_heal-{args.model}-*.json")):
        if path.stem == name:
            continue
        other = json.loads(path.read_text())
        row = other["rows"][0]
        same = (other["setting"]["limit"] == args.limit and bool(other["setting"]["tasks"]) != args.no_tasks
                and other["setting"].get("device", "cpu") == args.device)
        if row["row"] == "base" and same:
            return row | {"reused_from": path.name}
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--drop", type=int, default=6)
    parser.add_argument("--criterion", default="halving",
                        help="whose choice of layers (bench/results/quality.json): the default criterion, halving "
                             "since the SLEB comparison (guided before it)")
    parser.add_argument("--rows", default="plain,patch,patch+heal@100k,patch+ce@100k,heal@100k,patch+heal@1m")
    parser.add_argument("--limit", type=int, default=500)
    parser.add_argument("--no-tasks", action="store_true", help="perplexity only (the learning-rate sweep)")
    parser.add_argument("--batch-size", type=int, default=4, help="heal windows per step")
    parser.add_argument("--samples", type=int, default=256, help="prune's selection windows = --patch's windows")
    parser.add_argument("--heal-dtype", default="bfloat16",
                        help="heal's --dtype: bfloat16 trains float32 weights under bf16 autocast (AMX on this CPU)")
    parser.add_argument("--append", action="store_true",
                        help="add the rows to the existing results file (same setting), keeping its rows")
    parser.add_argument("--note", default=None,
                        help="a footnote for this run's rows (e.g. what else shared the machine while they ran)")
    parser.add_argument("--device", default="cpu", help="where every row runs (cpu, or cuda when one is lent)")
    parser.add_argument("--name", default=None)
    parser.add_argument("--work", type=Path, default=None, help="where written folders go (default: a temp dir)")
    args = parser.parse_args()

    import torch
    from rich.console import Console

    from prunetool.select.calibration import load_calibration
    from prunetool.commands.eval import EvalRequest, run_eval
    from prunetool.commands.heal import DEFAULT_LR, HealRequest, run_heal
    from prunetool.commands.prune import PruneRequest, run_prune
    from prunetool.model.loading import load_model
    from prunetool.paths import CACHE_ENV
    from prunetool.model.perplexity import perplexity
    from prunetool.sources import resolve_model
    from provenance import write_results

    console = Console(stderr=True)
    name = args.name or f"repair_heal-{args.model}-{args.drop}"
    base_path = resolve_model(args.model).path  # converted once, in the user's cache
    work = Path(args.work or tempfile.mkdtemp(prefix="prunetool-repair-"))
    os.environ[CACHE_ENV] = str(work / "cache")  # the bench's prunes never replace the user's current run
    layers = default_layers(args.model, args.drop, args.criterion)
    rows_wanted = args.rows.split(",")
    for row in rows_wanted:
        if row not in ("plain", "patch") and not ROW.match(row):
            parser.error(f"cannot read row {row!r}")
    threads = torch.get_num_threads()
    hardware = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else f"cpu, {threads} threads"

    evals_cache: dict = {}

    def judge(folder: str) -> dict:
        clock = time.perf_counter()
        model, tokenizer = load_model(resolve_model(folder), dtype="float32", device=args.device)
        if "windows" not in evals_cache:
            evals_cache["windows"] = load_calibration(str(DATA / "wikitext2-test.raw"), tokenizer,
                                                      seq_len=EVAL_SEQ_LEN, samples=EVAL_WINDOWS)
        windows = evals_cache["windows"]
        ppl = perplexity(model, windows.input_ids)
        del model
        result = {"wikitext2_perplexity": ppl, "perplexity_seconds": round(time.perf_counter() - clock, 1)}
        if not args.no_tasks:
            clock = time.perf_counter()
            report = run_eval(EvalRequest(models=[folder], tasks=TASKS, data_dir=DATA, limit=args.limit,
                                          num_fewshot=None, batch_size="16", max_length=None, calibration={},
                                          dtype="float32", device=args.device, trust_remote_code=False), console)
            accuracy = accuracy_of(next(iter(report["models"].values())))
            result |= {"accuracy": accuracy, "mean_accuracy": sum(accuracy.values()) / len(accuracy),
                       "eval_seconds": round(time.perf_counter() - clock, 1)}
        console.print(f"  {folder}: {result}", highlight=False)
        return result

    prune_common = dict(model=str(base_path), layers=",".join(map(str, layers)), calib=str(C4), seq_len=256,
                        samples=args.samples, dtype="float32", device=args.device, force=True)
    folders: dict[str, str] = {}
    prune_records: dict[str, dict] = {}

    def pruned(patch: bool) -> str:
        key = "patch" if patch else "plain"
        if key not in folders:
            clock = time.perf_counter()
            result = run_prune(PruneRequest(**prune_common, patch=patch, output=work / key), console)
            folders[key] = result["output"]
            prune_records[key] = {"seconds": round(time.perf_counter() - clock, 1),
                                  "patch_seconds": (result["patch"] or {}).get("seconds"),
                                  "c4_held_out_perplexity": result["perplexity"]}
        return folders[key]

    results = {"setting": {"model": args.model, "base_path": str(base_path), "drop": args.drop,
                           "removed": layers, "criterion": f"{args.criterion} (bench/results/quality.json)",
                           "calibration": {"file": C4.name, "seq_len": 256, "selection_windows": args.samples,
                                           "patch_windows": args.samples},
                           "eval": {"file": "wikitext2-test.raw", "seq_len": EVAL_SEQ_LEN, "windows": EVAL_WINDOWS},
                           "tasks": TASKS.split(",") if not args.no_tasks else [], "limit": args.limit,
                           "heal": {"batch_size": args.batch_size, "seq_len": 256, "train": "lora",
                                    "dtype": args.heal_dtype,
                                    "lora_rank": 8, "default_lr": DEFAULT_LR["lora"]},
                           "dtype": "float32", "device": args.device, "hardware": hardware, "threads": threads},
               "rows": []}
    existing = ROOT / "bench" / "results" / f"{name}.json"
    if args.append and existing.exists():
        previous = json.loads(existing.read_text())
        if previous["setting"]["removed"] != layers or previous["setting"]["tasks"] != results["setting"]["tasks"]:
            parser.error(f"--append: {existing.name} was measured in another setting")
        results["rows"] = previous["rows"]
        results["appended"] = previous.get("appended", []) + [previous["provenance"]["command"]]
        base = results["rows"][0]
    else:
        base = reuse_base(name, args) or ({"row": "base"} | judge(str(base_path)))
        results["rows"].append(base)
        write_results(name, results)
    for row in rows_wanted:
        clock = time.perf_counter()
        if row in ("plain", "patch"):
            folder = pruned(row == "patch")
            entry = {"row": row} | prune_records[row]
        else:
            match = ROW.match(row)
            tokens = parse_tokens(match["tokens"])
            start = pruned(bool(match["patch"]))
            lr = float(match["lr"]) if match["lr"] else None
            batch_size = int(match["bs"] or args.batch_size)
            request = HealRequest(model=start, tokens=tokens, seq_len=256, train=match["train"] or "lora", lr=lr,
                                  lora_rank=int(match["rank"] or 8),
                                  batch_size=batch_size, ce_weight=ce_weight_of(match),
                                  output=work / row.replace("/", "_").replace("+", "_").replace("@", "_"),
                                  epochs=int(match["ep"] or 1), force=True, dtype=args.heal_dtype,
                                  device=args.device)
            healed = run_heal(request, console)
            heal = healed["heal"]
            folder = healed["output"]
            entry = {"row": row, "start": "patch" if match["patch"] else "plain", "mode": match["mode"],
                     "tokens": heal["tokens"], "epochs": heal["data"].get("epochs", 1), "steps": heal["steps"],
                     "lr": heal["lr"], "batch_size": batch_size, "train": request.train,
                     "lora_rank": request.lora_rank if request.train == "lora" else None,
                     "ce_weight": ce_weight_of(match),
                     "heal_seconds": heal["seconds"], "tokens_per_second": heal["tokens_per_second"],
                     "c4_held_out_perplexity": heal["perplexity"], "loss_summary": heal["loss_summary"]}
        entry |= judge(folder)
        if args.note:
            entry["note"] = args.note
        results["rows"] = [r for r in results["rows"] if r["row"] != row]
        entry["row_seconds"] = round(time.perf_counter() - clock, 1)
        gap = math.log(results["rows"][0]["wikitext2_perplexity"])
        results["rows"].append(entry)
        plain = next((r for r in results["rows"] if r["row"] == "plain"), None)
        if plain is not None:
            cut = math.log(plain["wikitext2_perplexity"])
            for r in results["rows"][1:]:
                r["gap_recovered"] = round((cut - math.log(r["wikitext2_perplexity"])) / (cut - gap), 4)
                if "mean_accuracy" in r and "mean_accuracy" in plain:
                    lost = base["mean_accuracy"] - plain["mean_accuracy"]
                    r["accuracy_recovered"] = round((r["mean_accuracy"] - plain["mean_accuracy"]) / lost, 4) if lost > 0 else None
        write_results(name, results)
        console.print(f"{row}: WikiText-2 {entry['wikitext2_perplexity']:.2f} "
                      f"({entry['wikitext2_perplexity'] / base['wikitext2_perplexity']:.2f}x base) "
                      f"in {entry['row_seconds']:.0f}s", highlight=False)


if __name__ == "__main__":
    main()
