"""Files written beside the pruned weights: the plan record, a model card, and the same cut for other tools.

mergekit's passthrough merge and llama.cpp's `llama-quantize --prune-layers` can reproduce the cut from
these, so users of those tools need not trust prunetool's writer.
"""

import json
import time

from prunetool import __version__
from prunetool.select.plan import PrunePlan
from prunetool.sources.demo import find_alias


def kept_ranges(plan: PrunePlan) -> list[tuple[int, int]]:
    """Contiguous runs of kept layers as half-open [start, end) ranges of original indices."""
    ranges: list[tuple[int, int]] = []
    for index in plan.kept:
        if ranges and ranges[-1][1] == index:
            ranges[-1] = (ranges[-1][0], index + 1)
        else:
            ranges.append((index, index + 1))
    return ranges


def mergekit_yaml(plan: PrunePlan, base_model: str, dtype: str | None) -> str:
    """A mergekit passthrough config whose slices keep exactly the kept layers (layer_range ends are exclusive)."""
    lines = [
        f"# The same cut as prunetool: removes original layers {list(plan.removed)} (0-based).",
        "# Run: mergekit-yaml mergekit.yaml OUTPUT_DIR",
        "merge_method: passthrough",
    ]
    if dtype:
        lines.append(f"dtype: {dtype}")
    lines.append("slices:")
    for start, end in kept_ranges(plan):
        lines += ["  - sources:", f"      - model: {json.dumps(base_model)}", f"        layer_range: [{start}, {end}]"]
    return "\n".join(lines) + "\n"


def llamacpp_prune_layers(plan: PrunePlan) -> str:
    """The comma-separated list `llama-quantize --prune-layers` takes (0-based original indices)."""
    return ",".join(str(index) for index in plan.removed) + "\n"


