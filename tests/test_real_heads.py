"""`prunetool heads` on the two real checkpoints (slow): the probe against transformers' own attention weights."""

import json

import pytest
import torch
from typer.testing import CliRunner

from prunetool.select.calibration import load_calibration
from prunetool.cli import app
from prunetool.heads.patterns import PATTERNS, attention_profiles, profile_rows
from prunetool.heads.probe import probe_heads
from prunetool.model.loading import load_model
from prunetool.sources import resolve_model

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("alias", ["smollm2-135m", "gemma3-270m"])
def test_real_probe_matches_output_attentions(alias, shared_data):
    model, tokenizer = load_model(resolve_model(alias), dtype="float32", device="cpu", attn_implementation="eager")
    calibration = load_calibration(str(shared_data / "wikitext2-test.raw"), tokenizer, seq_len=128, stride=128,
                                   samples=2)
    last = model.config.get_text_config().num_hidden_layers - 1
    layers = (0, last // 2, last)
    evidence = probe_heads(model, calibration.input_ids, layers)
    with torch.no_grad():
        attentions = model(input_ids=calibration.input_ids, output_attentions=True, use_cache=False).attentions
    for index in layers:
        column, offset = attention_profiles(attentions[index], profile_rows(128))
        assert torch.allclose(evidence.selected[index].offset / 2, offset.mean(0), atol=1e-5)
        assert torch.allclose(evidence.selected[index].column / 2, column.mean(0), atol=1e-5)
        assert evidence.selected[index].swaps.swaps > 0


def test_real_heads_command(shared_data, tmp_path):
    output = tmp_path / "report"
    result = CliRunner().invoke(app, ["heads", "gemma3-270m", "--calib", str(shared_data / "wikitext2-test.raw"),
                                      "--seq-len", "256", "--samples", "2", "--kv-budget", "64", "--output",
                                      str(output), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert len(data["heads"]) == 18 * 4 and {head["type"] for head in data["heads"]} <= set(PATTERNS)
    assert sum(data["kv_budget"]["budgets"]) == 64 * 18
    assert [layer["index"] for layer in data["layers"]] == list(range(18))
    assert (output / "report.html").is_file()
