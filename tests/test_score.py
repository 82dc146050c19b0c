"""Whole-model scores against the independent slow reference, on every tiny architecture."""

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from prunetool.model.architecture import inspect_decoder
from prunetool.select.calibration import load_calibration
from prunetool.errors import UnsupportedModelError
from prunetool.model.loading import load_model
from prunetool.select.scoring import SUBLAYER_METRICS, score_model
from prunetool.sources import resolve_model
from tests.reference import reference_scores
from tests.tiny_models import ARCHITECTURES

TEXT = (
    "The lighthouse keeper wrote the weather into a ledger every evening, then climbed the stairs to trim "
    "the wick. Ships passed in the fog; some signalled, most did not. In spring the gulls returned and the "
    "ledger filled with notes about nests, tides and the price of lamp oil in the village below. "
) * 12
TOLERANCE = 1e-5  # float32 model, float64 reductions on both sides


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "story.txt"
    path.write_text(TEXT)
    return path


def _load(checkpoint):
    return load_model(resolve_model(str(checkpoint)), dtype="float32", device="cpu")


def _assert_close(got, want, what):
    got, want = torch.tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    assert got.shape == want.shape, what
    assert torch.allclose(got, want, atol=TOLERANCE, rtol=0), f"{what}: max diff {(got - want).abs().max():.2e}"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_scores_match_slow_reference(arch, tiny_checkpoint, calib_file):
    model, tokenizer = _load(tiny_checkpoint(arch))
    calibration = load_calibration(str(calib_file), tokenizer, seq_len=24, stride=16, samples=3)
    scores = score_model(model, calibration, model_name=arch, batch_size=2)
    reference = reference_scores(model, calibration.input_ids)
    for metric in ("q_similarity", "q_similarity_post_rope", "q_similarity_lag1", "block_influence"):
        _assert_close(scores.column(metric), reference[metric], f"{arch} {metric}")
    _assert_close(scores.heads["q_similarity"], reference["heads_q_similarity"], f"{arch} per-head q_similarity")
    _assert_close(scores.angular_distance, reference["angular_distance"], f"{arch} angular distance")
    sandwich = arch.startswith("gemma")  # no stream between the sublayers that one residual branch crosses
    for metric in SUBLAYER_METRICS:
        if sandwich:
            assert all(metric not in layer for layer in scores.layers), metric
        else:
            _assert_close(scores.column(metric), reference[metric], f"{arch} {metric}")
    layout = inspect_decoder(model)
    assert scores.num_layers == layout.num_layers and len(scores.heads["q_similarity"][0]) == layout.num_heads
    assert scores.calibration == calibration.describe()


def test_batch_size_does_not_change_scores(tiny_checkpoint, calib_file):
    model, tokenizer = _load(tiny_checkpoint("qwen3"))
    calibration = load_calibration(str(calib_file), tokenizer, seq_len=20, samples=4)
    one = score_model(model, calibration, model_name="q", batch_size=1)
    four = score_model(model, calibration, model_name="q", batch_size=4)
    for metric in ("q_similarity", "q_similarity_post_rope", "block_influence"):
        _assert_close(one.column(metric), four.column(metric), metric)


def test_hooks_leave_no_trace(tiny_checkpoint, calib_file):
    model, tokenizer = _load(tiny_checkpoint("gemma3_text"))
    ids = tokenizer(TEXT[:200], return_tensors="pt").input_ids
    with torch.inference_mode():
        before = model(ids).logits
    calibration = load_calibration(str(calib_file), tokenizer, seq_len=16, samples=2)
    score_model(model, calibration, model_name="g", batch_size=1)
    with torch.inference_mode():
        after = model(ids).logits
    assert torch.equal(before, after)
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())
    assert "wrapper" not in getattr(ALL_ATTENTION_FUNCTIONS.get(model.config._attn_implementation), "__name__", "")


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=50, n_positions=64))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        inspect_decoder(model)


def test_hooks_keep_only_reduced_tensors(tiny_checkpoint, calib_file):
    """Every kept tensor owns just its own bytes: a view of a hidden state would keep all of it alive."""
    from prunetool.model.capture import capture_scores

    model, tokenizer = _load(tiny_checkpoint("llama"))
    calibration = load_calibration(str(calib_file), tokenizer, seq_len=24, samples=2)
    with capture_scores(inspect_decoder(model)) as taps, torch.inference_mode():
        model.get_decoder()(input_ids=calibration.input_ids, use_cache=False)
    for layer in taps:
        for name in ("q_pre", "q_post", "q_lag1", "block_influence", "last_input", "last_output"):
            for kept in getattr(layer, name):
                assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size(), name