def prune_record(plan: PrunePlan, *, source_path: str, perplexity: dict | None, verification: dict | None,
                 patch: dict | None = None) -> dict:
    """prune.json: everything needed to know and redo what was removed (and, with --patch, what changed)."""
    return {
        **plan.to_json(),
        "source_path": source_path,
        "perplexity": perplexity,
        "patch": patch,
        "verification": verification,
        "prunetool_version": __version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _perplexity_rows(perplexity: dict | None, base_layers: int, kept_layers: int) -> list[str]:
    if not perplexity:
        return ["Perplexity was not measured (`--no-verify`)."]
    rows = [
        f"Perplexity on held-out calibration text ({perplexity['description']}):",
        "",
        "| model | layers | perplexity |",
        "|---|---|---|",
        f"| base | {base_layers} | {perplexity['before']:.3f} |",
    ]
    if "patched" in perplexity:
        return rows + [f"| pruned, no patch | {kept_layers} | {perplexity['plain_cut']:.3f} |",
                       f"| pruned + patch (this checkpoint) | {kept_layers} | {perplexity['patched']:.3f} |"]
    return rows + [f"| pruned | {kept_layers} | {perplexity['after']:.3f} |"]


def source_sentence(spec: str, patched: bool = False) -> str:
    """Relative to what the weights are unchanged: the folder prune read, which for a GGUF is not the release.

    A demo alias or .gguf file is dequantized into a float32 safetensors folder first; the kept tensors are
    byte-identical to that folder, which already differs from the original fp16/bf16 weights.
    """
    unchanged = ("No weights were changed relative to the checkpoint folder prune read (`source_path` in "
                 "`prune.json`): every kept tensor is byte-identical to its counterpart there.")
    if patched:
        unchanged = ("Relative to the checkpoint folder prune read (`source_path` in `prune.json`), only the kept "
                     "weights `--patch` changed (listed below) differ; every other kept tensor is byte-identical.")
    demo = find_alias(spec)
    if demo is not None:
        return (f"{unchanged} That folder is the demo model `{demo.name}`: {demo.dequantized_from}, not the "
                f"original {demo.hub_id} weights, so it carries the {demo.quantization} quantisation error and "
                "its numbers are not comparable with published fp16/bf16 figures.")
    if spec.lower().endswith(".gguf"):
        return (f"{unchanged} That folder is `{spec}` dequantized to float32 safetensors; if the GGUF is quantised, "
                "its numbers are not comparable with those of the original fp16/bf16 weights.")
    return unchanged


def _patch_rows(patch: dict | None) -> list[str]:
    """What --patch changed, run by run: the card must say which kept weights differ from the base."""
    if patch is None:
        return []
    changed = [name for run in patch["runs"] for name in run["tensors"]]
    rows = [
        f"Weights of kept layers were changed by `--patch` (objective `{patch['objective']}`, fitted on "
        f"{patch['tokens']} calibration tokens, no training): {', '.join(f'`{n}`' for n in changed) or 'none'}.",
        "",
        "| removed run | what was done | residual error before | after |",
        "|---|---|---|---|",
    ]
    for run in patch["runs"]:
        error = run.get("residual_error") or {}
        before, after = (f"{error[k]:.4f}" if k in error else "-" for k in ("before", "after"))
        rows.append(f"| {run['layers'][0]}-{run['layers'][1]} | {run['action']} | {before} | {after} |")
    return rows + [""]


FOLDER_PLACEHOLDER = "path/to/this-folder"
PROMPT = "The capital of France is"


def serving_lines(nemotron: bool) -> list[str]:
    """The card's "Serve" section: the commands that run this folder in vLLM and in llama.cpp (tested as written).

    A nemotron-nas folder needs trust_remote_code in vLLM because vLLM's transformers has no configuration
    class for it; llama.cpp's own converter cannot read every tokenizer of that format, so the GGUF comes
    from `prunetool export` for every folder kind.
    """
    remote = " --trust-remote-code" if nemotron else ""
    remote_python = ", trust_remote_code=True" if nemotron else ""
    return [
        "## Serve",
        "",
        "```bash",
        f"vllm serve {FOLDER_PLACEHOLDER}{remote}  # vLLM: OpenAI-compatible server on port 8000",
        f"prunetool export {FOLDER_PLACEHOLDER} --gguf model.gguf --type f16  # llama.cpp: a GGUF of this folder",
        f'llama-completion -m model.gguf -p "{PROMPT}" -n 32 -no-cnv',
        "```",
        "",
        "```python",
        "from vllm import LLM, SamplingParams",
        f'llm = LLM(model="{FOLDER_PLACEHOLDER}"{remote_python})',
        f'print(llm.generate(["{PROMPT}"], SamplingParams(max_tokens=32))[0].outputs[0].text)',
        "```",
        "",
        "prunetool checked that vLLM and llama.cpp compute what transformers computes for folders of this kind "
        "(docs/serving.md in the prunetool repository).",
    ]


UNIT_WORDS = {"block": "whole decoder layers", "attention": "attention sublayers", "mlp": "MLP sublayers",
              "mixed": "whole decoder layers and sublayers"}


def _target_rows(targets: dict | None) -> list[str]:
    """The budget a --target prune was asked for, each target's value for the base and the cut, and whether met."""
    if not targets:
        return []
    rows = ["Targets (`--target`):", "", "| target | base | pruned | met |", "|---|---|---|---|"]
    for report in targets["targets"]:
        if "ratio" in report:
            pruned = f"{report['cut']:,.0f} ({report['ratio']:.3f}x)"
        else:
            speedup = report.get("speedup", report.get("predicted_speedup"))
            pruned = f"{speedup:.2f}x faster" + ("" if "speedup" in report else " (predicted)")
        base = f"{report['base']:,.0f}" if "ratio" in report else "1.00x"
        rows.append(f"| {report['target']} | {base} | {pruned} | {'yes' if report['met'] else 'no'} |")
    return rows + [""]


def model_card(plan: PrunePlan, *, base_model: str, perplexity: dict | None, command: str,
               patch: dict | None = None) -> str:
    """README.md with Hub front matter, saying what was removed and what it cost."""
    criterion = plan.criterion if not plan.parameters else (
        f"{plan.criterion} ({', '.join(f'{key}={value}' for key, value in plan.parameters.items())})")
    lines = [
        "---",
        f"base_model: {json.dumps(base_model)}",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [pruned, prunetool]",
        "---",
        "",
        (f"# {base_model}, {len(plan.removed)} of {plan.num_layers} {UNIT_WORDS[plan.unit]} removed"
         if plan.unit != "mixed" else f"# {base_model}, {plan.cut.describe()} removed"),
        "",
        f"Made with prunetool {__version__} by removing {UNIT_WORDS[plan.unit]}"
        f"{'' if plan.cut.blocks_only else ' (a nemotron-nas / DeciLM checkpoint: load with trust_remote_code=True)'}. "
        f"{source_sentence(plan.base_model, patched=patch is not None)}",
        "",
        *_patch_rows(patch),
        f"- Removed (0-based indices of the original model): {plan.cut.describe()}",
        f"- Kept: {len(plan.kept)} layers; `prune.json` maps each original index to its new one.",
        f"- Chosen by: {criterion}",
        "",
        *_target_rows(plan.targets),
        *_perplexity_rows(perplexity, plan.num_layers, len(plan.kept)),
        "",
        "Reproduce:",
        "",
        "```bash",
        command,
        "```",
        "",
        *serving_lines(not plan.cut.blocks_only),
    ]
    if plan.cut.blocks_only:
        lines += ["", "The same cut with other tools: `mergekit.yaml` (mergekit passthrough) and",
                  "`llama.cpp-prune-layers.txt` (`llama-quantize --prune-layers $(cat llama.cpp-prune-layers.txt) ...`)."]
    return "\n".join(lines) + "\n"
