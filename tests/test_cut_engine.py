"""The cut engine's perplexities equal a plain full forward of the same cut, on every tiny architecture."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from prunetool.model import runner
from prunetool.select.cut_engine import CutEngine, EngineUnsupported, screening_model
from prunetool.model.runner import native_bfloat16
from prunetool.model.in_memory import layers_removed
from prunetool.model.perplexity import perplexity

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"]


def plain(model, windows, removed, batch_size):
    with layers_removed(model, sorted(removed)):
        return perplexity(model, windows, batch_size=batch_size)


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_equals_a_full_forward_of_the_same_cut(arch, dtype, rtol, tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(arch), dtype=dtype).eval()
    windows = torch.randint(model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    engine = CutEngine(model, windows, batch_size=2)
    for extra in ([0], [2], [5], [1, 2], [3, 5]):
        assert engine.perplexity_without(extra) == pytest.approx(plain(model, windows, extra, 2), rel=rtol), extra
    engine.remove([2])
    engine.remove([4])
    for extra in ([], [0], [3], [5]):
        expected = plain(model, windows, {2, 4, *extra}, 2)
        assert engine.perplexity_without(extra) == pytest.approx(expected, rel=rtol), extra
    engine.set_cut([1, 5])  # any set: back before the old cut, then on
    for extra in ([], [2], [0, 3]):
        expected = plain(model, windows, {1, 5, *extra}, 2)
        assert engine.perplexity_without(extra) == pytest.approx(expected, rel=rtol), extra
    engine.set_cut([2, 4])
    # a subset of batches: the perplexity of those windows alone
    assert engine.perplexity_without([1], batches=[1]) == pytest.approx(plain(model, windows[2:], {1, 2, 4}, 2),
                                                                          rel=rtol)


def test_engine_runs_only_the_layers_after_the_candidate(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), dtype=torch.float32).eval()
    engine = CutEngine(model, torch.randint(100, (2, 8)), self_check=False)
    assert engine.layer_forwards([5]) == 0 and engine.layer_forwards([0]) == 5
    engine.remove([3])
    assert engine.layer_forwards([1]) == 3 and engine.layer_forwards([3]) == 0
    assert math.isinf(engine.perplexity_without([0, 1, 2, 4, 5]))


def test_engine_refuses_a_model_whose_forward_its_replay_does_not_reproduce(tiny_checkpoint):
    """The self-check replays a window through every layer: a decoder doing more than its layers, norm and
    head (here a hook scaling its output) is refused, so searches fall back to full forwards."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen3"), dtype=torch.float32).eval()
    windows = torch.randint(model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    CutEngine(model, windows)  # the plain model passes
    handle = model.model.register_forward_hook(
        lambda module, args, output: output.__setitem__("last_hidden_state", output.last_hidden_state * 1.01))
    try:
        with pytest.raises(EngineUnsupported, match="differs from the model's"):
            CutEngine(model, windows)
    finally:
        handle.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_giving_up_is_exact_below_the_limit_and_a_lower_bound_above_it(dtype, tiny_checkpoint):
    """give_up_above: at or below the limit the value is the exact perplexity; above it, a value above the
    limit and never above the exact one, reached with fewer windows run."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), dtype=dtype).eval()
    windows = torch.randint(model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(2))
    engine = CutEngine(model, windows)
    exact = engine.perplexity_without([1])
    assert engine.perplexity_without([1], give_up_above=exact) == exact
    assert engine.perplexity_without([1], give_up_above=math.inf) == exact and engine.batches_skipped == 0
    limit = exact ** 0.3  # two of the four windows already carry more than 0.3 of the NLL: it gives up there
    bound = engine.perplexity_without([1], give_up_above=limit)
    assert limit < bound < exact and engine.batches_skipped > 0


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_the_screening_copy_is_the_model_rounded_to_bfloat16_and_leaves_the_model_alone(arch, tiny_checkpoint,
                                                                                     monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(arch), dtype=torch.float32).eval()
    model.get_output_embeddings().weight = model.get_input_embeddings().weight  # tied, as SmolLM2's are
    before = {name: (p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()}
    low = screening_model(model)
    if not native_bfloat16(torch.device("cpu")):  # emulated bfloat16 is slower than float32: no copy
        assert low is model
        return
    assert low is not model and low.dtype == torch.bfloat16
    for name, p in low.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, before[name][1].to(torch.bfloat16)), name
    assert low.get_output_embeddings().weight is low.get_input_embeddings().weight  # tied stays tied
    for (name, buffer), (_, original) in zip(low.named_buffers(), model.named_buffers()):
        assert buffer.dtype == original.dtype and torch.equal(buffer, original), name  # RoPE stays float32
    for name, p in model.named_parameters():  # the model itself is untouched
        assert p.dtype == torch.float32 and (p.data_ptr(), True) == (before[name][0], torch.equal(p, before[name][1]))
    # the copy is an ordinary model: the engine replays it exactly
    windows = torch.randint(model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    assert CutEngine(low, windows).perplexity_without([2]) == pytest.approx(plain(low, windows, [2], 1), rel=1e-5)


def test_no_screening_copy_for_16_bit_models_or_without_room(tiny_checkpoint, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen2"), dtype=torch.float32).eval()
    monkeypatch.setattr(runner, "native_bfloat16", lambda device: True)
    assert screening_model(model) is not model
    monkeypatch.setattr("prunetool.memory.memory_available_bytes",
                        lambda: int(runner.SCREEN_COPY_ROOM * sum(p.numel() for p in model.parameters()) * 2) - 1)
    assert screening_model(model) is model
    half = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen2"), dtype=torch.bfloat16).eval()
    assert screening_model(half) is half
    monkeypatch.undo()
    monkeypatch.setattr(runner, "native_bfloat16", lambda device: False)  # emulated bfloat16: no gain
    assert screening_model(model) is model


@pytest.mark.slow
@pytest.mark.parametrize("alias,cut", [("smollm2-135m", (13, 14, 21)), ("gemma3-270m", (8, 9, 14))])
def test_engine_equals_full_forwards_on_the_real_models(alias, cut, shared_data):
    """Real text (WikiText-2 windows), both demo models, float32: engine = plain forward of the same cut."""
    from prunetool.select.calibration import load_calibration
    from prunetool.model.loading import load_model
    from prunetool.sources import resolve_model

    model, tokenizer = load_model(resolve_model(alias), dtype="float32", device="cpu")
    windows = load_calibration(str(shared_data / "wikitext2-test.raw"), tokenizer, seq_len=128, samples=2).input_ids
    engine = CutEngine(model, windows)
    for extra in ([cut[0]], [cut[2]], list(cut[:2])):
        assert engine.perplexity_without(extra) == pytest.approx(plain(model, windows, extra, 1), rel=1e-5), extra
    engine.remove([cut[0]])
    assert engine.perplexity_without([cut[1]]) == pytest.approx(plain(model, windows, cut[:2], 1), rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_engine_measures_mixed_cuts_as_a_full_forward_does(arch, dtype, tiny_checkpoint):
    """Blocks, attention and MLP removals in one cut, from any current cut: the replay equals a full forward
    of the model with the same removals made in memory (sublayers skipped, blocks taken out)."""
    from prunetool.cut import Cut
    from prunetool.model.runner import cut_perplexity

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(arch), dtype=dtype).eval()
    windows = torch.randint(model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(2))
    engine = CutEngine(model, windows, batch_size=2)
    cuts = [Cut(6, attention=(2,), mlp=(4,)), Cut(6, attention=(1, 3), mlp=(3, 5)), Cut(6, mlp=(0, 1, 2, 3, 4, 5)),
            Cut(6, attention=(1, 2, 3, 4, 5), mlp=(2,))]
    for current in (Cut(6), Cut(6, attention=(3,), mlp=(3,)), Cut(6, mlp=(1,))):
        engine.set_cut(current)
        for cut in cuts:
            expected = cut_perplexity(model, windows, cut, batch_size=2)
            assert engine.perplexity_of(cut) == pytest.approx(expected, rel=1e-5), (current, cut)
    assert engine.perplexity_of(Cut(6)) == pytest.approx(cut_perplexity(model, windows, batch_size=2), rel=1e-5)
