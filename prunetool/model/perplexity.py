"""Windowed perplexity: the quality signal of the perplexity-greedy criterion (SLEB, arXiv:2402.09025).

Perplexity is exp of the mean next-token negative log-likelihood over every predicted token of every
window (T-1 per window of T tokens; windows are independent, no KV cache carried between them).

Memory: a full forward returns logits of shape (B, T, V); with Gemma 3's 262k vocabulary that is 1 GiB
per 1024 tokens in float32, plus the same again for the softmax. For the families whose head is
known (lm_head, then Gemma 2's optional final soft-capping) we therefore run the decoder once per batch
and project the hidden states to the vocabulary a few hundred tokens at a time. Other families fall
back to the model's own forward, one batch at a time.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from prunetool.model.architecture import TESTED, decoder_of
from prunetool.errors import OptionError
from prunetool.model.loading import input_device

LOGITS_BUDGET_BYTES = 256 * 2**20  # float32 logits at once: 256 tokens of a 262k vocabulary


def _chunk_tokens(vocab_size: int) -> int:
    return max(1, LOGITS_BUDGET_BYTES // (4 * vocab_size))


def _head_nll_sum(model: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> float:
    """Sum of NLL of `targets` (N,) under the LM head applied to `hidden` (N, d), chunked over N.

    Mirrors the CausalLM forward: lm_head, then tanh soft-capping where the *top-level* config asks for
    it (Gemma 2 does; Gemma3ForConditionalGeneration's forward never caps, and its config has no field).
    The capping runs in the model dtype, as the model does, before the float32 upcast.
    """
    head = model.get_output_embeddings()
    cap = getattr(model.config, "final_logit_softcapping", None)
    step = _chunk_tokens(head.weight.shape[0])
    total = 0.0
    for start in range(0, hidden.shape[0], step):
        logits = head(hidden[start : start + step])  # (n, V)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        nll = F.cross_entropy(logits.float(), targets[start : start + step], reduction="sum")
        total += nll.double().item()
    return total


def _batch_nll_sum(model: nn.Module, batch: torch.Tensor) -> float:
    """Summed next-token NLL of one batch (B, T): predictions at 0..T-2 for targets 1..T-1."""
    targets = batch[:, 1:].reshape(-1)  # (B*(T-1),)
    if model.config.model_type in TESTED:
        hidden = decoder_of(model)(input_ids=batch, use_cache=False).last_hidden_state  # (B, T, d)
        return _head_nll_sum(model, hidden[:, :-1].reshape(-1, hidden.shape[-1]), targets)
    logits = model(input_ids=batch, use_cache=False).logits[:, :-1]  # (B, T-1, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets, reduction="sum").double().item()


def perplexity_from_mean(mean: float) -> float:
    """exp(mean NLL); inf where that overflows float64 or the mean is NaN."""
    return math.exp(mean) if mean < math.log(torch.finfo(torch.float64).max) else math.inf


def perplexity(model: nn.Module, windows: torch.Tensor, *, batch_size: int = 1) -> float:
    """exp(mean next-token NLL) over all windows (W, T), accumulated in float64, no KV cache.

    The mean is over every predicted token (W*(T-1)), not a mean of per-window perplexities, so the
    result does not depend on batch_size (up to float rounding of the batched kernels).
    """
    if windows.dim() != 2 or windows.shape[0] < 1 or windows.shape[1] < 2:
        raise OptionError(f"perplexity needs windows of shape (W>=1, T>=2), got {tuple(windows.shape)}")
    if batch_size < 1:
        raise OptionError(f"--batch-size must be at least 1, got {batch_size}")
    device = input_device(model)
    total = 0.0
    with torch.inference_mode():
        for start in range(0, windows.shape[0], batch_size):
            batch = windows[start : start + batch_size].to(device=device, dtype=torch.long)
            total += _batch_nll_sum(model, batch)
    return perplexity_from_mean(total / (windows.shape[0] * (windows.shape[1] - 1)))
