"""The layer-streamed perplexity (one decoder layer and a block of LM-head rows in memory) equals the
loaded model's perplexity with the same layers removed, on every tiny architecture."""

from __future__ import annotations

import pytest
import torch

from prunetool.cut import Cut
from prunetool.model.in_memory import layers_removed
from prunetool.model.loading import load_model
from prunetool.model.perplexity import perplexity
from prunetool.sources import resolve_model
from prunetool.model.streaming import streamed_perplexity
from tiny_models import ARCHITECTURES


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("removed", [(), (1, 2), (0, 5)])
def test_streamed_perplexity_equals_the_loaded_model(arch, removed, tiny_checkpoint, monkeypatch):
    import prunetool.model.perplexity as module

    monkeypatch.setattr(module, "LOGITS_BUDGET_BYTES", 4 * 3 * 31 * 40)  # several vocabulary blocks
    source = resolve_model(str(tiny_checkpoint(arch)))
    model, tokenizer = load_model(source, dtype="float32", device="cpu")
    generator = torch.Generator().manual_seed(0)
    windows = torch.randint(0, len(tokenizer), (3, 32), generator=generator)
    with layers_removed(model, removed):
        expected = perplexity(model, windows)
    got = streamed_perplexity(source, windows, cut=Cut.of("block", removed, 6), dtype=torch.float32,
                              device=torch.device("cpu"), batch_size=2)
    assert got == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen2"])
def test_streamed_perplexity_in_bfloat16(arch, tiny_checkpoint):
    source = resolve_model(str(tiny_checkpoint(arch)))
    model, tokenizer = load_model(source, dtype="bfloat16", device="cpu")
    windows = torch.randint(0, len(tokenizer), (2, 32), generator=torch.Generator().manual_seed(1))
    with layers_removed(model, (2,)):
        expected = perplexity(model, windows)
    got = streamed_perplexity(source, windows, cut=Cut.of("block", (2,), 6), dtype=torch.bfloat16,
                              device=torch.device("cpu"))
    assert got == pytest.approx(expected, rel=5e-3)  # the same bf16 kernels; only the head's sum order differs
