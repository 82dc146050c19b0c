"""Check a written checkpoint the way its users will meet it: reload it, count layers, decode with and
without the KV cache, and measure perplexity. Any mismatch is an error, never a warning.

The reload runs in the dtype and on the device the in-memory prune ran in, so the perplexity check
compares like with like: the same weights through the same kernels, where only summation order may
differ. Its tolerance therefore depends on the dtype (PERPLEXITY_RTOL) and is recorded in prune.json.
"""

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from prunetool.sources.checks import ships_our_code
from prunetool.model.architecture import cache_argument, decoder_of
from prunetool.errors import VerificationError
from prunetool.model.loading import quiet_transformers
from prunetool.model.perplexity import perplexity

GENERATE_TOKENS = 16
PROMPT_TOKENS = 24
# Relative tolerance of the reloaded model's perplexity against the in-memory prune's, per dtype. Both run the
# same weights through the same kernels, and on the CPU they agree exactly in every dtype (tests); the margin
# is for summation order on accelerators (about one half-precision ulp on a mean over thousands of tokens),
# and stays well below what a wrong checkpoint costs (flipped layer types on tiny Gemma 3: 2.2%).
PERPLEXITY_RTOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 5e-3}
CACHE_LOGPROB_ATOL = 2.0


@dataclass(frozen=True)
class VerifySetting:
    """Where and how the check runs: the same dtype and device as the in-memory measurement."""

    dtype: torch.dtype
    device: torch.device

    @property
    def rtol(self) -> float:
        return PERPLEXITY_RTOL.get(self.dtype, PERPLEXITY_RTOL[torch.bfloat16])

    def describe(self) -> dict:
        described = {"dtype": str(self.dtype).removeprefix("torch."), "device": str(self.device),
                     "perplexity_rtol": self.rtol}
        if self.dtype != torch.float32:
            described["cache_logprob_atol"] = CACHE_LOGPROB_ATOL
        return described


def greedy(model, prompt: torch.Tensor, *, use_cache: bool) -> list[int]:
    """Greedy continuation; sampling settings from the checkpoint's generation config are overridden."""
    output = model.generate(prompt, max_new_tokens=GENERATE_TOKENS, do_sample=False, use_cache=use_cache,
                            temperature=None, top_p=None, top_k=None, attention_mask=torch.ones_like(prompt))
    return output[0, prompt.shape[1]:].tolist()



def cached_logprob_gap(model, prompt: torch.Tensor, continuation: list[int], setting: "VerifySetting") -> float:
    """Half precision: feed one sequence token by token through the KV cache and all at once without it.

    Greedy continuations may part ways at a near tie in half precision, so they are not compared; the
    log-probabilities along one fixed sequence are. A stale layer index or layer type moves them by
    whole units, rounding by far less than CACHE_LOGPROB_ATOL.
    """
    sequence = torch.cat([prompt, torch.tensor([continuation], device=prompt.device)], dim=1)
    whole = torch.log_softmax(model(sequence, use_cache=False).logits[0, prompt.shape[1] - 1:-1].float(), -1)
    output = model(prompt, use_cache=True)
    steps = [output.logits[0, -1]]
    for token in continuation[:-1]:
        output = model(torch.tensor([[token]], device=prompt.device), use_cache=True,
                       **{cache_argument(model): output.past_key_values})
        steps.append(output.logits[0, -1])
    stepped = torch.log_softmax(torch.stack(steps).float(), -1)
    gap = float((stepped - whole).abs().max())
    if not gap <= CACHE_LOGPROB_ATOL:
        raise VerificationError(f"decoding with the KV cache gives log-probabilities up to {gap:.3f} away from "
                                "decoding without it: stale layer indices or layer types in the written checkpoint")
    return gap


