"""Time and peak memory of `write_pruned_checkpoint` against `cp -r` of the same checkpoint.

Run: .venv/bin/python bench/prune_write.py [--model gemma3-270m] [--layers 5,8,9,16] [--shard-size 100MB] [--repeats 5]

The demo model (float32, one ~1.1 GB file) is re-saved once with `save_pretrained(max_shard_size=...)`
into prunetool's cache (bench/<model>-<size>/, reused by later runs). Every measurement runs in its
own process; its peak RSS comes from `os.wait4` (per child, unlike RUSAGE_CHILDREN, which is the
maximum over all children). "RSS before" is the child's RSS after imports, just before the call,
so the difference is what the write itself costs. `safe_open + save_file` is the textbook
alternative (tensors only, no config or side files), kept here to justify the byte-level writer.
Outputs go to page cache like `cp` (no fsync), on the same file system as the source.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6


def sharded_copy(model: str, shard_size: str) -> Path:
    """The demo model re-saved with `max_shard_size`; built once (into a temp folder, then renamed)."""
    from prunetool.paths import cache_dir
    from prunetool.sources import resolve_model

    source = resolve_model(model).path
    target = cache_dir() / "bench" / f"{model}-{shard_size}"
    if target.is_dir():
        return target
    import torch
    from transformers import AutoModelForCausalLM

    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.save_pretrained(scratch, max_shard_size=shard_size)
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and not (scratch / path.name).exists():
            shutil.copyfile(path, scratch / path.name)
    scratch.rename(target)
    return target


def child(method: str, source: str, output: str, layers: str) -> None:
    """Runs in the measured process: one write, then its own timing and pre-call RSS as JSON."""
    from prunetool.plan import PrunePlan
    from prunetool.surgery import write_pruned_checkpoint
    from prunetool.surgery.config import load_config

    _, num_layers, _ = load_config(Path(source))  # imports transformers before the RSS reading
    plan = PrunePlan("bench", num_layers, tuple(int(i) for i in layers.split(",")), "manual")
    rss_before = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    started = time.perf_counter()
    if method == "prunetool":
        write_pruned_checkpoint(Path(source), plan, Path(output))
    else:
        naive_write(Path(source), plan, Path(output))
    print(json.dumps({"seconds": time.perf_counter() - started, "rss_before": rss_before}))


def naive_write(source: Path, plan, output: Path) -> None:
    """safe_open + save_file per shard: the kept tensors of one shard are held in memory at a time."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from prunetool.surgery.tensors import find_decoder_prefix, read_weights, renamer

    weights = read_weights(source)
    rename = renamer(find_decoder_prefix(weights.names, plan.num_layers), plan.index_map)
    output.mkdir(parents=True)
    for shard in weights.shards:
        with safe_open(shard.path, "pt") as f:
            tensors = {rename(k): f.get_tensor(k) for k in f.keys() if rename(k) is not None}
            save_file(tensors, output / shard.path.name, metadata=f.metadata())
        del tensors


def measure(command: list[str]) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, stdout) of one command, started through `wrap`.

    Linux reports a child's ru_maxrss as at least its parent's RSS at fork time (exec keeps the
    forked high-water mark), so the command is started by a small fresh Python process instead of
    by this one, which may have grown while building the sharded copy.
    """
    started = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--wrap", *command], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True, check=True)
    wall = time.perf_counter() - started
    lines = done.stdout.strip().splitlines()
    return wall, int(lines[-1].split()[1]) * 1024, "\n".join(lines[:-1])


def wrap(command: list[str]) -> None:
    """Run `command`, then print `MAXRSS <kB>` of that process alone (os.wait4 gives per-child usage)."""
    proc = subprocess.Popen(command)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{command} failed with exit code {os.waitstatus_to_exitcode(status)}")
    print(f"MAXRSS {usage.ru_maxrss}", flush=True)


def folder_stats(folder: Path) -> tuple[int, int]:
    """(total bytes, largest safetensors file bytes)."""
    sizes = [p.stat().st_size for p in folder.iterdir() if p.is_file()]
    shards = [p.stat().st_size for p in folder.glob("*.safetensors")]
    return sum(sizes), max(shards)


def run_case(name: str, source: Path, layers: str, repeats: int, work: Path) -> list[dict]:
    """Every method `repeats` times, in rotating order (drift hits all alike); median times, max peak RSS."""
    methods = {"cp -r": None, "prunetool write_pruned_checkpoint": "prunetool", "safe_open + save_file": "naive"}
    results = {m: {"seconds": [], "process": [], "rss": [], "before": [], "out_bytes": 0} for m in methods}
    subprocess.run(["cp", "-r", str(source), str(work / "warm")], check=True)  # page cache warm for everyone
    shutil.rmtree(work / "warm")
    order = list(methods.items())
    for repeat in range(repeats):
        for method, kind in order[repeat % 3:] + order[: repeat % 3]:  # rotate: no method always goes first
            out = work / "out"
            os.sync()  # start every run without the previous run's dirty pages still being written back
            if kind is None:
                wall, rss, _ = measure(["cp", "-r", str(source), str(out)])
                seconds, before = wall, 0
            else:
                command = [sys.executable, __file__, "--child", kind, str(source), str(out), layers]
                wall, rss, stdout = measure(command)
                report = json.loads(stdout.strip().splitlines()[-1])
                seconds, before = report["seconds"], report["rss_before"]
            results[method]["seconds"].append(seconds)
            results[method]["process"].append(wall)
            results[method]["rss"].append(rss)
            results[method]["before"].append(before)
            results[method]["out_bytes"] = folder_stats(out)[0]
            shutil.rmtree(out)
    return [{"checkpoint": name, "method": m, **r} for m, r in results.items()]


def print_table(rows: list[dict], stats: dict[str, tuple[int, int]]) -> None:
    print("| checkpoint | method | write s | MB/s written | process s | peak RSS MB | RSS before call MB | "
          "largest shard MB | checkpoint MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        total, largest = stats[row["checkpoint"]]
        seconds = statistics.median(row["seconds"])
        before = f"{max(row['before']) / MB:.0f}" if row["method"] != "cp -r" else "-"
        process = statistics.median(row["process"])
        print(f"| {row['checkpoint']} | {row['method']} | {seconds:.2f} | {row['out_bytes'] / MB / seconds:.0f} | "
              f"{process:.2f} | "
              f"{max(row['rss']) / MB:.0f} | {before} | {largest / MB:.0f} | {total / MB:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--layers", default="5,8,9,16")
    parser.add_argument("--shard-size", default="100MB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", nargs=4, metavar=("METHOD", "SOURCE", "OUTPUT", "LAYERS"), help=argparse.SUPPRESS)
    if sys.argv[1:2] == ["--wrap"]:
        wrap(sys.argv[2:])
        return
    if sys.argv[1:2] == ["--build"]:
        print(sharded_copy(*sys.argv[2:4]))
        return
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    from prunetool.sources import resolve_model

    build = [sys.executable, __file__, "--build", args.model, args.shard_size]  # a child keeps this process small
    built = subprocess.run(build, check=True, stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1]
    cases = {f"{args.model} sharded {args.shard_size}": Path(built),
             f"{args.model} single file": resolve_model(args.model).path}
    rows, stats = [], {}
    for name, folder in cases.items():
        stats[name] = folder_stats(folder)
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".bench-") as work:
            rows += run_case(name, folder, args.layers, args.repeats, Path(work))
    print(f"removing layers {args.layers}; {args.repeats} repeats, median time, max peak RSS; {os.cpu_count()} CPUs")
    print_table(rows, stats)


if __name__ == "__main__":
    main()
