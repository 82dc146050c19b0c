"""Heal on 2 CPU ranks (gloo, torchrun) against one process on the same global batch, on the real SmolLM2.

SmolLM2-135M with layers 13-18 removed and patched (`prune --remove-layers 13,...,18 --patch`, calibration
C4 at 256 tokens), healed on 16k tokens of the C4 text after prune's held-out windows: 2 windows per
micro-batch x 4 micro-batches per optimizer step in one process, and 2 ranks x 2 micro-batches each under
torchrun: the same 8 windows per step, split over ranks. Per training mode (LoRA, all weights) it reports
the final losses, the largest difference between the written tensors, held-out perplexity after healing
(prune's held-out windows), heal's tokens/s (summed over ranks) and each run's peak resident memory
(os.wait4 on the launcher: the largest process of the run, one rank under torchrun, verification
included) and the main rank's peak when training ended (heal's `training_peak`).

On this 2-core machine each rank runs one thread (OMP_NUM_THREADS=1) and the one-process run two, so
tokens/s compares one machine's cores used two ways, not scaling.

Run:   nice .venv/bin/python bench/heal_distributed.py [--work /tmp/heal-dist]
Writes bench/results/heal_distributed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
C4 = ROOT.parent / "shared" / "data" / "c4_en_sample_1000.jsonl"
REMOVED = (13, 14, 15, 16, 17, 18)
LAUNCH_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED")


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def run_measured(command: list[str], env: dict | None = None) -> tuple[dict, int]:
    """The command's --json record and its peak RSS in bytes (reaped with wait4, which reports it)."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err,
                                   env={k: v for k, v in os.environ.items() if k not in LAUNCH_ENV} | (env or {}))
        _, status, usage = os.wait4(process.pid, 0)
        out.seek(0), err.seek(0)
        if status != 0:
            raise SystemExit(f"{' '.join(command[:6])} ... failed:\n{err.read()[-3000:]}")
        record = json.loads([line for line in out.read().splitlines() if line.startswith("{")][-1])
    return record, usage.ru_maxrss * 1024


def tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        found |= load_file(path)
    return found


def compare(first: Path, second: Path) -> dict:
    a, b = tensors(first), tensors(second)
    assert a.keys() == b.keys(), "the two healed folders hold different tensors"
    worst_abs = max(float((a[name].float() - b[name].float()).abs().max()) for name in a)
    worst_rel = max(float((a[name].float() - b[name].float()).abs().max() / a[name].float().abs().max().clamp_min(1e-30))
                    for name in a)
    return {"max_abs_diff": worst_abs, "max_rel_diff": worst_rel, "tensors": len(a)}


def training_peak(run: dict) -> str:
    return f"{run['training_peak_rss'] / 2**30:.2f} GiB" if "training_peak_rss" in run else "not recorded"