def verify_checkpoint(folder: Path, *, expected_layers: int, held_out: torch.Tensor | None,
                      expected_perplexity: float | None, setting: VerifySetting, shipped_code: bool = False) -> dict:
    """Reload `folder` with transformers in `setting`'s dtype and device and run every check.

    `shipped_code`: the folder carries our own modeling code (a nemotron-nas folder), which the reload runs."""
    from transformers import AutoModelForCausalLM

    try:
        with quiet_transformers():
            trusted = shipped_code or ships_our_code(folder)  # a nemotron-nas folder healed keeps our code
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=setting.dtype, trust_remote_code=trusted)
            model = model.eval().to(setting.device)
    except Exception as error:  # whatever the loader raises, the checkpoint is unusable
        raise VerificationError(f"the written checkpoint does not reload: {error}") from error
    layers = check_layer_count(model, expected_layers, "the reloaded checkpoint")
    prompt = held_out[:1, :PROMPT_TOKENS] if held_out is not None else torch.tensor([[1, 2, 3, 4]])
    prompt = prompt.to(setting.device)
    with torch.inference_mode(), quiet_transformers():
        uncached = greedy(model, prompt, use_cache=False)
        if setting.dtype == torch.float32:
            cached = greedy(model, prompt, use_cache=True)
            if cached != uncached:
                raise VerificationError(f"greedy decoding with the KV cache ({cached}) differs from decoding without "
                                        f"it ({uncached}): stale layer indices or layer types in the written checkpoint")
            cache_check = {"cached_generation_matches": True}
        else:
            cache_check = {"cached_logprob_gap": cached_logprob_gap(model, prompt, uncached, setting)}
    result = {"layers": layers, **cache_check, "generated_tokens": len(uncached), **setting.describe()}
    if held_out is not None:
        result["perplexity"] = check_perplexity(perplexity(model, held_out), expected_perplexity, setting,
                                                "the reloaded checkpoint's")
    return result


def check_layer_count(model, expected: int, what: str) -> int:
    """The decoder's layer count, if both it and the config say `expected`, else a VerificationError."""
    layers = len(decoder_of(model).layers)
    configured = model.config.get_text_config(decoder=True).num_hidden_layers
    if layers != expected or configured != expected:
        raise VerificationError(f"{what} has {layers} layers (config says {configured}), expected {expected}")
    return layers


def check_perplexity(measured: float, expected: float | None, setting: VerifySetting, what: str) -> float:
    """`measured` if it equals the in-memory prune's `expected` within the setting's tolerance, else a VerificationError."""
    if expected is not None and not math.isclose(measured, expected, rel_tol=setting.rtol):
        described = setting.describe()
        raise VerificationError(f"{what} perplexity {measured:.4f} differs from the in-memory prune's {expected:.4f} "
                                f"by more than {setting.rtol:g} (relative, {described['dtype']} on {described['device']})")
    return measured


def verify_streamed(folder: Path, *, expected_layers: int, held_out: torch.Tensor | None,
                    expected_perplexity: float | None, setting: VerifySetting) -> dict:
    """verify_checkpoint for a checkpoint that is not loaded whole (prune --low-memory): the config and the
    tensors must describe `expected_layers` layers, and the held-out perplexity, read one layer at a time,
    must equal the in-memory prune's. The decode-with-and-without-cache check needs the whole model and is
    not run (the result says so)."""
    from types import SimpleNamespace

    from prunetool.model.streaming import build_streamed

    probe = held_out if held_out is not None else torch.tensor([[1, 2, 3, 4]])
    try:
        streamed = build_streamed(SimpleNamespace(path=Path(folder)), probe, dtype=setting.dtype, device=setting.device)
    except Exception as error:  # whatever the loader raises, the checkpoint is unusable
        raise VerificationError(f"the written checkpoint does not load layer by layer: {error}") from error
    layers = check_layer_count(streamed.model, expected_layers, "the written checkpoint")
    result = {"layers": layers, "low_memory": True,
              "not_checked": "decoding with and without the KV cache (needs the whole model in memory)",
              **setting.describe()}
    if held_out is not None:
        result["perplexity"] = check_perplexity(streamed.perplexity(held_out), expected_perplexity, setting,
                                                "the written checkpoint's (read layer by layer)")
    return result
