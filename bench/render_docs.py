"""bench/results/*.json -> the generated regions of README.md and docs/*.md (and docs/quality.png, docs/kv.png).

Run:   .venv/bin/python bench/render_docs.py            # rewrite every generated region, redraw the figure
       .venv/bin/python bench/render_docs.py --check    # exit 1 and name the files whose regions are stale

A generated region sits between two markers, and only its inside is ever rewritten:

    <!-- generated:NAME (bench/SCRIPT.py) -->
    ...
    <!-- end generated:NAME -->

NAME picks a renderer from REGIONS below; SCRIPT must be the bench script that measures what NAME shows,
so a reader of the Markdown source knows which command to rerun. No model is loaded here: the
renderers only format the committed results, which is why `make docs` is cheap and the docs test fast.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # the bench scripts import each other by module name

MARKER = re.compile(r"<!-- generated:(?P<name>[\w-]+) \((?P<script>[\w/.-]+)\) -->\n(?P<body>.*?)"
                    r"<!-- end generated:(?P=name) -->", re.S)
HEADS_MODELS = {"smollm2": "SmolLM2-135M", "gemma3": "Gemma 3 270M"}
DROP_EXAMPLE = ("smollm2-135m", 6)  # the `prune --drop 6` the docs walk through


@dataclass(frozen=True)
class Region:
    script: str  # the bench script whose results this region shows
    results: tuple[str, ...]  # files under bench/results/ it reads
    render: Callable[..., str]  # parsed results files, in that order -> Markdown


def load(root: Path, name: str) -> dict:
    return json.loads((root / "bench" / "results" / name).read_text())


def stamp(results: dict) -> str:
    """One line saying when, where and with what the numbers were measured, and the command."""
    p = results["provenance"]
    versions = ", ".join(f"{name} {p['versions'][name]}" for name in ("torch", "transformers") if name in p["versions"])
    return f"Measured {p['date']} on {p['machine']}; {versions}; `{p['command']}`."


def stamped(module: str) -> Callable[[dict], str]:
    """A bench script's own `table(results)`, under its provenance line."""
    return lambda results: stamp(results) + "\n\n" + importlib.import_module(module).table(results)


def stamped_with_goals(module: str) -> Callable[[dict], str]:
    """`stamped(module)`, then the script's `goals(results)`: what was asked, read off the same numbers."""
    return lambda results: stamped(module)(results) + "\n\n" + importlib.import_module(module).goals(results)


def heads_table(kind: str) -> Callable[[dict], str]:
    """One of bench/heads_markdown.py's tables of a heads-MODEL.json."""
    return lambda results: "\n".join(getattr(importlib.import_module("heads_markdown"), kind)(results["heads"]))


def heads_cost(*files: dict) -> str:
    """Wall time and peak memory of each `prunetool heads` run, under the runs' provenance."""
    lines = ["| model | heads | wall time (command) | of which probe + swap test | peak RSS |", "|---|---:|---:|---:|---:|"]
    for results, label in zip(files, HEADS_MODELS.values()):
        heads = results["heads"]
        shape = f"{len(heads['layers'])} x {len(heads['heads']) // len(heads['layers'])}"
        lines.append(f"| {label} | {shape} | {results['seconds']:.0f} s | {heads['meta']['probe_seconds']:.0f} s | "
                     f"{results['peak_rss_bytes'] / 1e9:.2f} GB |")
    return "\n".join([stamp(files[0]), "", *lines])


