"""Check a written checkpoint the way its users will meet it: reload it, count layers, decode with and
without the KV cache, and measure perplexity. Any mismatch is an error, never a warning."""

import math
from pathlib import Path

import torch

from prunetool.errors import VerificationError
from prunetool.loading import quiet_transformers
from prunetool.perplexity import perplexity

GENERATE_TOKENS = 16
PROMPT_TOKENS = 24
PERPLEXITY_RTOL = 1e-4  # reloaded vs in-memory prune: same weights, so only float summation order differs


def greedy(model, prompt: torch.Tensor, *, use_cache: bool) -> list[int]:
    """Greedy continuation; sampling settings from the checkpoint's generation config are overridden."""
    output = model.generate(prompt, max_new_tokens=GENERATE_TOKENS, do_sample=False, use_cache=use_cache,
                            temperature=None, top_p=None, top_k=None, attention_mask=torch.ones_like(prompt))
    return output[0, prompt.shape[1]:].tolist()


def verify_checkpoint(folder: Path, *, expected_layers: int, held_out: torch.Tensor | None,
                      expected_perplexity: float | None) -> dict:
    """Reload `folder` with transformers and run every check; returns what was measured."""
    from transformers import AutoModelForCausalLM

    try:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    except Exception as error:  # whatever the loader raises, the checkpoint is unusable
        raise VerificationError(f"the written checkpoint does not reload: {error}") from error
    layers = len(model.get_decoder().layers)
    configured = model.config.get_text_config(decoder=True).num_hidden_layers
    if layers != expected_layers or configured != expected_layers:
        raise VerificationError(f"the reloaded checkpoint has {layers} layers (config says {configured}), "
                                f"expected {expected_layers}")
    prompt = held_out[:1, :PROMPT_TOKENS] if held_out is not None else torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode(), quiet_transformers():
        cached, uncached = greedy(model, prompt, use_cache=True), greedy(model, prompt, use_cache=False)
    if cached != uncached:
        raise VerificationError(f"greedy decoding with the KV cache ({cached}) differs from decoding without "
                                f"it ({uncached}): stale layer indices or layer types in the written checkpoint")
    result = {"layers": layers, "cached_generation_matches": True, "generated_tokens": len(cached)}
    if held_out is not None:
        measured = perplexity(model, held_out)
        result["perplexity"] = measured
        if expected_perplexity is not None and not math.isclose(measured, expected_perplexity,
                                                                rel_tol=PERPLEXITY_RTOL):
            raise VerificationError(f"the reloaded checkpoint's perplexity {measured:.4f} differs from the "
                                    f"in-memory prune's {expected_perplexity:.4f}")
    return result
