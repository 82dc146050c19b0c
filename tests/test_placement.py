"""accelerate placement (--device-map, --max-memory, --offload-dir): parsed and refused in one line, and a
model spread to disk on the CPU scores exactly like the plain load."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from prunetool.cli import app
from prunetool.errors import OptionError
from prunetool.model.placement import Placement, parse_max_memory, placement_from_options
from prunetool.output.runs import load_current_run
from test_heal import calib_file  # noqa: F401
from test_prune_cli import assert_refused

runner = CliRunner()


def test_max_memory_reads_gpu_numbers_and_named_devices():
    assert parse_max_memory("0=20GiB, 1=18GB,cpu=64GiB") == {0: "20GiB", 1: "18GB", "cpu": "64GiB"}
    assert parse_max_memory("cpu=123456") == {"cpu": 123456}
    assert placement_from_options("auto", "cpu=1GB", None) == Placement("auto", {"cpu": "1GB"}, None)
    assert placement_from_options(None, None, None) is None


@pytest.mark.parametrize("text, words", [
    ("20GiB", ["DEVICE=SIZE"]),
    ("0=lots", ["size 'lots'"]),
    ("gpu=2GB", ["'gpu' is not a device"]),
    ("cpu=-3GB", ["size"]),
    (" , ", ["nothing to read"]),
])
def test_unreadable_max_memory_is_refused(text, words):
    with pytest.raises(OptionError) as error:
        parse_max_memory(text)
    for word in words:
        assert word in str(error.value)


@pytest.mark.parametrize("options, words", [
    (["--max-memory", "cpu=1GB"], ["need --device-map"]),
    (["--device-map", "everywhere"], ["--device-map must be one of"]),
    (["--device-map", "auto", "--max-memory", "cpu=many"], ["--max-memory", "cannot read the size"]),
    (["--device-map", "auto", "--low-memory"], ["--low-memory", "choose one"]),
])
def test_bad_placement_options_are_one_line(options, words, tiny_checkpoint, calib_file):  # noqa: F811
    result = runner.invoke(app, ["score", str(tiny_checkpoint("llama")), "--calib", str(calib_file), "--seq-len", "32",
                                 "--samples", "2", *options])
    assert_refused(result, *words)


def score_json(args) -> dict:
    result = runner.invoke(app, ["score", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("arch, folder", [("llama", True), ("gemma3_text", True), ("qwen2", False)])
def test_disk_offload_on_the_cpu_gives_the_plain_scores(arch, folder, tiny_checkpoint, calib_file, tmp_path):  # noqa: F811
    """Without --offload-dir, transformers reads a safetensors checkpoint's offloaded weights from its own files."""
    common = [str(tiny_checkpoint(arch)), "--calib", str(calib_file), "--seq-len", "32", "--samples", "3",
              "--device", "cpu", "--dtype", "float32"]
    plain = score_json(common)
    offload = ["--offload-dir", str(tmp_path / "offload")] if folder else []
    size = sum(path.stat().st_size for path in tiny_checkpoint(arch).glob("*.safetensors"))
    for cap in (60_000, size // 2):  # all on disk; half in memory, half on disk
        spread = score_json(common + ["--device-map", "auto", "--max-memory", f"cpu={cap}", *offload])
        assert load_current_run()["options"]["device_map"] == "auto"
        assert_same_scores(plain, spread)


def assert_same_scores(plain: dict, spread: dict) -> None:
    assert len(plain["layers"]) == len(spread["layers"])
    for ours, theirs in zip(plain["layers"], spread["layers"]):
        for key, value in ours.items():
            if isinstance(value, float):
                assert theirs[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    for metric, rows in plain["heads"].items():
        torch.testing.assert_close(torch.tensor(spread["heads"][metric]), torch.tensor(rows), rtol=1e-5, atol=1e-7,
                                   equal_nan=True, msg=metric)
    torch.testing.assert_close(torch.tensor(spread["angular_distance"]), torch.tensor(plain["angular_distance"]),
                               rtol=1e-5, atol=1e-7, equal_nan=True)


def prune_json(args) -> dict:
    result = runner.invoke(app, ["prune", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_prune_on_a_spread_model_chooses_and_verifies_like_the_plain_load(tiny_checkpoint, calib_file, tmp_path):  # noqa: F811
    folder = tiny_checkpoint("qwen2")
    common = [str(folder), "--drop", "2", "--calib", str(calib_file), "--seq-len", "32", "--samples", "4",
              "--device", "cpu", "--dtype", "float32", "--force"]
    plain = prune_json(common + ["--output-dir", str(tmp_path / "plain")])
    size = sum(path.stat().st_size for path in folder.glob("*.safetensors"))
    spread = prune_json(common + ["--output-dir", str(tmp_path / "spread"), "--device-map", "sequential",
                                  "--max-memory", f"cpu={size // 2}"])
    assert spread["plan"]["removed"] == plain["plan"]["removed"]
    assert spread["perplexity"]["after"] == pytest.approx(plain["perplexity"]["after"], rel=1e-5)
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "spread" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()


def test_patch_is_refused_when_weights_sit_on_disk(tiny_checkpoint, calib_file, tmp_path):  # noqa: F811
    out = tmp_path / "patched"
    result = runner.invoke(app, ["prune", str(tiny_checkpoint("llama")), "--remove-layers", "2,3", "--patch",
                                 "--calib", str(calib_file), "--seq-len", "32", "--samples", "4", "--device", "cpu",
                                 "--device-map", "auto", "--max-memory", "cpu=60000", "--output-dir", str(out)])
    assert_refused(result, "--patch", "offloaded to disk", nothing_at=out)


def test_eval_on_a_spread_model_gives_the_plain_results(tiny_checkpoint, calib_file, tmp_path):  # noqa: F811
    folder = tiny_checkpoint("llama")
    common = ["eval", str(folder), "--tasks", "hop_name,heldout_ppl", "--limit", "3", "--calib", str(calib_file),
              "--seq-len", "32", "--samples", "2", "--device", "cpu", "--dtype", "float32", "--json"]
    size = sum(path.stat().st_size for path in folder.glob("*.safetensors"))
    reports = []
    for extra in ([], ["--device-map", "auto", "--max-memory", f"cpu={size // 2}"]):
        result = runner.invoke(app, common + extra)
        assert result.exit_code == 0, result.output
        reports.append(next(iter(json.loads(result.stdout)["models"].values())))
    plain, spread = reports
    assert spread["heldout_ppl"]["perplexity"] == pytest.approx(plain["heldout_ppl"]["perplexity"], rel=1e-5)
    assert spread["lm_eval"]["results"] == plain["lm_eval"]["results"]


def test_heads_on_a_spread_model_gives_the_plain_profiles(tiny_checkpoint, calib_file):  # noqa: F811
    folder = tiny_checkpoint("gemma3_text")
    common = ["heads", str(folder), "--calib", str(calib_file), "--seq-len", "32", "--samples", "2",
              "--device", "cpu", "--dtype", "float32", "--json"]
    size = sum(path.stat().st_size for path in folder.glob("*.safetensors"))
    reports = []
    for extra in ([], ["--device-map", "auto", "--max-memory", f"cpu={size // 2}"]):
        result = runner.invoke(app, common + extra)
        assert result.exit_code == 0, result.output
        reports.append(json.loads(result.stdout))
    plain, spread = reports
    assert [head["pattern"] for head in spread["heads"]] == [head["pattern"] for head in plain["heads"]]
    for ours, theirs in zip(plain["heads"], spread["heads"]):
        for key, value in ours.items():
            if isinstance(value, float):
                assert theirs[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_heal_on_a_spread_model_trains_like_the_plain_load(tiny_checkpoint, calib_file, tmp_path):  # noqa: F811
    """heal --device-map: teacher and student placed by accelerate (all on the CPU here) train to the same
    losses and write the same tensors as the plain load."""
    from test_heal import prune_tiny, tensors

    prune_tiny(tiny_checkpoint, "qwen2", calib_file, tmp_path / "pruned")
    folder = tiny_checkpoint("qwen2")
    size = sum(path.stat().st_size for path in folder.glob("*.safetensors"))
    reports = []
    for name, extra in (("plain", []), ("spread", ["--device-map", "auto", "--max-memory", f"cpu={4 * size}"])):
        result = runner.invoke(app, ["heal", "--tokens", "512", "--seq-len", "32", "--batch-size", "2", "--device", "cpu",
                                     "--output-dir", str(tmp_path / name), "--json", *extra])
        assert result.exit_code == 0, result.output
        reports.append(json.loads(result.stdout)["heal"])
    plain, spread = reports
    curve = [loss for _, loss in plain["loss_summary"]["curve"]]
    assert [loss for _, loss in spread["loss_summary"]["curve"]] == pytest.approx(curve, rel=1e-5)
    ours, theirs = tensors(tmp_path / "plain"), tensors(tmp_path / "spread")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.allclose(theirs[name], ours[name], rtol=1e-5, atol=1e-7), name


def test_heal_refuses_a_student_offloaded_to_disk(tiny_checkpoint, calib_file, tmp_path):  # noqa: F811
    from test_heal import prune_tiny

    prune_tiny(tiny_checkpoint, "llama", calib_file, tmp_path / "pruned")
    out = tmp_path / "healed"
    result = runner.invoke(app, ["heal", "--tokens", "64", "--seq-len", "32", "--device", "cpu", "--device-map", "auto",
                                 "--max-memory", "cpu=60000", "--offload-dir", str(tmp_path / "offload"),
                                 "--output-dir", str(out)])
    assert_refused(result, "heal", "offloaded to disk", nothing_at=out)
