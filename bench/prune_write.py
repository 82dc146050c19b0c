"""Time and peak memory of `write_pruned_checkpoint` against `cp -r` and mergekit's passthrough merge.

Run: .venv/bin/python bench/prune_write.py [--model gemma3-270m] [--layers 5,8,9,16] [--shard-size 100MB] [--repeats 5]
                                           [--mergekit-bin .bench-venv/bin/mergekit-yaml] [--check-mergekit]

The demo model (float32, one ~1.1 GB file) is re-saved once with `save_pretrained(max_shard_size=...)`
into prunetool's cache (bench/<model>-<size>/, reused by later runs). Every measurement runs in its
own process; its peak RSS comes from `os.wait4` (per child, unlike RUSAGE_CHILDREN, which is the
maximum over all children). "RSS before" is the child's RSS after imports, just before the call,
so the difference is what the write itself costs. `safe_open + save_file` is the textbook
alternative (tensors only, no config or side files), kept here to justify the byte-level writer.
Outputs go to page cache like `cp` (no fsync), on the same file system as the source.

mergekit runs from its own venv (its pins need not match prunetool's), made once with
    python3 -m venv .bench-venv
    .bench-venv/bin/pip install torch==2.13.0   # CPU build first, so mergekit does not pull CUDA torch
    .bench-venv/bin/pip install mergekit         # 0.1.5 here, with transformers 5.24.0
It is given the config prunetool itself exports (`exports.mergekit_yaml`, the same removed layers) and
run as `mergekit-yaml CONFIG OUT --device cpu --quiet --copy-tokenizer --no-write-model-card
--out-shard-size N`: CPU only (passthrough does no arithmetic anyway); no progress bars; the tokenizer
files copied like prunetool copies side files; no README, since `write_pruned_checkpoint` writes
none either; N = the source's largest shard in bytes (mergekit compares it to tensor bytes despite
its help text saying parameters), so the output is sharded like the source: mergekit keeps the
whole current output shard in memory, and its default 5B would make one file of any of these
checkpoints. `--lazy-unpickle` is left off: it only affects pickled .bin inputs, and these are
safetensors. `--async-write` is left off (default): it overlaps writing a shard with reading the
next at the cost of more memory, and the plain command is what prunetool's mergekit.yaml tells
users to run. For mergekit, "write s" is the whole process (Python start-up and its torch and
transformers imports included); the start-up alone (`mergekit-yaml --help`, which does the same
imports) is printed under the table. When the mergekit binary is missing the method is skipped
with a note. `--check-mergekit` instead writes the cut once with both tools and compares tensor
names, dtypes, shapes and values (torch.equal), config.json and the other files.
Timings are written to bench/results/prune_write.json; `table` renders it for docs/benchmarks.md.
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

from provenance import write_results

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6
MERGEKIT_BIN = ROOT / ".bench-venv" / "bin" / "mergekit-yaml"


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
    from prunetool.select.plan import PrunePlan
    from prunetool.checkpoint.surgery import write_pruned_checkpoint
    from prunetool.checkpoint.surgery.config import load_config

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

    from prunetool.sources.weights import find_decoder_prefix, read_weights
    from prunetool.checkpoint.surgery.tensors import renamer

    weights = read_weights(source)
    rename = renamer(find_decoder_prefix(weights.names, plan.num_layers), plan.index_map)
    output.mkdir(parents=True)
    for shard in weights.shards:
        with safe_open(shard.path, "pt") as f:
            tensors = {rename(k): f.get_tensor(k) for k in f.keys() if rename(k) is not None}
            save_file(tensors, output / shard.path.name, metadata=f.metadata())
        del tensors


def mergekit_config(source: Path, layers: str, target: Path) -> Path:
    """Write the mergekit passthrough config prunetool exports beside a pruned model (same dtype rule)."""
    from prunetool.checkpoint.exports import mergekit_yaml
    from prunetool.select.plan import PrunePlan
    from prunetool.checkpoint.surgery.config import load_config, text_section

    config, num_layers, _ = load_config(source)
    plan = PrunePlan("bench", num_layers, tuple(int(i) for i in layers.split(",")), "manual")
    text = text_section(config)
    target.write_text(mergekit_yaml(plan, str(source), text.get("dtype") or text.get("torch_dtype")))
    return target


def mergekit_command(mergekit_bin: Path, config: Path, source: Path, output: Path) -> list[str]:
    """The measured mergekit run; see the module docstring for why these options."""
    return [str(mergekit_bin), str(config), str(output), "--device", "cpu", "--quiet", "--copy-tokenizer",
            "--no-write-model-card", "--out-shard-size", str(folder_stats(source)[1])]


class CommandFailed(Exception):
    """A measured command exited non-zero; still carries its wall time, peak RSS and stderr."""

    def __init__(self, command: list[str], code: int, wall: float, rss: int, stderr: str):
        super().__init__(f"{command[0]} failed (exit {code}):\n{stderr[-4000:]}")
        self.code, self.wall, self.rss, self.stderr = code, wall, rss, stderr

    def reason(self) -> str:
        """The last line of stderr that names an error (a traceback's final line), else the last line."""
        lines = [line.strip() for line in self.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line.split(":")[0] or "Exception" in line.split(":")[0]]
        return (errors or lines or ["no stderr"])[-1]


def measure(command: list[str]) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, stdout) of one command, started through `wrap`; CommandFailed if it fails.

    Linux reports a child's ru_maxrss as at least its parent's RSS at fork time (exec keeps the
    forked high-water mark), so the command is started by a small fresh Python process instead of
    by this one, which may have grown while building the sharded copy.
    """
    started = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--wrap", *command], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - started
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines or not lines[-1].startswith("MAXRSS "):
        raise SystemExit(f"wrapper for {command[0]} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    _, maxrss, code = lines[-1].split()
    if int(code):
        raise CommandFailed(command, int(code), wall, int(maxrss) * 1024, done.stderr)
    return wall, int(maxrss) * 1024, "\n".join(lines[:-1])


def wrap(command: list[str]) -> None:
    """Run `command`, then print `MAXRSS <kB> <exit code>` of that process alone (os.wait4: per-child usage)."""
    proc = subprocess.Popen(command)
    _, status, usage = os.wait4(proc.pid, 0)
    print(f"MAXRSS {usage.ru_maxrss} {os.waitstatus_to_exitcode(status)}", flush=True)


def folder_stats(folder: Path) -> tuple[int, int]:
    """(total bytes, largest safetensors file bytes)."""
    sizes = [p.stat().st_size for p in folder.iterdir() if p.is_file()]
    shards = [p.stat().st_size for p in folder.glob("*.safetensors")]
    return sum(sizes), max(shards, default=0)


def run_case(name: str, source: Path, layers: str, repeats: int, work: Path, mergekit_bin: Path | None) -> list[dict]:
    """Every method `repeats` times, in rotating order (drift hits all alike); median times, max peak RSS."""
    methods = {"cp -r": None, "prunetool write_pruned_checkpoint": "prunetool", "safe_open + save_file": "naive"}
    if mergekit_bin is not None:
        methods["mergekit passthrough (whole process)"] = "mergekit"
        config = mergekit_config(source, layers, work / "mergekit.yaml")
    results = {m: {"seconds": [], "process": [], "rss": [], "before": [], "out_bytes": 0, "failed": None}
               for m in methods}
    subprocess.run(["cp", "-r", str(source), str(work / "warm")], check=True)  # page cache warm for everyone
    shutil.rmtree(work / "warm")
    order = list(methods.items())
    for repeat in range(repeats):
        shift = repeat % len(order)
        for method, kind in order[shift:] + order[:shift]:  # rotate: no method always goes first
            out = work / "out"
            os.sync()  # start every run without the previous run's dirty pages still being written back
            if kind is None:
                wall, rss, _ = measure(["cp", "-r", str(source), str(out)])
                seconds, before = wall, 0
            elif kind == "mergekit":
                try:
                    wall, rss, _ = measure(mergekit_command(mergekit_bin, config, source, out))
                except CommandFailed as failure:  # recorded, not fatal: the table says how far it got
                    wall, rss = failure.wall, failure.rss
                    results[method]["failed"] = f"exit {failure.code}: {failure.reason()}"
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
            results[method]["out_bytes"] = folder_stats(out)[0] if out.is_dir() else 0
            shutil.rmtree(out, ignore_errors=True)
    return [{"checkpoint": name, "method": m, **r} for m, r in results.items()]


def table(results: dict) -> str:
    """The docs table: median write time, throughput and peak RSS per checkpoint layout and method."""
    lines = [f"Removing layers {results['layers']}; {results['repeats']} repeats, median time, max peak RSS; "
             f"{results['cpus']} CPUs:", "",
             "| checkpoint | method | write s | MB/s written | process s | peak RSS MB | RSS before call MB | "
             "largest shard MB | checkpoint MB |", "|---|---|---|---|---|---|---|---|---|"]
    failures = []
    for row in results["rows"]:
        total, largest = results["checkpoints"][row["checkpoint"]]
        method = row["method"]
        if row.get("failed"):
            failures.append(f"[{len(failures) + 1}] {row['checkpoint']}, {method}: {row['failed']} (times and RSS are "
                            f"up to the failure; {row['out_bytes'] / MB:.0f} MB had been written)")
            method += f" FAILED [{len(failures)}]"
        seconds = statistics.median(row["seconds"])
        before = f"{max(row['before']) / MB:.0f}" if max(row["before"]) else "-"
        process = statistics.median(row["process"])
        lines.append(f"| {row['checkpoint']} | {method} | {seconds:.2f} | {row['out_bytes'] / MB / seconds:.0f} | "
                     f"{process:.2f} | {max(row['rss']) / MB:.0f} | {before} | {largest / MB:.0f} | {total / MB:.0f} |")
    lines += failures
    if results.get("mergekit_startup"):
        seconds, rss = results["mergekit_startup"]
        lines += ["", "mergekit start-up alone (`mergekit-yaml --help`: Python, torch, transformers imports): "
                  f"{seconds:.2f} s, peak RSS {rss / MB:.0f} MB; included in mergekit's write s."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--layers", default="5,8,9,16")
    parser.add_argument("--shard-size", default="100MB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mergekit-bin", type=Path, default=MERGEKIT_BIN,
                        help="mergekit-yaml of a separate venv (default: %(default)s); skipped if missing")
    parser.add_argument("--check-mergekit", action="store_true",
                        help="instead of timing: write the cut with prunetool and mergekit once and compare them")
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

    mergekit_bin = args.mergekit_bin if args.mergekit_bin.is_file() else None
    if mergekit_bin is None:
        print(f"note: {args.mergekit_bin} not found, skipping mergekit (see the docstring to make .bench-venv)")
    if args.check_mergekit:
        if mergekit_bin is None:
            raise SystemExit("--check-mergekit needs the mergekit binary")
        raise SystemExit(check_mergekit(resolve_model(args.model).path, args.layers, mergekit_bin))
    build = [sys.executable, __file__, "--build", args.model, args.shard_size]  # a child keeps this process small
    built = subprocess.run(build, check=True, stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1]
    cases = {f"{args.model} sharded {args.shard_size}": Path(built),
             f"{args.model} single file": resolve_model(args.model).path}
    rows, stats = [], {}
    for name, folder in cases.items():
        stats[name] = folder_stats(folder)
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".bench-") as work:
            rows += run_case(name, folder, args.layers, args.repeats, Path(work), mergekit_bin)
    startup = None
    if mergekit_bin is not None:
        runs = [measure([str(mergekit_bin), "--help"]) for _ in range(max(1, min(args.repeats, 3)))]
        startup = (statistics.median(s for s, _, _ in runs), max(r for _, r, _ in runs))
    results = {"model": args.model, "layers": args.layers, "repeats": args.repeats, "cpus": os.cpu_count(),
               "checkpoints": stats, "rows": rows, "mergekit_startup": startup}
    write_results("prune_write", results)
    print(table(results))


def check_mergekit(source: Path, layers: str, mergekit_bin: Path) -> int:
    """Write the cut with prunetool and with mergekit (options as measured), compare; 0 if the tensors agree."""
    import torch
    from safetensors import safe_open

    from prunetool.select.plan import PrunePlan
    from prunetool.checkpoint.surgery import write_pruned_checkpoint
    from prunetool.checkpoint.surgery.config import load_config

    def tensors(folder: Path) -> dict:
        found = {}
        for shard in sorted(folder.glob("*.safetensors")):
            with safe_open(shard, "pt") as f:
                found.update({name: f.get_tensor(name) for name in f.keys()})
        return found

    _, num_layers, _ = load_config(source)
    plan = PrunePlan(str(source), num_layers, tuple(int(i) for i in layers.split(",")), "manual")
    with tempfile.TemporaryDirectory(dir=source.parent, prefix=".check-") as work:
        work = Path(work)
        ours, theirs = work / "prunetool", work / "mergekit"
        write_pruned_checkpoint(source, plan, ours)
        config = mergekit_config(source, layers, work / "mergekit.yaml")
        command = mergekit_command(mergekit_bin, config, source, theirs)
        done = subprocess.run(command, stderr=subprocess.PIPE, text=True)
        print(f"{source} minus layers {list(plan.removed)}; mergekit command: {' '.join(command)}")
        if done.returncode:  # compare what it wrote all the same
            reason = CommandFailed(command, done.returncode, 0, 0, done.stderr).reason()
            print(f"MERGEKIT FAILED (exit {done.returncode}): {reason}")
        a, b = tensors(ours), tensors(theirs) if theirs.is_dir() else {}
        print(f"tensors: prunetool {len(a)}, mergekit {len(b)}")
        print(f"  only in prunetool: {sorted(set(a) - set(b))}")
        print(f"  only in mergekit:  {sorted(set(b) - set(a))}")
        differ = [n for n in sorted(set(a) & set(b))
                  if a[n].dtype != b[n].dtype or a[n].shape != b[n].shape or not torch.equal(a[n], b[n])]
        for name in differ:
            print(f"  differs: {name}: {a[name].dtype} {tuple(a[name].shape)} "
                  f"vs {b[name].dtype} {tuple(b[name].shape)}")
        print(f"  common names with equal dtype, shape and values (torch.equal): {len(set(a) & set(b)) - len(differ)}")
        ca, cb = (json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
                  for folder in (ours, theirs))
        for folder, config in ((ours, ca), (theirs, cb)):
            if not config:
                print(f"config.json: none in {folder.name}'s output")
        for key in sorted(set(ca) | set(cb)) if ca and cb else []:
            if ca.get(key, "<absent>") != cb.get(key, "<absent>"):
                print(f"config.json {key}: prunetool {json.dumps(ca.get(key, '<absent>'))} vs "
                      f"mergekit {json.dumps(cb.get(key, '<absent>'))}")
        files = {folder.name: sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
                 for folder in (ours, theirs)}
        print(f"files: prunetool {files['prunetool']}\n       mergekit  {files['mergekit']}")
        for name in sorted(set(files["prunetool"]) & set(files["mergekit"])):
            same = (ours / name).read_bytes() == (theirs / name).read_bytes()
            print(f"  {name}: {'byte-identical' if same else 'bytes differ'}")
        for folder in (ours, theirs):
            for shard in sorted(folder.glob("*.safetensors")):
                with safe_open(shard, "pt") as f:
                    print(f"  {folder.name}/{shard.name}: {shard.stat().st_size} bytes, metadata {f.metadata()}")
        return 0 if set(a) == set(b) and not differ and not done.returncode else 1


if __name__ == "__main__":
    main()
