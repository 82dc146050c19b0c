"""Attention and MLP sublayer removal in memory, in the cut engine, and what it saves (efficiency)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from prunetool.cut import Cut
from prunetool.errors import OptionError, UnsupportedModelError
from prunetool.evaluation.efficiency import kv_bytes_per_token, measure_efficiency, parameter_count, relative_to
from prunetool.model.in_memory import prune_in_memory
from prunetool.model.perplexity import perplexity
from prunetool.model.runner import cut_perplexity
from prunetool.model.sublayers import sublayers_removed
from prunetool.select.cut_engine import CutEngine
from tiny_models import HEAD_DIM, KV_HEADS

LLAMA_FAMILY = ("llama", "mistral", "qwen2")


def load(tiny_checkpoint, arch, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint(arch), dtype=dtype).eval()


def hooked_perplexity(model, windows, removed, unit):
    """The independent reference: the unpruned model with those sublayers' outputs zeroed by forward hooks."""
    name = "self_attn" if unit == "attention" else "mlp"

    def zero(_module, _args, output):
        if isinstance(output, tuple):
            return (torch.zeros_like(output[0]),) + tuple(output[1:])
        return torch.zeros_like(output)

    handles = [getattr(model.model.layers[i], name).register_forward_hook(zero) for i in removed]
    try:
        return perplexity(model, windows)
    finally:
        for handle in handles:
            handle.remove()


def windows_for(model, count=3, length=16, seed=0):
    return torch.randint(0, model.config.vocab_size, (count, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("unit", ["attention", "mlp"])
@pytest.mark.parametrize("arch", LLAMA_FAMILY)
@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_skipped_sublayers_equal_zeroed_outputs(arch, unit, dtype, rtol, tiny_checkpoint):
    model = load(tiny_checkpoint, arch, dtype)
    windows = windows_for(model)
    removed = [1, 2, 4]
    want = hooked_perplexity(model, windows, removed, unit)
    assert cut_perplexity(model, windows, Cut.of(unit, removed, 6)) == pytest.approx(want, rel=rtol)
    assert cut_perplexity(model, windows) != pytest.approx(want, rel=1e-3)  # the cut changes the model
    assert cut_perplexity(model, windows) == pytest.approx(perplexity(model, windows), rel=1e-6)  # restored


@pytest.mark.parametrize("unit", ["attention", "mlp"])
@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_engine_measures_sublayer_cuts_like_full_forwards(arch, unit, tiny_checkpoint):
    model = load(tiny_checkpoint, arch)
    windows = windows_for(model, count=4)
    engine = CutEngine(model, windows, batch_size=2, unit=unit)
    for cut, extra in [((), (3,)), ((1,), (4,)), ((0, 2), ()), ((2,), (0, 5))]:
        engine.set_cut(cut)
        want = hooked_perplexity(model, windows, sorted(set(cut) | set(extra)), unit)
        assert engine.perplexity_without(extra) == pytest.approx(want, rel=1e-5)


def test_refusals(tiny_checkpoint):
    model = load(tiny_checkpoint, "llama")
    windows = windows_for(model)
    with pytest.raises(OptionError, match="all 6 attention sublayers"):
        cut_perplexity(model, windows, Cut.of("attention", range(6), 6))
    with pytest.raises(OptionError, match="0..5"):
        cut_perplexity(model, windows, Cut.of("mlp", [6], 6))
    with pytest.raises(OptionError, match="--unit"):
        CutEngine(model, windows, unit="head")
    gemma = load(tiny_checkpoint, "gemma2")
    with pytest.raises(UnsupportedModelError, match="sandwich norms"):
        cut_perplexity(gemma, windows_for(gemma), Cut.of("attention", [1], 6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_bytes_and_parameters(dtype, tiny_checkpoint):
    model = load(tiny_checkpoint, "llama", dtype)
    layers, size = len(model.model.layers), torch.empty((), dtype=dtype).element_size()
    assert kv_bytes_per_token(model) == 2 * layers * KV_HEADS * HEAD_DIM * size
    assert parameter_count(model) == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    with sublayers_removed(model, [0, 3], "attention"):
        assert kv_bytes_per_token(model) == 2 * (layers - 2) * KV_HEADS * HEAD_DIM * size
    with sublayers_removed(model, [0, 3], "mlp"):
        assert kv_bytes_per_token(model) == 2 * layers * KV_HEADS * HEAD_DIM * size
    prune_in_memory(model, [1, 2, 5])
    assert kv_bytes_per_token(model) == 2 * (layers - 3) * KV_HEADS * HEAD_DIM * size


def test_measure_efficiency_reports_every_column(tiny_checkpoint):
    base = load(tiny_checkpoint, "llama")
    measured = measure_efficiency(base, repeats=1)
    assert measured["prefill_tokens_per_second"] > 0 and measured["decode_tokens_per_second"] > 0
    assert measured["parameters"] == parameter_count(base) and measured["peak_memory_bytes"] > 0
    assert measured["setting"]["statistic"] == "median" and measured["setting"]["batch"] == 1
    pruned = load(tiny_checkpoint, "llama")
    prune_in_memory(pruned, [1, 2, 3])
    smaller = measure_efficiency(pruned, repeats=1)
    relative = relative_to(measured, smaller)
    assert relative["kv_cache_bytes_per_token"] == pytest.approx(0.5)
    assert relative["parameters"] < 1