def default_drop(quality: dict) -> str:
    """What `prune --drop 6` removes from SmolLM2, as bench/quality.py measured the default criterion."""
    alias, drop = DROP_EXAMPLE
    removed = importlib.import_module("quality").default_removal(quality, alias, drop)
    return (f"With the C4 sample as calibration (`--calib ../shared/data/c4_en_sample_1000.jsonl`, 16 windows x 512 "
            f"tokens, as `bench/quality.py` scores), `prunetool prune --drop {drop}` with the default criterion "
            f"(`{importlib.import_module('quality').DEFAULT}`) removes layers **{', '.join(map(str, removed))}** of {alias}'s "
            f"{len(quality[alias]['scores']['c4']['layers'])} (`bench/results/quality.json`). Another calibration "
            f"text (the default is the model's own) may choose other layers; `prunetool prune --drop {drop} "
            f"--dry-run` prints the choice before anything is written.")


def removed_heads(quality: dict, heads: dict) -> str:
    """How the layers that default prune removes look in the heads run, beside the layers before them."""
    alias, drop = DROP_EXAMPLE
    removed = importlib.import_module("quality").default_removal(quality, alias, drop)
    layers = {row["index"]: row for row in heads["heads"]["layers"]}
    early = [i for i in layers if i < min(removed)]
    post = [layers[i]["q_similarity_post_rope"] for i in removed]
    before = [layers[i]["q_similarity_post_rope"] for i in early]
    reaccess = sum(layers[i]["patterns"]["re-access"] for i in removed)
    heads_per_layer = len(heads["heads"]["heads"]) // len(layers)
    return (f"`prune --drop {drop}` with C4 calibration removes layers {', '.join(map(str, removed))} "
            f"(`bench/results/quality.json`). In this run {reaccess} of their {heads_per_layer * len(removed)} heads "
            f"are re-access heads, and their post-RoPE q-similarity averages {sum(post) / len(post):.2f} "
            f"({min(post):.2f}-{max(post):.2f}) against {sum(before) / len(before):.2f} over layers "
            f"{min(early)}-{max(early)} ({min(before):.2f}-{max(before):.2f}).")


def repair_table(results: dict) -> str:
    """bench/repair.py's rows: held-out perplexity and the share of the plain cut's log-perplexity gap each repair
    recovers, with what it cost."""
    setting, versions = results["setting"], results.get("versions", {})
    calibration, held = setting["calibration"], setting["eval"]
    lines = [f"Measured {results['date'][:10]} on {setting.get('threads', '?')} CPU threads, {setting['dtype']}; "
             f"torch {versions.get('torch', '?')}, transformers {versions.get('transformers', '?')}; "
             f"`python {results['command']}`.", "",
             f"{setting['model']} with layers {', '.join(map(str, setting['removed']))} removed. Fitted on "
             f"{calibration.get('file', calibration['source'])}; perplexity on the first {held['windows']} windows x "
             f"{held['seq_len']} tokens of {held.get('file', held['source'])}, which nothing was fitted on. Gap "
             f"recovered: {setting['gap_recovered']}.", "",
             "| row | perplexity | gap recovered | patch seconds |", "|---|---:|---:|---:|"]
    for row in results["rows"]:
        gap = f"{100 * row['gap_recovered']:.1f}%" if "gap_recovered" in row else ""
        cost = f"{row['patch_seconds']:.0f}" if "patch_seconds" in row else ""
        lines.append(f"| {row['row']} | {row['perplexity']:.2f} | {gap} | {cost} |")
    return "\n".join(lines)


