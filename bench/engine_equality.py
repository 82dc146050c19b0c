"""Does vLLM compute what transformers computes on every kind of folder prunetool writes?

Builds the folders the engine tests use (tiny Llama, Qwen2 and Gemma 3 block cuts; Llama and Qwen2 attention,
MLP and mixed nemotron-nas cuts; SmolLM2 with layers 13-18 removed as blocks and as attention), runs each in
vLLM (`make engines`), and replays its greedy continuations (12 tokens on tiny models, 16 on SmolLM2)
through transformers in float32: how many sequences are transformers' greedy ones, and the largest gap
between the two sides' log-probs of the chosen and the prompt tokens. (llama.cpp's agreement is checked by
tests/test_engine_llamacpp.py; a `llamacpp` column is rendered when a results file carries one.)

Run:   .venv/bin/python bench/engine_equality.py --engines vllm   # -> bench/results/engine_equality.json
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
    import torch
    from transformers import AutoTokenizer

    if real:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        lines = [line for line in DATA.read_bytes().decode("utf-8").split("\r\n") if len(line) > 200][:8]
        return [tokenizer(line[:300])["input_ids"] for line in lines]
    generator = torch.Generator().manual_seed(0)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    return [torch.randint(8, vocab, (int(length),), generator=generator).tolist() for length in (20, 27, 33, 39)]


def vllm_rows(folders: dict[str, tuple[Path, str]]) -> dict[str, dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from prunetool.serving.vllm_tokens import agreement, needs_remote_code, vllm_continuations

    rows = {}
    for real in (False, True):
        group = {name: folder for name, (folder, _) in folders.items() if name.startswith("smollm2") == real}
        prompts = prompts_for(next(iter(group.values())), real)
        answers = vllm_continuations(list(group.values()), prompts, max_tokens=16 if real else 12, strict=False)
        for name, folder in group.items():
            if isinstance(answers[folder], str):
                rows[name] = {"error": answers[folder]}
                continue
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                         trust_remote_code=needs_remote_code(folder)).eval()
            found = agreement(model, prompts, answers[folder], tie=TIE)
            rows[name] = {"sequences": len(prompts), "sequences_equal": found.sequences_equal,
                          "tokens": found.tokens, "worst_logprob_gap": found.worst_logprob_gap}
    return rows


def table(results: dict) -> str:
    rows = results["folders"]
    llama = any("llamacpp" in row for row in rows.values())
    lines = ["| folder | vLLM: greedy sequences equal | vLLM: max log-prob gap |"
             + (" llama.cpp: max log-prob gap | llama.cpp: perplexity, transformers |" if llama else ""),
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
            line += (f" {other['perplexity']:.4f}, {other['transformers_perplexity']:.4f} |" if "perplexity" in other
                     else " - |")
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="vllm", help="vllm (the only engine this script runs yet)")
    args = parser.parse_args()
    engines = args.engines.split(",")
    with tempfile.TemporaryDirectory(prefix="engine-equality-") as work:
        folders = build(Path(work))
        results = {name: {"what": what} for name, (_, what) in folders.items()}
        if "vllm" in engines:
            for name, row in vllm_rows(folders).items():
                results[name]["vllm"] = row
    write_results("engine_equality", {"tie": TIE, "folders": results})


if __name__ == "__main__":
    main()
