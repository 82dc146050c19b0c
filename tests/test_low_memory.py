"""`score --low-memory`: one decoder layer in memory at a time, scores equal to the loaded model's."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoTokenizer
from typer.testing import CliRunner

from prunetool.model.architecture import decoder_of
from prunetool.select.calibration import load_calibration
from prunetool.cli import app
from prunetool.model.loading import load_model
from prunetool.select.scoring import score_model
from prunetool.sources import resolve_model
from prunetool.sources.tokenizer import FileTokenizer
from prunetool.select.scoring import score_streamed
from prunetool.model.streaming import build_streamed
from tests.tiny_models import ARCHITECTURES

TEXT = ("A heron stood in the shallows while the tide turned; the ferry left at noon, late as always, and "
        "the harbour master wrote it down. Later the wind rose and the boats came in one by one. ") * 14
TOLERANCE = 1e-5  # the acceptance bound; in practice the two paths agree exactly
runner = CliRunner()


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "harbour.txt"
    path.write_text(TEXT)
    return path


def _flatten(scores) -> torch.Tensor:
    data = scores.to_json()
    values = [v for layer in data["layers"] for k, v in layer.items() if k != "index"]
    values += [v for rows in data["heads"].values() for row in rows for v in row]
    values += [v for row in data["angular_distance"] for v in row]
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_streamed_scores_equal_loaded_scores(arch, tiny_checkpoint, calib_file):
    source = resolve_model(str(tiny_checkpoint(arch)))
    model, tokenizer = load_model(source, dtype="float32", device="cpu")
    calibration = load_calibration(str(calib_file), tokenizer, seq_len=24, stride=16, samples=3)
    want = score_model(model, calibration, model_name=arch, batch_size=2)
    got = score_streamed(source, calibration, model_name=arch, dtype=torch.float32, device=torch.device("cpu"),
                         batch_size=2)
    assert got.num_layers == want.num_layers and got.calibration == want.calibration
    diff = (_flatten(got) - _flatten(want)).abs().max().item()
    assert diff <= TOLERANCE, f"{arch}: max |diff| {diff:.2e}"


def test_only_one_layer_is_materialised_at_a_time(tiny_checkpoint, calib_file):
    source = resolve_model(str(tiny_checkpoint("llama", num_layers=4)))
    _, tokenizer = load_model(source, dtype="float32", device="cpu")
    calibration = load_calibration(str(calib_file), tokenizer, seq_len=24, stride=16, samples=2)
    streamed = build_streamed(source, calibration.input_ids, dtype=torch.float32, device=torch.device("cpu"))
    layers = decoder_of(streamed.model).layers
    real_counts = []

    def count(*_):
        real_counts.append(sum(any(not p.is_meta for p in layer.parameters()) for layer in layers))

    # registered after the streamer's hooks: counted right after a layer loads, and right after it is released
    handles = [layer.register_forward_hook(count) for layer in layers]
    handles += [layer.register_forward_pre_hook(count) for layer in layers]
    try:
        with torch.inference_mode():
            decoder_of(streamed.model)(input_ids=streamed.remapped_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    assert real_counts and max(real_counts) <= 1, real_counts
    assert all(p.is_meta for layer in layers for p in layer.parameters())  # all released afterwards
    embed = decoder_of(streamed.model).get_input_embeddings()
    assert embed.weight.shape[0] == torch.unique(calibration.input_ids).numel()  # only the rows in use


def test_file_tokenizer_matches_auto_tokenizer(tiny_checkpoint, calib_file):
    folder = tiny_checkpoint("llama")
    auto, plain = AutoTokenizer.from_pretrained(folder), FileTokenizer(folder)
    assert plain(TEXT, add_special_tokens=False)["input_ids"] == auto(TEXT, add_special_tokens=False)["input_ids"]
    assert plain.eos_token_id == auto.eos_token_id
    plain.release()
    assert plain(TEXT, add_special_tokens=False)["input_ids"] == auto(TEXT, add_special_tokens=False)["input_ids"]
    with pytest.raises(NotImplementedError):
        plain("x")


def test_cli_low_memory_equals_default(tiny_checkpoint, calib_file, tmp_path):
    folder = str(tiny_checkpoint("gemma3_text"))
    common = ["score", folder, "--calib", str(calib_file), "--seq-len", "24", "--stride", "16", "--samples", "3",
              "--dtype", "float32", "--device", "cpu", "--json"]
    default = runner.invoke(app, common + ["-o", str(tmp_path / "a.json")])
    streamed = runner.invoke(app, common + ["--low-memory", "-o", str(tmp_path / "b.json")])
    assert default.exit_code == 0, default.output
    assert streamed.exit_code == 0, streamed.output
    a, b = json.loads((tmp_path / "a.json").read_text()), json.loads((tmp_path / "b.json").read_text())
    assert b["meta"]["low_memory"] is True
    for left, right in zip(a["layers"], b["layers"]):
        for key in left:
            assert abs(left[key] - right[key]) <= TOLERANCE, key


def test_low_memory_without_cached_self_text_says_what_to_do(tiny_checkpoint):
    result = runner.invoke(app, ["score", str(tiny_checkpoint("llama")), "--low-memory", "--samples", "2",
                                 "--seq-len", "16"])
    assert result.exit_code != 0
    assert "not generated yet" in result.output and "--calib" in result.output
    assert "Traceback" not in result.output


def test_tokenizer_is_freed_before_torch_is_imported(tiny_checkpoint, calib_file, tmp_path):
    """The point of the torch-free tokenizer: its tables and torch never share the process."""
    script = textwrap.dedent(f"""
        import sys
        from prunetool.sources.tokenizer import FileTokenizer
        original = FileTokenizer.release
        def release(self):
            assert "torch" not in sys.modules, "torch was imported before the tokenizer was freed"
            print("released-before-torch", file=sys.stderr)
            original(self)
        FileTokenizer.release = release
        from prunetool.cli import app
        app(["score", {str(tiny_checkpoint("qwen3"))!r}, "--calib", {str(calib_file)!r}, "--seq-len", "24",
             "--samples", "2", "--low-memory", "--json", "-o", {str(tmp_path / "s.json")!r}])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "released-before-torch" in done.stderr
    assert json.loads((tmp_path / "s.json").read_text())["meta"]["low_memory"] is True