REGIONS: dict[str, Region] = {
    "engine-equality": Region("bench/engine_equality.py", ("engine_equality.json",), stamped("engine_equality")),
    "serving": Region("bench/serving.py", ("serving.json",), stamped("serving")),
    "sublayer": Region("bench/sublayer.py", ("sublayer.json",), stamped("sublayer")),
    "repair": Region("bench/repair.py", ("repair.json",), repair_table),
    "repair-tokens": Region("bench/repair.py", ("repair_tokens.json",), repair_table),
    "repair-heal-lr": Region("bench/repair_heal.py", ("repair_heal_lr.json",),
                             lambda r: stamp(r) + "\n\n" + importlib.import_module("repair_heal").lr_table(r)),
    "repair-heal-smollm2-6": Region("bench/repair_heal.py", ("repair_heal-smollm2-135m-6.json",),
                                    stamped("repair_heal")),
    "repair-heal-smollm2-6-h200": Region("bench/repair_heal.py", ("repair_heal-smollm2-135m-6-h200.json",),
                                         stamped("repair_heal")),
    "scale-model": Region("bench/scale_model.py", ("scale_model.json",),
                          lambda r: stamp(r) + "\n\n" + importlib.import_module("scale_model").table(r)),
    "scale-check": Region("bench/scale_model.py", ("scale_model.json",),
                          lambda r: importlib.import_module("scale_model").check_table(r)),
    "low-memory-prune": Region("bench/low_memory_prune.py", ("low_memory_prune.json",),
                               lambda r: stamp(r) + "\n\n" + importlib.import_module("low_memory_prune").table(r)),
    "gpu-check": Region("bench/gpu_check.sh", ("gpu_check-h200.json",),
                        lambda r: stamp(r) + f" On {r['hardware']}:\n\n    " + r["summary"]),
    "repair-heal-smollm2-9": Region("bench/repair_heal.py", ("repair_heal-smollm2-135m-9.json",),
                                    stamped("repair_heal")),
    "repair-heal-gemma3-4": Region("bench/repair_heal.py", ("repair_heal-gemma3-270m-4.json",),
                                   stamped("repair_heal")),
    "repair-heal-gemma3-4-ppl": Region("bench/repair_heal.py", ("repair_heal-gemma3-270m-4-ppl.json",),
                                       stamped("repair_heal")),
    "repair-heal-goals": Region("bench/repair_heal.py", ("repair_heal-smollm2-135m-6.json",),
                                lambda r: importlib.import_module("repair_heal").goals(r)),
    "repair-heal-goals-h200": Region("bench/repair_heal.py", ("repair_heal-smollm2-135m-6-h200.json",),
                                     lambda r: importlib.import_module("repair_heal").goals(r)),
    "heal-step": Region("bench/heal_step.py", ("heal_step.json",), stamped("heal_step")),
    "heal-loop": Region("bench/heal_loop.py", ("heal_loop.json",), stamped_with_goals("heal_loop")),
    "heal-distributed": Region("bench/heal_distributed.py", ("heal_distributed.json",),
                               stamped_with_goals("heal_distributed")),
    "heal-ranks": Region("bench/scale_model.py", ("scale_model.json",),
                         lambda r: importlib.import_module("scale_model").heal_table(r)),
    "score-overhead": Region("bench/score_overhead.py", ("score_overhead.json",), stamped("score_overhead")),
    "prune-write": Region("bench/prune_write.py", ("prune_write.json",), stamped("prune_write")),
    "quality": Region("bench/quality.py", ("quality.json",), lambda r: importlib.import_module("quality").report_markdown(r)),
    "qsim-cost": Region("bench/qsim_cost.py", ("qsim_cost.json",), stamped("qsim_cost")),
    "score-memory": Region("bench/score_memory.py", ("score_memory.json",), stamped("score_memory")),
    "score-reference": Region("bench/score_reference.py", ("score_reference.json",), stamped("score_reference")),
    "search": Region("bench/quality.py", ("quality.json",), lambda r: importlib.import_module("quality").search_markdown(r)),
    "cut-engine-speed": Region("bench/cut_engine_speed.py", ("cut_engine_speed.json",), stamped("cut_engine_speed")),
    "dry-run-time": Region("bench/dry_run_time.py", ("dry_run_time.json",), stamped("dry_run_time")),
    "default-drop": Region("bench/quality.py", ("quality.json",), default_drop),
    "heads-cost": Region("bench/heads_results.py", tuple(f"heads-{m}.json" for m in HEADS_MODELS), heads_cost),
    "kv-smollm2": Region("bench/kv.py", ("kv-smollm2-135m.json",), stamped("kv")),
    "kv-gemma3": Region("bench/kv.py", ("kv-gemma3-270m.json",), stamped("kv")),
    "kv-goals": Region("bench/kv.py", ("kv-smollm2-135m.json", "kv-gemma3-270m.json"),
                       lambda *files: importlib.import_module("kv").goals(*files)),
    "kv-8k-smollm2": Region("bench/kv.py", ("kv8k-smollm2-135m.json",), stamped("kv")),
    "kv-8k-gemma3": Region("bench/kv.py", ("kv8k-gemma3-270m.json",), stamped("kv")),
    "kv-layers-gemma3": Region("bench/kv.py", ("kv_layers-gemma3-270m.json",),
                               lambda r: stamp(r) + "\n\n" + importlib.import_module("kv").layers_table(r)),
    "heads-removed-smollm2": Region("bench/heads_results.py", ("quality.json", "heads-smollm2.json"), removed_heads),
}
for _model in HEADS_MODELS:
    for _kind in ("mix_table", "correlation_table", "seasonal_table", "type_by_swap", "sensitivity"):
        REGIONS[f"heads-{_model}-{_kind.removesuffix('_table').replace('_', '-')}"] = Region(
            "bench/heads_results.py", (f"heads-{_model}.json",), heads_table(_kind))

