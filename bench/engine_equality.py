"""Do vLLM and llama.cpp compute what transformers computes on every kind of folder prunetool writes?

Builds the folders the engine tests use (tiny Llama, Qwen2 and Gemma 3, uncut and block cuts; Llama and Qwen2
attention, MLP and mixed nemotron-nas cuts; SmolLM2 uncut and with layers 13-18 removed as blocks and as
attention) and runs each in both engines (`make engines`), transformers in float32 beside them:
- vLLM: greedy continuations (12 tokens on tiny models, 16 on SmolLM2) replayed through transformers: how
  many sequences are transformers' greedy ones, and the largest gap between the two sides' log-probs of the
  chosen and the prompt tokens;
- llama.cpp: `prunetool export --type f32`, then the largest log-prob gap over every position and vocabulary
  entry of the same prompts, and `llama-perplexity` beside transformers on the same WikiText-2 windows
  (4 windows of 128 tokens on tiny models, 4 of 512 on SmolLM2; float32 KV cache).

Run:   .venv/bin/python bench/engine_equality.py   # -> bench/results/engine_equality.json (about 10 minutes)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "bench", ROOT / "tests"):
    sys.path.insert(0, str(path))

from provenance import write_results  # noqa: E402

TIE = 2e-4  # a chosen token within this of transformers' best log-prob counts as greedy (tests use the same)
DATA = ROOT.parent / "shared" / "data" / "wikitext2-test.raw"


def build(work: Path) -> dict[str, tuple[Path, str]]:
    """name -> (folder, what it is)."""
    from engine_models import FOLDERS, LAYERS, REAL_FOLDERS, make_base, write_cut
    from prunetool.sources import resolve_model

    folders, bases = {}, {}
    for name, (arch, cut) in FOLDERS.items():
        if arch not in bases:
            bases[arch] = make_base(arch, work / f"{arch}-base")
            folders[f"{arch}-base"] = (bases[arch], f"tiny {arch}, uncut")
        what = (f"blocks {list(cut[1])} removed" if cut[0] == "block" else
                f"attention {list(cut[1])}, MLP {list(cut[2])} removed (nemotron-nas)")
        folders[name] = (write_cut(bases[arch], cut, work / name, LAYERS), f"tiny {arch}, {what}")
    smollm2 = resolve_model("smollm2-135m").path
    folders["smollm2-base"] = (smollm2, "SmolLM2-135M, uncut")
    for name, cut in REAL_FOLDERS.items():
        what = "blocks 13-18 removed" if cut[0] == "block" else "attention 13-18 removed (nemotron-nas)"
        folders[name] = (write_cut(smollm2, cut, work / name, 30), f"SmolLM2-135M, {what}")
    return folders


def prompts_for(folder: Path, real: bool) -> list[list[int]]:
    from transformers import AutoTokenizer

    from engine_models import random_prompts, wikitext_prompts

    if real:
        return wikitext_prompts(AutoTokenizer.from_pretrained(folder), DATA.parent)
    return random_prompts(json.loads((folder / "config.json").read_text())["vocab_size"])


def groups(folders: dict[str, tuple[Path, str]]):
    """(real, {name: folder}, prompts): the tiny folders share a vocabulary, the SmolLM2 ones theirs."""
    for real in (False, True):
        group = {name: folder for name, (folder, _) in folders.items() if name.startswith("smollm2") == real}
        yield real, group, prompts_for(next(iter(group.values())), real)


def load_transformers(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prunetool.serving.vllm_tokens import needs_remote_code

    trust = needs_remote_code(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=trust).eval()
    return model, AutoTokenizer.from_pretrained(folder, trust_remote_code=trust)


def vllm_rows(folders: dict[str, tuple[Path, str]]) -> dict[str, dict]:
    from prunetool.serving.vllm_tokens import agreement, vllm_continuations

    rows = {}
    for real, group, prompts in groups(folders):
        answers = vllm_continuations(list(group.values()), prompts, max_tokens=16 if real else 12, strict=False)
        for name, folder in group.items():
            if isinstance(answers[folder], str):
                rows[name] = {"error": answers[folder]}
                continue
            found = agreement(load_transformers(folder)[0], prompts, answers[folder], tie=TIE)
            rows[name] = {"sequences": len(prompts), "sequences_equal": found.sequences_equal,
                          "tokens": found.tokens, "worst_logprob_gap": found.worst_logprob_gap}
    return rows


def llamacpp_rows(folders: dict[str, tuple[Path, str]], work: Path) -> dict[str, dict]:
    import torch

    from engine_models import wikitext_prefix
    from prunetool.checkpoint.gguf import export_gguf
    from prunetool.serving.engines import llamacpp
    from prunetool.serving.llamacpp_tokens import llamacpp_logits, log_softmax, max_logprob_gap, perplexity_pair

    engine = llamacpp()
    if engine is None:
        raise SystemExit("llama.cpp is not set up: run `make engines`")
    rows = {}
    for real, group, prompts in groups(folders):
        ggufs = {name: work / f"{name}.f32.gguf" for name in group}
        for name, folder in group.items():
            export_gguf(folder, ggufs[name], "f32")
        logits = llamacpp_logits(engine, list(ggufs.values()), prompts)
        text_path, _ = wikitext_prefix(DATA.parent, work, 24_000 if real else 12_000)
        n_ctx = 512 if real else 128
        for index, (name, folder) in enumerate(group.items()):
            model, tokenizer = load_transformers(folder)
            with torch.no_grad():
                reference = [log_softmax(model(torch.tensor([ids])).logits[0]) for ids in prompts]
            ours = [log_softmax(logits[f"logits_{index}_{number}"]) for number in range(len(prompts))]
            perplexity, transformers_perplexity = perplexity_pair(engine, model, tokenizer, ggufs[name], text_path,
                                                                  n_ctx=n_ctx, chunks=4)
            rows[name] = {"gguf_type": "f32", "worst_logprob_gap": max_logprob_gap(ours, reference),
                          "perplexity": perplexity, "transformers_perplexity": transformers_perplexity,
                          "windows": f"4 x {n_ctx} tokens"}
    return rows


def table(results: dict) -> str:
    rows = results["folders"]
    llama = any("llamacpp" in row for row in rows.values())
    lines = ["| folder | vLLM: greedy sequences equal | vLLM: max log-prob gap |"
             + (" llama.cpp f32 GGUF: max log-prob gap | llama-perplexity against transformers |" if llama else ""),
             "|---|---|---|" + ("---|---|" if llama else "")]
    for row in rows.values():
        vllm = row.get("vllm", {})
        seen = (f"{vllm['sequences_equal']}/{vllm['sequences']}" if "sequences" in vllm else
                "fails" if "error" in vllm else "-")
        gap = f"{vllm['worst_logprob_gap']:.1e}" if "worst_logprob_gap" in vllm else "-"
        line = f"| {row['what']} | {seen} | {gap} |"
        if llama:
            other = row.get("llamacpp", {})
            line += (f" {other['worst_logprob_gap']:.1e} |" if "worst_logprob_gap" in other else " - |")
            line += (f" {other['perplexity']:.4f} against {other['transformers_perplexity']:.4f} |"
                     if "perplexity" in other else " - |")
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="vllm,llamacpp", help="which engines to run (comma-separated)")
    args = parser.parse_args()
    engines = args.engines.split(",")
    with tempfile.TemporaryDirectory(prefix="engine-equality-") as work:
        folders = build(Path(work))
        results = {name: {"what": what} for name, (_, what) in folders.items()}
        if "vllm" in engines:
            for name, row in vllm_rows(folders).items():
                results[name]["vllm"] = row
        if "llamacpp" in engines:
            for name, row in llamacpp_rows(folders, Path(work)).items():
                results[name]["llamacpp"] = row
    write_results("engine_equality", {"tie": TIE, "folders": results})


if __name__ == "__main__":
    main()