def table(results: dict) -> str:
    s = results["setting"]
    lines = [f"{s['model']}, layers {s['removed'][0]}-{s['removed'][-1]} removed and patched; heal on "
             f"{s['tokens']} tokens of C4 ({s['global_windows']} x {s['seq_len']}-token windows per optimizer step; "
             f"one process: {s['one_process']}; 2 ranks: {s['two_ranks']}), float32, CPU, gloo.", "",
             "| train | run | first loss | final loss | final loss, rel. diff | max tensor diff (abs, rel) | "
             "held-out ppl after | ppl rel. diff | tokens/s | peak RSS, training (main rank) | peak RSS, whole command |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for train, row in results["rows"].items():
        for run_name in ("one", "two"):
            r = row[run_name]
            label = "1 process" if run_name == "one" else "2 ranks (torchrun)"
            diff = row["diff"]
            lines.append(f"| {train} | {label} | {r['first_loss']:.6f} | {r['last_loss']:.6f} | "
                         + (f"{diff['last_loss_rel']:.1e} | {diff['max_abs_diff']:.1e}, {diff['max_rel_diff']:.1e} | "
                            if run_name == "two" else " |  | ")
                         + f"{r['ppl_after']:.3f} | " + (f"{diff['ppl_rel']:.1e}" if run_name == "two" else "")
                         + f" | {r['tokens_per_second']:.0f} | {training_peak(r)} | {r['peak_rss'] / 2**30:.2f} GiB |")
    return "\n".join(lines)


def goals(results: dict) -> str:
    lines = []
    for train, row in results["rows"].items():
        d = row["diff"]
        checks = [("final losses within 1e-3 relative", d["last_loss_rel"] <= 1e-3, f"{d['last_loss_rel']:.1e}"),
                  ("held-out perplexity within 0.5%", d["ppl_rel"] <= 5e-3, f"{d['ppl_rel']:.1e}"),
                  ("weights within float rounding (1e-4 relative to each tensor's largest entry)",
                   d["max_rel_diff"] <= 1e-4, f"{d['max_rel_diff']:.1e}")]
        lines += [f"- {train}: {name}: {value} ({'**met**' if ok else '**missed**'})." for name, ok, value in checks]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--work", type=Path, default=Path("/tmp/heal-distributed"))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--trains", default="lora,all")
    args = parser.parse_args()
    if not C4.exists():
        raise SystemExit(f"{C4} is missing (the shared data folder)")
    from provenance import write_results

    prunetool = [sys.executable, "-m", "prunetool"]
    pruned = args.work / "pruned"
    if not (pruned / "prune.json").exists():
        run_measured(prunetool + ["prune", args.model, "--remove-layers", ",".join(map(str, REMOVED)), "--patch",
                                  "--calib", str(C4), "--seq-len", "256", "--output-dir", str(pruned), "--force", "--json"])
    batch = ["--batch-size", "2", "--grad-accum", "4"]  # the global batch; under torchrun heal splits it over the ranks
    common = ["heal", str(pruned), "--tokens", str(args.tokens), "--seq-len", "256", "--force", "--json"]
    results = {"setting": {"model": args.model, "removed": list(REMOVED), "tokens": args.tokens, "seq_len": 256,
                           "global_windows": 8, "one_process": "2 windows x 4 micro-batches",
                           "two_ranks": "2 windows x 2 micro-batches on each rank"}, "rows": {}}
    for train in args.trains.split(","):
        runs = {}
        for name, launcher, extra, env in (
                ("one", prunetool, batch, {}),
                ("two", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                         free_port(), "-m", "prunetool"], batch, {"OMP_NUM_THREADS": "1"})):
            out = args.work / f"{train}-{name}"
            record, peak = run_measured(launcher + common + ["--train", train, *extra, "--output-dir", str(out)], env)
            heal = record["heal"]
            runs[name] = {"first_loss": heal["loss_summary"]["first"], "last_loss": heal["loss_summary"]["last"],
                          "ppl_before": heal["perplexity"]["before"], "ppl_after": heal["perplexity"]["after"],
                          "tokens_per_second": heal["tokens_per_second"], "seconds": heal["seconds"],
                          "world_size": heal["world_size"], "micro_batches_per_rank": heal["micro_batches_per_rank"],
                          "steps": heal["steps"], "peak_rss": peak, "output": str(out),
                          "training_peak_rss": heal["training_peak"]["bytes"]}
            print(train, name, runs[name], file=sys.stderr)
        one, two = runs["one"], runs["two"]
        diff = compare(Path(one["output"]), Path(two["output"]))
        diff["last_loss_rel"] = abs(two["last_loss"] - one["last_loss"]) / abs(one["last_loss"])
        diff["ppl_rel"] = abs(two["ppl_after"] - one["ppl_after"]) / one["ppl_after"]
        results["rows"][train] = {**runs, "diff": diff}
    write_results("heal_distributed", results)
    print(table(results))
    print(goals(results))


if __name__ == "__main__":
    main()