# Every figure in docs/ and the command that draws it (bench/render_docs.py itself redraws the first).
FIGURES = {"docs/quality.png": "bench/quality.py --report (from bench/results/quality.json; also make docs)",
           "docs/heads/*.png": "bench/heads_results.py (copied from the `prunetool heads` report it runs)",
           "docs/kv.png": "bench/kv.py --plot (from bench/results/kv-*.json; also make docs)",
           "docs/sublayer.png": "bench/sublayer.py --report (from bench/results/sublayer.json)"}


def documents(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def render_text(text: str, root: Path, where: str) -> str:
    """`text` with every generated region refilled from the results under `root`."""

    def fill(match: re.Match) -> str:
        name, script = match["name"], match["script"]
        if name not in REGIONS:
            raise SystemExit(f"{where}: unknown generated region {name!r} (known: {', '.join(REGIONS)})")
        region = REGIONS[name]
        if script != region.script:
            raise SystemExit(f"{where}: region {name} names {script}, but {region.script} produces it")
        body = region.render(*(load(root, file) for file in region.results)).strip("\n")
        return f"<!-- generated:{name} ({script}) -->\n{body}\n<!-- end generated:{name} -->"

    return MARKER.sub(fill, text)


def render_all(root: Path = ROOT) -> dict[Path, str]:
    """Every document that has generated regions -> its text as rendered now."""
    rendered, used = {}, set()
    for path in documents(root):
        text = path.read_text()
        used |= {match["name"] for match in MARKER.finditer(text)}
        if MARKER.search(text):
            rendered[path] = render_text(text, root, str(path.relative_to(root)))
    unused = set(REGIONS) - used
    if unused:
        raise SystemExit(f"regions no document shows: {', '.join(sorted(unused))}; remove them from REGIONS")
    return rendered


def stale(root: Path = ROOT) -> list[str]:
    """Documents whose generated regions differ from a fresh render (relative paths)."""
    return [str(path.relative_to(root)) for path, text in render_all(root).items() if path.read_text() != text]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if any document is stale")
    args = parser.parse_args()
    if args.check:
        files = stale()
        if files:
            raise SystemExit(f"stale generated regions in {', '.join(files)}; run `make docs`")
        print("docs are up to date with bench/results")
        return
    for path, text in render_all().items():
        if path.read_text() != text:
            path.write_text(text)
            print(f"rewrote {path.relative_to(ROOT)}")
    quality = importlib.import_module("quality")
    quality.plot(quality.load_results())
    kv = importlib.import_module("kv")
    kv.plot(kv.load_results())


if __name__ == "__main__":
    main()
