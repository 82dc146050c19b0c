"""The single-process heal loop's speed against an earlier checkout of prunetool, on the same machine and day.

bench/heal_step.py times the parts of a step in a loop of its own; this bench times `train()` itself, the
loop `prunetool heal` runs, so a change to the loop (the distributed World it goes through since heal runs
under launchers) shows up. SmolLM2-135M with layers 13-18 removed in memory, LoRA r=8, heal's default loss,
4 x 256 random-token windows per step. Each run is a fresh process that imports prunetool from one
checkout; runs alternate between the checkouts so drift in the machine's speed hits both alike. Per run:
the median step time after the warm-up steps; per checkout and mode: the median over its runs.

Run on an otherwise idle machine, with the baseline checked out beside the repository:
    git worktree add /tmp/prunetool-base <commit>
    nice .venv/bin/python bench/heal_loop.py --against /tmp/prunetool-base
`--modes float32` reruns one mode and keeps the other rows of bench/results/heal_loop.json (each row keeps its
own repeats and date). bfloat16 autocast is slow on CPUs without bf16 instructions (AVX-512 BF16, AMX): the
row then measures the same slow kernels in both checkouts.
Writes bench/results/heal_loop.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
REMOVED = tuple(range(13, 19))
MODES = {"float32": False, "bf16 autocast": True}

CHILD = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from peft import LoraConfig, get_peft_model
from prunetool.commands.heal import LORA_ALPHA_PER_RANK, HealRequest, lora_targets
from prunetool.model.in_memory import prune_in_memory
from prunetool.model.loading import load_model
from prunetool.repair.train import TrainConfig, train
from prunetool.sources import resolve_model

import prunetool
assert str(prunetool.__file__).startswith(sys.argv[1]), prunetool.__file__
model, autocast, batch, seq_len, warmup, steps = sys.argv[2], sys.argv[3] == "1", *map(int, sys.argv[4:8])
removed = json.loads(sys.argv[8])
source = resolve_model(model)
teacher, _ = load_model(source, dtype="bfloat16" if autocast else "float32", device="cpu")
student, _ = load_model(source, dtype="float32", device="cpu")
prune_in_memory(student, removed)
student.requires_grad_(False)
student = get_peft_model(student, LoraConfig(r=8, lora_alpha=8 * LORA_ALPHA_PER_RANK, target_modules=lora_targets(student)))
total = warmup + steps
windows = torch.randint(teacher.config.vocab_size, (total * batch, seq_len), generator=torch.Generator().manual_seed(0))
config = TrainConfig(steps=total, batch_size=batch, grad_accum=1, lr=1e-4, ce_weight=HealRequest.ce_weight,
                     autocast_bf16=autocast)
marks = []
train(student, teacher, windows, config, on_step=lambda step, loss: marks.append(time.perf_counter()))
times = [b - a for a, b in zip(marks, marks[1:])][warmup - 1:]
print(json.dumps({"step_seconds": statistics.median(times), "threads": torch.get_num_threads()}))
"""


def run_once(root: Path, args, autocast: bool) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(root), args.model, "1" if autocast else "0",
                           str(args.batch), str(args.seq_len), str(args.warmup), str(args.steps),
                           json.dumps(list(REMOVED))], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the run from {root} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def rate(value: float) -> str:
    return f"{value:.0f}" if value >= 20 else f"{value:.1f}"


def table(results: dict) -> str:
    s = results["setting"]
    lines = [f"{s['model']} -> layers {s['removed'][0]}-{s['removed'][-1]} removed, LoRA r=8, `train()` as heal runs "
             f"it in one process; {s['batch']} x {s['seq_len']} tokens per step; per run the median of {s['steps']} "
             f"steps after {s['warmup']} warm-up; alternating runs per checkout, median shown; "
             f"{s['threads']} threads. Baseline: commit {results['baseline']['commit']}.", "",
             "| mode | measured | runs per checkout | baseline tokens/s | this checkout tokens/s | ratio | runs (baseline) | runs (this checkout) |",
             "|---|---|---:|---:|---:|---:|---|---|"]
    for mode, row in results["modes"].items():
        lines.append(f"| {mode} | {row['date']} | "
                     f"{row.get('repeats', s['repeats'])} | {rate(row['baseline_tokens_per_second'])} | "
                     f"{rate(row['tokens_per_second'])} | {row['ratio']:.3f} | "
                     f"{', '.join(map(rate, row['baseline_runs']))} | {', '.join(map(rate, row['runs']))} |")
    return "\n".join(lines)


def goals(results: dict) -> str:
    worst = min(row["ratio"] for row in results["modes"].values())
    verdict = "**met**" if worst >= 0.95 else f"**missed** by {0.95 - worst:.3f}"
    return f"- the single-process heal loop keeps its speed (tokens/s at least 0.95x the baseline's): worst mode {worst:.3f}x ({verdict})."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, required=True, help="a checkout of the baseline commit")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    args = parser.parse_args()
    import datetime
    from provenance import write_results

    commit = subprocess.run(["git", "-C", str(args.against), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    tokens = args.batch * args.seq_len
    results = {"setting": {"model": args.model, "removed": list(REMOVED), "batch": args.batch, "seq_len": args.seq_len,
                           "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats},
               "baseline": {"path": str(args.against), "commit": commit}, "modes": {}}
    previous = ROOT / "bench" / "results" / "heal_loop.json"
    if set(args.modes) != set(MODES) and previous.exists():
        earlier = json.loads(previous.read_text())
        if earlier["baseline"]["commit"] != commit:
            raise SystemExit(f"the kept rows compare against {earlier['baseline']['commit']}, not {commit}")
        for mode, row in earlier["modes"].items():
            row.setdefault("date", earlier["provenance"]["date"])
            row.setdefault("repeats", earlier["setting"]["repeats"])
            results["modes"][mode] = row
    for mode in args.modes:
        autocast = MODES[mode]
        runs = {"baseline": [], "current": []}
        for _ in range(args.repeats):
            for name, root in (("current", ROOT), ("baseline", args.against.resolve())):
                measured = run_once(root, args, autocast)
                runs[name].append(tokens / measured["step_seconds"])
                results["setting"]["threads"] = measured["threads"]
                print(mode, name, f"{runs[name][-1]:.0f} tokens/s", file=sys.stderr)
        current, baseline = statistics.median(runs["current"]), statistics.median(runs["baseline"])
        results["modes"][mode] = {"tokens_per_second": current, "baseline_tokens_per_second": baseline,
                                  "ratio": current / baseline, "runs": runs["current"], "baseline_runs": runs["baseline"],
                                  "repeats": args.repeats, "date": datetime.date.today().isoformat()}
    results["modes"] = {mode: results["modes"][mode] for mode in MODES if mode in results["modes"]}
    write_results("heal_loop", results)
    print(table(results))
    print(goals(results))


if __name__ == "__main__":
    main()
