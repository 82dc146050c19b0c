"""Greedy tokens and their log-probabilities from vLLM, for folders prunetool writes (vllm_worker.py in the
engine venv), and the same quantities from transformers, so the two can be compared token by token."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from prunetool.errors import OptionError
from prunetool.serving.engines import SETUP_HINT, vllm_python
from prunetool.serving.vllm_server import needs_remote_code

WORKER = Path(__file__).with_name("vllm_worker.py")


@dataclass(frozen=True)
class Continuation:
    """One prompt's greedy continuation: the chosen tokens, their log-probs, and the prompt tokens' log-probs."""

    tokens: list[int]
    logprobs: list[float]
    prompt_logprobs: list[float | None]


def vllm_continuations(folders: list[Path], prompts: list[list[int]], *, max_tokens: int, dtype: str = "float32",
                       max_model_len: int = 1024, threads: int | None = None,
                       strict: bool = True) -> dict[Path, list[Continuation] | str]:
    """Each folder's greedy continuations in vLLM (one vLLM start-up for all). A folder vLLM fails on raises, or
    with `strict=False` maps to vLLM's error message."""
    python = vllm_python()
    if python is None:
        raise OptionError(f"vLLM is not set up; {SETUP_HINT}")
    request = {"models": [{"path": str(folder), "trust_remote_code": needs_remote_code(folder)} for folder in folders],
               "dtype": dtype, "max_model_len": max_model_len, "prompts": prompts, "max_tokens": max_tokens}
    env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if threads is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
    done = subprocess.run([str(python), str(WORKER)], input=json.dumps(request), capture_output=True, text=True,
                          env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM worker exited with {done.returncode}:\n{done.stderr[-4000:]}")
    answers = {}
    for folder, model in zip(folders, json.loads(done.stdout)["models"]):
        if "error" in model and strict:
            raise RuntimeError(f"vLLM could not run {folder}: {model['error']}")
        answers[folder] = model["error"] if "error" in model else [Continuation(**output) for output in model["outputs"]]
    return answers


def transformers_logprobs(model, sequence: list[int]) -> torch.Tensor:
    """Log-softmax of the next-token logits at every position of `sequence` (float64), without a cache."""
    with torch.no_grad():
        logits = model(torch.tensor([sequence]), use_cache=False).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


@dataclass(frozen=True)
class Agreement:
    """How one folder's vLLM continuations compare with transformers replaying them."""

    worst_logprob_gap: float  # largest |vLLM - transformers| over chosen and prompt tokens
    not_greedy: list[tuple[int, int, int]]  # (step, vLLM's token, transformers' argmax) where vLLM's was no argmax
    tokens: int  # generated tokens compared
    sequences_equal: int  # continuations whose every token is transformers' argmax


def agreement(model, prompts: list[list[int]], continuations: list[Continuation], tie: float) -> Agreement:
    """Replay each continuation through transformers without a cache. A chosen token counts as greedy when its
    log-prob is within `tie` of transformers' best (two kernels may order a near-tie differently)."""
    worst, not_greedy, tokens, equal = 0.0, [], 0, 0
    for prompt, got in zip(prompts, continuations):
        reference = transformers_logprobs(model, prompt + got.tokens)
        misses = 0
        for step, (token, logprob) in enumerate(zip(got.tokens, got.logprobs)):
            row = reference[len(prompt) + step - 1]
            worst = max(worst, abs(logprob - row[token].item()))
            if row[token] < row.max() - tie:
                not_greedy.append((step, token, int(row.argmax())))
                misses += 1
        for position in range(1, len(prompt)):
            worst = max(worst, abs(got.prompt_logprobs[position] - reference[position - 1, prompt[position]].item()))
        tokens, equal = tokens + len(got.tokens), equal + (misses == 0)
    return Agreement(worst, not_greedy, tokens, equal)
