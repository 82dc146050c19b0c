"""Serve a written prunetool folder with vLLM and compare it with transformers on the same prompts.

For a nemotron-nas (DeciLM) folder of an attention- or MLP-pruned model, vLLM builds its own built-in
`nemotron_nas` model (a no-op attention layer gets no KV cache); transformers runs the folder's shipped
modeling code through prunetool's loader. Per prompt: vLLM's greedy continuation with the log-probability of
each chosen token, then one transformers forward over prompt + continuation (teacher forcing), which gives
transformers' own argmax and log-probability at every generated position. Reported: how many positions
agree on the greedy token before the first disagreement (a bfloat16 near-tie may flip one late token), and
the largest |log p_vllm - log p_transformers| over the agreeing prefix.

Run on a GPU (bench/gpu_check.sh SUBLAYER=1 runs it):
    python bench/vllm_serve_check.py FOLDER [--dtype bfloat16] [--tokens 32]
Prints one JSON line; exits 1 when the first greedy token of any prompt differs or the log-probability gap
exceeds --max-gap (nats).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROMPTS = ("The capital of France is", "def fibonacci(n):", "In 1905, Albert Einstein published",
           "A recipe for bread needs flour, water,", "The three primary colours are")


def vllm_continuations(folder: Path, dtype: str, tokens: int) -> list[dict]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(folder), dtype=dtype, trust_remote_code=True, enforce_eager=True, max_model_len=512,
              gpu_memory_utilization=0.5, seed=0)
    outputs = llm.generate(list(PROMPTS), SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=1))
    found = []
    for output in outputs:
        completion = output.outputs[0]
        found.append({"prompt_ids": list(output.prompt_token_ids), "ids": list(completion.token_ids),
                      "logprobs": [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]})
    del llm
    return found


def transformers_scores(folder: Path, dtype: str, runs: list[dict]) -> list[dict]:
    import torch

    from prunetool.model.loading import load_model
    from prunetool.sources import resolve_model

    model, _ = load_model(resolve_model(str(folder)), dtype=dtype, device="cuda")
    rows = []
    for run in runs:
        ids = torch.tensor([run["prompt_ids"] + run["ids"]], device=model.device)
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
        start = len(run["prompt_ids"]) - 1  # the logits at position p predict token p + 1
        logprobs = torch.log_softmax(logits[start:start + len(run["ids"])], dim=-1)
        chosen = torch.tensor(run["ids"], device=logprobs.device)
        argmax = logprobs.argmax(-1).tolist()
        agree = next((i for i, (a, b) in enumerate(zip(argmax, run["ids"])) if a != b), len(run["ids"]))
        ours = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
        gaps = [abs(a - b) for a, b in zip(ours[:agree], run["logprobs"][:agree])]
        rows.append({"agreeing_tokens": agree, "tokens": len(run["ids"]), "max_logprob_gap": max(gaps, default=0.0)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--max-gap", type=float, default=0.25)
    args = parser.parse_args()
    config = json.loads((args.folder / "config.json").read_text())
    runs = vllm_continuations(args.folder, args.dtype, args.tokens)
    rows = transformers_scores(args.folder, args.dtype, runs)
    skipped = sum(bool(block.get("attention", {}).get("no_op")) for block in config.get("block_configs", []))
    result = {"model_type": config.get("model_type"), "attention_no_op_layers": skipped, "prompts": len(rows),
              "first_token_agrees": all(row["agreeing_tokens"] > 0 for row in rows),
              "mean_agreeing_fraction": sum(row["agreeing_tokens"] / row["tokens"] for row in rows) / len(rows),
              "max_logprob_gap": max(row["max_logprob_gap"] for row in rows), "rows": rows}
    print(json.dumps(result))
    if not result["first_token_agrees"] or result["max_logprob_gap"] > args.max_gap:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
