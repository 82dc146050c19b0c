"""The command line as a user meets it: exit codes, one-line errors, JSON on stdout, the current run."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from prunetool.cli import app
from prunetool.errors import PrunetoolError
from prunetool.output.runs import load_current_run

runner = CliRunner()
PROSE = "A small boat left the harbour at dawn, and the keeper counted the gulls on the pier. " * 40


@pytest.fixture
def calib_file(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text(PROSE)
    return path


def score_args(model, calib, *extra):
    return ["score", str(model), "--calib", str(calib), "--seq-len", "16", "--samples", "3", *extra]


def assert_one_line_error(result, *words):
    assert result.exit_code != 0, result.output
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:"), lines[0]
    assert "Traceback" not in result.output
    for word in words:
        assert word.lower() in lines[0].lower(), lines[0]


def test_module_help_runs_as_subprocess():
    result = subprocess.run([sys.executable, "-m", "prunetool", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "score" in result.stdout and "models" in result.stdout


def test_score_json_and_output_file(tiny_checkpoint, calib_file, tmp_path):
    out = tmp_path / "s.json"
    result = runner.invoke(app, score_args(tiny_checkpoint("llama"), calib_file, "--json", "--output", str(out)))
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed == json.loads(out.read_text())
    assert printed["num_layers"] == 6 and len(printed["layers"]) == 6
    assert [layer["index"] for layer in printed["layers"]] == list(range(6))
    assert set(printed["calibration"]) == {"source", "spec", "sha256", "seq_len", "stride", "windows", "tokens"}
    assert printed["calibration"]["windows"] == 3 and printed["calibration"]["tokens"] == 48
    assert len(printed["angular_distance"]) == 7
    assert load_current_run()["scores"] == printed


def test_score_table_marks_default_prune(tiny_checkpoint, calib_file):
    result = runner.invoke(app, score_args(tiny_checkpoint("mistral"), calib_file, "--drop", "2"))
    assert result.exit_code == 0, result.output
    assert result.stdout.count("drop") >= 2 and "q-sim" in result.stdout
    assert "time:" in result.stderr


@pytest.mark.parametrize("option,value", [("--seq-len", "0"), ("--samples", "0"), ("--stride", "-1"),
                                          ("--batch-size", "0")])
def test_non_positive_options(option, value, tiny_checkpoint, calib_file):
    options = {"--seq-len": "16", "--samples": "3", option: value}
    args = ["score", str(tiny_checkpoint("llama")), "--calib", str(calib_file)]
    for name, setting in options.items():
        args += [name, setting]
    assert_one_line_error(runner.invoke(app, args), option)


def test_missing_model_path(tmp_path, calib_file):
    assert_one_line_error(runner.invoke(app, score_args(tmp_path / "nowhere", calib_file)), "not found")


def test_folder_without_config(tmp_path, calib_file):
    (tmp_path / "empty").mkdir()
    assert_one_line_error(runner.invoke(app, score_args(tmp_path / "empty", calib_file)), "config.json")


def test_config_not_json(tmp_path, tiny_checkpoint, calib_file):
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in tiny_checkpoint("llama").iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    (broken / "config.json").write_text("{not json")
    assert_one_line_error(runner.invoke(app, score_args(broken, calib_file)), "json")


def test_truncated_safetensors(tmp_path, tiny_checkpoint, calib_file):
    broken = tmp_path / "truncated"
    broken.mkdir()
    for item in tiny_checkpoint("llama").iterdir():
        data = item.read_bytes()
        (broken / item.name).write_bytes(data[: len(data) // 2] if item.suffix == ".safetensors" else data)
    assert_one_line_error(runner.invoke(app, score_args(broken, calib_file)), "safetensors")


def test_encoder_only_model(tmp_path, calib_file):
    from transformers import BertConfig, BertForMaskedLM

    BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                               vocab_size=60)).save_pretrained(tmp_path / "bert")
    assert_one_line_error(runner.invoke(app, score_args(tmp_path / "bert", calib_file)), "encoder")


@pytest.mark.parametrize("content,word", [(b"", "empty"), (b"\x00\x01\x02binary\xff", "utf-8"),
                                          (b"too short", "short")])
def test_bad_calibration(content, word, tmp_path, tiny_checkpoint):
    calib = tmp_path / "bad.txt"
    calib.write_bytes(content)
    assert_one_line_error(runner.invoke(app, score_args(tiny_checkpoint("llama"), calib)), word)


def test_missing_calibration_file(tmp_path, tiny_checkpoint):
    assert_one_line_error(runner.invoke(app, score_args(tiny_checkpoint("llama"), tmp_path / "none.txt")))


def test_debug_shows_the_exception(tmp_path, calib_file, monkeypatch):
    monkeypatch.setenv("PRUNETOOL_DEBUG", "1")
    result = runner.invoke(app, score_args(tmp_path / "nowhere", calib_file))
    assert isinstance(result.exception, PrunetoolError)
