"""SmolLM2 and two cuts of it in the serving engines: prefill and decode tokens/s in vLLM and in llama.cpp.

Models: the base (SmolLM2-135M), block -6 (layers 13-18 removed; a plain Llama folder), attention -6
(the attention sublayers of layers 13-18 removed; a nemotron-nas folder) and a mixed cut (blocks 16-18
removed, then the attention of layers 13-15; nemotron-nas), written with prunetool's own writers into
--work. The three cuts remove the same six attention sublayers, so their KV cache is the same (0.80x). All float32 in vLLM; f16 GGUFs (`prunetool export --type f16`) in llama.cpp.

vLLM (the CPU build of `make engines`): one OpenAI-compatible server per model, all three up at once
(prefix cache off, a fixed KV cache space, one OMP thread as vLLM reserves on 2 CPUs). For every prompt
length and concurrency, one wave of `concurrency` simultaneous requests of random prompt tokens, each
generating --new-tokens tokens (EOS ignored), through prunetool.serving.load: prefill tokens/s =
concurrency x prompt tokens / time until the last request's first token; decode tokens/s = concurrency /
median time per output token after the first (vLLM's TPOT).

llama.cpp: `llama-bench` on each GGUF, one sequence (it has no concurrency): prefill = pp at each prompt
length, decode = tg of --new-tokens tokens at a KV depth of that prompt length (-d), --threads threads.

Models alternate inside every repeat (the order rotates), so drift on this shared machine spreads over all
of them; each cell is the median over --repeats with its range. A model llama.cpp cannot take (no export
command yet, or an export that fails) is skipped with the reason in the results.

Full run (about an hour on an idle 2-core machine; do not run it beside other work):
    .venv/bin/python bench/serving.py
Smoke run (minutes; proves the plumbing, and the rendered table says its numbers mean nothing):
    .venv/bin/python bench/serving.py --repeats 1 --prompt-lengths 16,64 --new-tokens 4 --concurrency 1,2
Writes bench/results/serving.json (or --output), rendered into docs/serving.md by bench/render_docs.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

BASE = "smollm2-135m"
CUT = tuple(range(13, 19))
MIXED_BLOCKS, MIXED_ATTENTION = (16, 17, 18), (13, 14, 15)
MODELS = {"base": "base", "block6": "block -6 (layers 13-18)", "attn6": "attention -6 (layers 13-18)",
          "mixed": "blocks 16-18 + attention 13-15"}
DEFAULTS = dict(repeats=3, prompt_lengths=(64, 1024), new_tokens=64, concurrency=(1, 16), threads=1)
KV_CACHE_GIB = 2
LLAMA_BENCH_RUNS = 3  # llama-bench's own repetitions inside each call; its mean is one value of the repeat


def say(message: str) -> None:
    print(f"serving: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the folders


def build_folders(work: Path) -> dict[str, Path]:
    """base, block6, attn6 and mixed as prunetool writes them (kept in --work between runs)."""
    from prunetool.checkpoint.surgery import write_nemotron_checkpoint, write_pruned_checkpoint
    from prunetool.select.plan import PrunePlan
    from prunetool.sources import resolve_model

    base = resolve_model(BASE).path
    layers = json.loads((base / "config.json").read_text())["num_hidden_layers"]
    folders = {"base": base, "block6": work / "block6", "attn6": work / "attn6", "mixed": work / "mixed"}
    if not (folders["block6"] / "config.json").exists():
        say("writing block6")
        plan = PrunePlan(base_model=str(base), num_layers=layers, removed=CUT, criterion="manual")
        write_pruned_checkpoint(base, plan, folders["block6"])
    if not (folders["attn6"] / "config.json").exists():
        say("writing attn6")
        write_nemotron_checkpoint(base, folders["attn6"], removed_attention=CUT, removed_mlp=())
    if not (folders["mixed"] / "config.json").exists():
        say("writing mixed")
        blocks = work / "mixed-blocks"
        plan = PrunePlan(base_model=str(base), num_layers=layers, removed=MIXED_BLOCKS, criterion="manual")
        write_pruned_checkpoint(base, plan, blocks, force=True)
        # the attention layers come before the removed blocks, so their indices do not shift
        write_nemotron_checkpoint(blocks, folders["mixed"], removed_attention=MIXED_ATTENTION, removed_mlp=())
    return folders


def sizes(folders: dict[str, Path]) -> dict[str, dict]:
    """Parameters (every tensor in the folder) and KV-cache bytes per token in float32 (every layer that runs
    attention), read from the folders themselves."""
    from prunetool.sources.weights import read_weights

    found = {}
    for name, folder in folders.items():
        config = json.loads((folder / "config.json").read_text())
        weights = read_weights(folder)
        parameters = sum(entry.numel for shard in weights.shards for entry in shard.entries)
        blocks = config.get("block_configs")
        attention_layers = (sum(1 for block in blocks if not block["attention"]["no_op"]) if blocks else
                            config["num_hidden_layers"])
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        found[name] = {"parameters": parameters,
                       "kv_bytes_per_token": attention_layers * 2 * config["num_key_value_heads"] * head_dim * 4}
    return found


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def rotated(names: list[str], shift: int) -> list[str]:
    shift %= len(names)
    return names[shift:] + names[:shift]


# ------------------------------------------------------------------ vLLM


def run_vllm(folders: dict[str, Path], args) -> dict:
    from transformers import AutoTokenizer

    from prunetool.serving.engines import vllm_python
    from prunetool.serving.load import Workload, measure, random_prompts, run_wave
    from prunetool.serving.vllm_server import ServerSettings, VllmServer

    if vllm_python() is None:
        return {"skipped": "vLLM's CPU build is not set up (make engines)"}
    tokenizer = AutoTokenizer.from_pretrained(folders["base"])
    special = set(tokenizer.all_special_ids)
    pool = [token for token in range(len(tokenizer)) if token not in special]
    settings = ServerSettings(dtype="float32", max_model_len=max(args.prompt_lengths) + args.new_tokens + 16,
                              kv_cache_gib=args.kv_cache_gib)
    names = list(folders)
    cells = [(length, concurrency) for length in args.prompt_lengths for concurrency in args.concurrency]
    found: dict[tuple, dict[str, list]] = {}
    with contextlib.ExitStack() as stack:
        servers = {}
        for name in names:
            say(f"vLLM: starting a server for {name}")
            servers[name] = stack.enter_context(VllmServer(folders[name], settings))
            say(f"vLLM: {name} ready after {servers[name].start_seconds_taken:.0f} s")
        for name in names:  # warm-up: one short wave per server
            run_wave(servers[name].completions_url, servers[name].model,
                     random_prompts(max(args.concurrency), min(args.prompt_lengths), pool, random.Random(-1)),
                     min(args.new_tokens, 8))
        for repeat in range(args.repeats):
            for index, (length, concurrency) in enumerate(cells):
                for name in rotated(names, repeat + index):
                    workload = Workload(prompt_tokens=length, new_tokens=args.new_tokens, concurrency=concurrency,
                                        waves=1, warmup_waves=0, seed=1000 * repeat + index)
                    speeds = measure(servers[name].completions_url, servers[name].model, workload, pool)
                    row = found.setdefault((name, length, concurrency), {"prefill": [], "decode": []})
                    row["prefill"].append(speeds["prefill_tokens_per_second"])
                    row["decode"].append(speeds["decode_tokens_per_second"])
                    say(f"vLLM repeat {repeat + 1}/{args.repeats}: {name} {length} tokens x {concurrency}: prefill "
                        f"{row['prefill'][-1]:,.0f}, decode {row['decode'][-1]:,.1f} tok/s")
        version = servers[names[0]].version
        starts = {name: round(server.start_seconds_taken, 1) for name, server in servers.items()}
    rows = [{"model": name, "prompt_tokens": length, "concurrency": concurrency, "new_tokens": args.new_tokens,
             "prefill_tokens_per_second": spread(values["prefill"]),
             "decode_tokens_per_second": spread(values["decode"])}
            for (name, length, concurrency), values in found.items()]
    return {"version": version, "server": settings.describe(), "start_seconds": starts,
            "threads": "1 OMP thread (vLLM's default on 2 CPUs: one CPU is reserved for the server)",
            "workload": f"random prompt tokens sent as ids, {args.new_tokens} generated tokens per request (EOS "
                        "ignored); prefill = concurrency x prompt tokens / time until the last first token, decode = "
                        "concurrency / median time per output token after the first",
            "rows": sorted(rows, key=lambda r: (r["prompt_tokens"], r["concurrency"], names.index(r["model"])))}


# ------------------------------------------------------------------ llama.cpp


def export_gguf(folder: Path, out: Path) -> str | None:
    """`prunetool export FOLDER --gguf OUT --type f16`; None when written, else the one-line reason."""
    if out.exists():
        return None
    result = subprocess.run([sys.executable, "-m", "prunetool", "export", str(folder), "--gguf", str(out), "--type",
                             "f16"], capture_output=True, text=True)
    if result.returncode == 0 and out.exists():
        return None
    lines = [line for line in (result.stderr + result.stdout).splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit {result.returncode}"


def llama_bench(tool: Path, gguf: Path, arguments: list[str]) -> list[dict]:
    result = subprocess.run([str(tool), "-m", str(gguf), "-r", str(LLAMA_BENCH_RUNS), "-o", "json", *arguments], capture_output=True,
                            text=True, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"llama-bench failed on {gguf.name}: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout)


def run_llamacpp(folders: dict[str, Path], args) -> dict:
    from prunetool.serving.engines import llamacpp

    engine = llamacpp()
    if engine is None:
        return {"skipped": "llama.cpp is not set up (make engines)"}
    tool = engine.tool("llama-bench")
    probe = subprocess.run([sys.executable, "-m", "prunetool", "export", "--help"], capture_output=True, text=True)
    if probe.returncode != 0:
        return {"skipped": "`prunetool export` is not there yet, so no GGUF can be written"}
    ggufs, skipped = {}, {}
    for name, folder in folders.items():
        out = args.work / f"{name}-f16.gguf"
        say(f"llama.cpp: exporting {name}")
        reason = export_gguf(folder, out)
        if reason is None:
            ggufs[name] = out
        else:
            skipped[name] = reason
            say(f"llama.cpp: {name} skipped: {reason}")
    if not ggufs:
        return {"skipped": "no model could be exported", "models_skipped": skipped}
    names = list(ggufs)
    lengths = ",".join(map(str, args.prompt_lengths))
    found: dict[tuple, dict[str, list]] = {}
    build = None
    for repeat in range(args.repeats):
        for name in rotated(names, repeat):
            prefill = llama_bench(tool, ggufs[name], ["-p", lengths, "-n", "0", "-t", str(args.threads)])
            decode = llama_bench(tool, ggufs[name], ["-p", "0", "-n", str(args.new_tokens), "-d", lengths, "-t",
                                                      str(args.threads)])
            for entry in prefill:
                found.setdefault((name, entry["n_prompt"]), {"prefill": [], "decode": []})["prefill"].append(
                    entry["avg_ts"])
            for entry in decode:
                found.setdefault((name, entry["n_depth"]), {"prefill": [], "decode": []})["decode"].append(
                    entry["avg_ts"])
            build = build or {key: prefill[0].get(key) for key in ("build_commit", "build_number", "cpu_info")}
            say(f"llama.cpp repeat {repeat + 1}/{args.repeats}: {name} done")
    rows = [{"model": name, "prompt_tokens": length, "concurrency": 1, "new_tokens": args.new_tokens,
             "prefill_tokens_per_second": spread(values["prefill"]),
             "decode_tokens_per_second": spread(values["decode"])}
            for (name, length), values in found.items()]
    return {"build": build, "gguf_type": "f16", "threads": args.threads, "models_skipped": skipped,
            "workload": f"llama-bench, one sequence: pp at each prompt length; tg of {args.new_tokens} tokens at "
                        "that KV depth (-d)",
            "rows": sorted(rows, key=lambda r: (r["prompt_tokens"], names.index(r["model"])))}


# ------------------------------------------------------------------ the table docs/serving.md shows


def table(results: dict) -> str:
    setting = results["setting"]
    lines = [f"SmolLM2-135M and three cuts of it, each without six attention sublayers: tokens/s, median of {setting['repeats']} "
             f"repeat{'s' * (setting['repeats'] != 1)} with the range, models alternated within each repeat; "
             f"x = relative to the base. Every request generates {setting['new_tokens']} tokens."]
    if results.get("sizes"):
        found = results["sizes"]
        base = found["base"]
        lines += ["", "| | " + " | ".join(MODELS[n] for n in found) + " |", "|---|" + "---:|" * len(found),
                  "| parameters | " + " | ".join(f"{v['parameters'] / 1e6:.1f}M ({v['parameters'] / base['parameters']:.2f}x)"
                                             for v in found.values()) + " |",
                  "| KV cache per token (float32) | " + " | ".join(
                      f"{v['kv_bytes_per_token'] / 1024:.1f} KiB ({v['kv_bytes_per_token'] / base['kv_bytes_per_token']:.2f}x)"
                      for v in found.values()) + " |"]
    if setting["repeats"] < 2 or setting["new_tokens"] < 16:
        lines.append("**A smoke run with reduced settings: these numbers only show that the benchmark runs.**")
    elif setting["repeats"] < DEFAULTS["repeats"] or setting["new_tokens"] < DEFAULTS["new_tokens"]:
        lines.append(f"**A reduced run ({setting['repeats']} repeats, {setting['new_tokens']} new tokens; the full "
                     "run is `python bench/serving.py`): ranges over so few repeats on a shared 2-core machine are "
                     "wide, so read only differences well beyond them.**")
    for engine, label in (("vllm", "vLLM"), ("llamacpp", "llama.cpp")):
        part = results.get(engine) or {}
        if "skipped" in part:
            lines += ["", f"{label}: skipped ({part['skipped']})."]
            continue
        if engine == "vllm":
            lines += ["", f"vLLM {part['version']} (CPU build, float32, {part['threads']}; prefix cache off, "
                          f"{part['server']['kv_cache_space_gib']:g} GiB KV cache; {part['workload']}):"]
        else:
            commit = (part.get("build") or {}).get("build_commit", "?")
            lines += ["", f"llama.cpp (build {commit}, {part['gguf_type']} GGUF, {part['threads']} thread"
                          f"{'s' * (part['threads'] != 1)}; {part['workload']}):"]
            for name, reason in (part.get("models_skipped") or {}).items():
                lines.append(f"{MODELS[name]} skipped: {reason}")
        names = [name for name in MODELS if any(row["model"] == name for row in part["rows"])]
        lines += ["", "| prompt tokens | concurrency | measure | " + " | ".join(MODELS[n] for n in names) + " |",
                  "|---:|---:|---|" + "---:|" * len(names)]
        cells = sorted({(row["prompt_tokens"], row["concurrency"]) for row in part["rows"]})
        for length, concurrency in cells:
            by_model = {row["model"]: row for row in part["rows"]
                        if (row["prompt_tokens"], row["concurrency"]) == (length, concurrency)}
            for measure in ("prefill", "decode"):
                key = f"{measure}_tokens_per_second"
                base = by_model.get("base", {}).get(key, {}).get("median")
                texts = []
                for name in names:
                    if name not in by_model:
                        texts.append("")
                        continue
                    value = by_model[name][key]
                    text = f"{value['median']:,.1f} ({value['min']:,.1f}-{value['max']:,.1f})"
                    if name != "base" and base:
                        text += f" {value['median'] / base:.2f}x"
                    texts.append(text)
                lines.append(f"| {length} | {concurrency} | {measure} | " + " | ".join(texts) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------ main


def numbers(text: str) -> tuple[int, ...]:
    values = tuple(int(part) for part in text.split(",") if part.strip())
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=DEFAULTS["repeats"])
    parser.add_argument("--prompt-lengths", type=numbers, default=DEFAULTS["prompt_lengths"])
    parser.add_argument("--new-tokens", type=int, default=DEFAULTS["new_tokens"])
    parser.add_argument("--concurrency", type=numbers, default=DEFAULTS["concurrency"], help="vLLM only")
    parser.add_argument("--threads", type=int, default=DEFAULTS["threads"], help="llama.cpp's threads")
    parser.add_argument("--kv-cache-gib", type=int, default=KV_CACHE_GIB, help="VLLM_CPU_KVCACHE_SPACE per server")
    parser.add_argument("--engines", default="vllm,llamacpp")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "prunetool" / "bench-serving",
                        help="where the cut folders and GGUFs are written (kept between runs)")
    parser.add_argument("--output", type=Path, help="write here instead of bench/results/serving.json")
    parser.add_argument("--sizes-only", action="store_true", help="add the models' parameters and KV bytes to the "
                        "existing results (no timing) and print the table")
    args = parser.parse_args()
    if args.repeats < 1 or args.new_tokens < 2:
        parser.error("--repeats must be at least 1 and --new-tokens at least 2")
    engines = {name.strip() for name in args.engines.split(",")}
    args.work.mkdir(parents=True, exist_ok=True)
    folders = build_folders(args.work)
    if args.sizes_only:
        path = args.output or ROOT / "bench" / "results" / "serving.json"
        results = json.loads(path.read_text())
        results["sizes"] = sizes(folders)
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(table(results))
        return
    started = time.perf_counter()
    results = {"setting": {"models": {name: MODELS[name] for name in folders}, "base": BASE, "cut": list(CUT),
                           "mixed": {"blocks": list(MIXED_BLOCKS), "attention": list(MIXED_ATTENTION)},
                           "repeats": args.repeats, "prompt_lengths": list(args.prompt_lengths),
                           "new_tokens": args.new_tokens, "concurrency": list(args.concurrency),
                           "threads": args.threads}}
    results["vllm"] = run_vllm(folders, args) if "vllm" in engines else {"skipped": "not asked for (--engines)"}
    results["llamacpp"] = (run_llamacpp(folders, args) if "llamacpp" in engines else
                           {"skipped": "not asked for (--engines)"})
    results["seconds"] = round(time.perf_counter() - started, 1)
    results["sizes"] = sizes(folders)
    if args.output is None:
        from provenance import write_results

        write_results("serving", results)
    else:
        from provenance import provenance

        args.output.write_text(json.dumps({"provenance": provenance(), **results}, indent=1) + "\n")
        say(f"results written to {args.output}")
    print(table(results))


if __name__ == "__main__":
    main()
