"""llama.cpp's log-probabilities, tokens and perplexity for GGUF files, beside transformers' on the same tokens.

llama.cpp runs in subprocesses: its Python bindings (llamacpp_worker.py, all-token logits from one decode, as
llama-perplexity computes them) and its own tools (llama-perplexity, llama-tokenize), all from the build
`make engines` sets up. The KV cache is float32, so a comparison measures the GGUF, not the cache's rounding.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from prunetool.serving.engines import LlamaCpp

WORKER = Path(__file__).with_name("llamacpp_worker.py")


def llamacpp_logits(engine: LlamaCpp, ggufs: list[Path], sequences=(), texts=()) -> dict[str, np.ndarray]:
    """`logits_<m>_<i>`: GGUF m's logits at every position of sequence i; `tokens_<m>_<j>`: its tokens for text j
    (its own BOS rule, special tokens not parsed: what llama-perplexity feeds itself)."""
    with tempfile.TemporaryDirectory(prefix="llamacpp-") as work:
        request, out = Path(work) / "request.json", Path(work) / "out.npz"
        request.write_text(json.dumps({"models": [str(g) for g in ggufs], "sequences": [list(s) for s in sequences],
                                       "texts": list(texts)}))
        done = subprocess.run([sys.executable, str(WORKER), str(request), str(out)],
                              env={**os.environ, **engine.python_env()}, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"llama.cpp failed: {done.stderr.strip()[-2000:]}")
        with np.load(out) as data:
            return {key: data[key] for key in data.files}


def log_softmax(logits) -> np.ndarray:
    """float64 log-probabilities, so that the comparison itself adds no rounding."""
    return torch.log_softmax(torch.as_tensor(np.asarray(logits), dtype=torch.float64), dim=-1).numpy()


def max_logprob_gap(ours: list[np.ndarray], reference: list[np.ndarray]) -> float:
    """Largest |difference| over every position and vocabulary entry of every sequence."""
    return max(float(np.abs(a - b).max()) for a, b in zip(ours, reference))


def llama_perplexity(engine: LlamaCpp, gguf: Path, text: Path, n_ctx: int, chunks: int) -> float:
    """llama-perplexity's running estimate after `chunks` windows (float32 KV cache, one window per batch).

    llama.cpp's logger prints from a thread that the process does not wait for at exit (common/log.cpp
    leaks it on purpose), so the last lines, the final estimate among them, are sometimes lost. One more
    window is run, and the estimate printed after `chunks` windows (exp of the mean NLL so far, the same
    formula as the final one) is read while that window computes.
    """
    command = [str(engine.tool("llama-perplexity")), "-m", str(gguf), "-f", str(text), "-c", str(n_ctx), "-b",
               str(n_ctx), "--chunks", str(chunks + 1), "-t", "2", "-ctk", "f32", "-ctv", "f32", "-fa", "off"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    running = dict(re.findall(r"\[(\d+)\]([0-9.]+),", done.stdout + done.stderr))
    if done.returncode != 0 or str(chunks) not in running:
        raise RuntimeError(f"llama-perplexity failed on {gguf.name}: {(done.stdout + done.stderr)[-2000:]}")
    return float(running[str(chunks)])


def llama_tokenize(engine: LlamaCpp, gguf: Path, text: Path) -> list[int]:
    """llama-tokenize on the file's bytes: the model's BOS rule, special tokens not parsed (as llama-perplexity)."""
    done = subprocess.run([str(engine.tool("llama-tokenize")), "-m", str(gguf), "-f", str(text), "--ids",
                           "--no-parse-special", "--log-disable"], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"llama-tokenize failed on {gguf.name}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def window_perplexity(model, tokens: list[int], n_ctx: int, chunks: int, bos: int | None) -> float:
    """transformers on the windows llama-perplexity scores: consecutive n_ctx-token windows of the whole text's
    tokens, BOS over each window's first token when the tokenizer adds one, predictions for the second half."""
    first, total, count = n_ctx // 2, 0.0, 0
    for chunk in range(chunks):
        window = tokens[chunk * n_ctx:(chunk + 1) * n_ctx]
        if bos is not None:
            window = [bos] + window[1:]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([window])).logits[0].double(), dim=-1)
        targets = torch.tensor(window[first + 1:])
        total -= logprobs[first:n_ctx - 1].gather(1, targets[:, None]).sum().item()
        count += n_ctx - 1 - first
    return float(np.exp(total / count))


def perplexity_pair(engine: LlamaCpp, model, tokenizer, gguf: Path, text_path: Path, n_ctx: int,
                    chunks: int) -> tuple[float, float]:
    """(llama.cpp, transformers) perplexity on the same tokens; raises when the two tokenize the text apart."""
    tokens = tokenizer(text_path.read_bytes().decode("utf-8"))["input_ids"]
    if llama_tokenize(engine, gguf, text_path) != tokens:
        raise ValueError(f"llama.cpp tokenizes {text_path.name} differently from transformers")
    if len(tokens) < n_ctx * (chunks + 1):  # llama_perplexity runs one window more
        raise ValueError(f"{text_path.name} has {len(tokens)} tokens, fewer than {chunks + 1} windows of {n_ctx}")
    adds_bos = tokenizer.bos_token_id is not None and tokens[:1] == [tokenizer.bos_token_id]
    reference = window_perplexity(model, tokens, n_ctx, chunks, tokenizer.bos_token_id if adds_bos else None)
    return llama_perplexity(engine, gguf, text_path, n_ctx, chunks), reference
