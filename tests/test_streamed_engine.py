"""The layer-streamed cut engine (prune --low-memory's search) equals the in-memory engine on every tiny
architecture, and a search run through it chooses what the in-memory search chooses."""

from __future__ import annotations

import pytest
import torch

from prunetool.select.cut_engine import CutEngine
from prunetool.model.loading import load_model
from prunetool.select.ranking import SelectionRequest
from prunetool.select.search import select_halving, select_ppl
from prunetool.sources import resolve_model
from prunetool.model.streaming import build_streamed
from tiny_models import ARCHITECTURES

CPU = torch.device("cpu")


def windows_for(tokenizer, count: int = 3, length: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, len(tokenizer), (count, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_streamed_engine_equals_the_in_memory_engine(arch, tiny_checkpoint, monkeypatch):
    import prunetool.model.perplexity as module

    monkeypatch.setattr(module, "LOGITS_BUDGET_BYTES", 4 * 3 * 23 * 40)  # several vocabulary blocks
    source = resolve_model(str(tiny_checkpoint(arch)))
    model, tokenizer = load_model(source, dtype="float32", device="cpu")
    windows = windows_for(tokenizer)
    memory = CutEngine(model, windows, batch_size=2)
    streamed = CutEngine(build_streamed(source, windows, dtype=torch.float32, device=CPU), windows, batch_size=2)
    for cut, extra in [((), ()), ((), (3,)), ((1,), (4,)), ((1, 2), ()), ((0,), (5,)), ((2,), (1,))]:
        memory.set_cut(cut)
        streamed.set_cut(cut)
        assert streamed.perplexity_without(extra) == pytest.approx(memory.perplexity_without(extra), rel=1e-5), (cut, extra)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_streamed_engine_in_bfloat16(arch, tiny_checkpoint):
    source = resolve_model(str(tiny_checkpoint(arch)))
    model, tokenizer = load_model(source, dtype="bfloat16", device="cpu")
    windows = windows_for(tokenizer, seed=1)
    memory = CutEngine(model, windows)
    streamed = CutEngine(build_streamed(source, windows, dtype=torch.bfloat16, device=CPU), windows)
    for extra in [(), (2,), (1, 4)]:
        assert streamed.perplexity_without(extra) == pytest.approx(memory.perplexity_without(extra), rel=5e-3)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "phi3"])
@pytest.mark.parametrize("select", [select_halving, select_ppl])
def test_a_streamed_search_chooses_what_the_in_memory_search_chooses(arch, select, tiny_checkpoint):
    source = resolve_model(str(tiny_checkpoint(arch, num_layers=8)))
    model, tokenizer = load_model(source, dtype="float32", device="cpu")
    windows = windows_for(tokenizer, count=4, length=32, seed=2)
    common = dict(num_layers=8, count=3, windows=windows, refine_windows=4, screen_tokens=16, shortlist=2)
    memory = select(SelectionRequest(model=model, **common))
    streamed = select(SelectionRequest(model=build_streamed(source, windows, dtype=torch.float32, device=CPU), **common))
    assert streamed.removed == memory.removed
    assert streamed.values == pytest.approx(memory.values, rel=1e-5)


def test_a_streamed_model_refuses_token_ids_it_was_not_built_for(tiny_checkpoint):
    source = resolve_model(str(tiny_checkpoint("llama")))
    windows = torch.tensor([[1, 2, 3, 4]])
    streamed = build_streamed(source, windows, dtype=torch.float32, device=CPU)
    with pytest.raises(ValueError, match="not built for"):
        streamed.remap(torch.tensor([[1, 2, 5, 4]]))
