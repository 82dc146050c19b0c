"""`prune --low-memory`: the search, the held-out perplexity and the verification read one decoder layer at a
time, and the run chooses the same layers and writes the same bytes as the in-memory prune."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from prunetool.cli import app
from prunetool.memory import memory_available_bytes
from prunetool.output.runs import load_current_run
from test_heal import calib_file  # noqa: F401
from test_prune_cli import assert_refused
from tiny_models import ARCHITECTURES

runner = CliRunner()


def prune_json(arguments: list[str]) -> dict:
    result = runner.invoke(app, ["prune", *arguments, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("criterion", ["halving", "guided"])
def test_low_memory_prune_chooses_and_writes_what_the_in_memory_prune_does(arch, criterion, tiny_checkpoint,
                                                                           calib_file, tmp_path):  # noqa: F811
    folder = tiny_checkpoint(arch)
    common = [str(folder), "--drop", "2", "--criterion", criterion, "--calib", str(calib_file), "--seq-len", "32",
              "--samples", "4", "--device", "cpu", "--dtype", "float32", "--force"]
    memory = prune_json(common + ["--output-dir", str(tmp_path / "memory")])
    streamed = prune_json(common + ["--output-dir", str(tmp_path / "streamed"), "--low-memory"])
    assert streamed["low_memory"] and not memory["low_memory"]
    assert streamed["plan"]["removed"] == memory["plan"]["removed"]
    assert streamed["plan"]["criterion_values"] == pytest.approx(memory["plan"]["criterion_values"], rel=1e-5)
    for key in ("before", "after"):
        assert streamed["perplexity"][key] == pytest.approx(memory["perplexity"][key], rel=1e-5)
    assert streamed["verification"]["low_memory"] and streamed["verification"]["layers"] == 4
    written = sorted(path.name for path in (tmp_path / "memory").iterdir())
    assert written == sorted(path.name for path in (tmp_path / "streamed").iterdir())
    for name in written:
        if name.endswith(".safetensors") or name == "config.json":
            assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "memory" / name).read_bytes(), name


def test_low_memory_prune_in_bfloat16_verifies(tiny_checkpoint, calib_file, tmp_path):  # noqa: F811
    out = tmp_path / "bf16"
    result = prune_json([str(tiny_checkpoint("gemma3_text")), "--drop", "2", "--calib", str(calib_file), "--seq-len",
                         "32", "--samples", "4", "--device", "cpu", "--dtype", "bfloat16", "--low-memory",
                         "--output-dir", str(out)])
    assert result["verification"]["dtype"] == "bfloat16" and result["verification"]["low_memory"]
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 4


@pytest.mark.parametrize("extra, words", [
    (["--device-map", "auto"], ["--low-memory", "--device-map"]),
])
def test_low_memory_refusals_are_one_line(extra, words, tiny_checkpoint, calib_file, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    result = runner.invoke(app, ["prune", str(tiny_checkpoint("llama")), "--remove-layers", "2,3", "--calib",
                                 str(calib_file), "--seq-len", "32", "--samples", "4", "--device", "cpu",
                                 "--low-memory", "--output-dir", str(out), *extra])
    assert_refused(result, *words, nothing_at=out)


def test_memory_available_follows_a_data_rlimit():
    """Under RLIMIT_DATA the room left is the limit minus what the process already holds."""
    code = ("import resource; from prunetool.memory import memory_available_bytes as m; "
            "resource.setrlimit(resource.RLIMIT_DATA, (2**30, resource.getrlimit(resource.RLIMIT_DATA)[1])); "
            "print(m())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    assert 0 < int(out) < 2**30
    assert memory_available_bytes() is None or memory_available_bytes() > 0


@pytest.mark.parametrize("command", ["prune", "score", "heads"])
def test_commands_stream_by_themselves_when_the_checkpoint_does_not_fit(command, tiny_checkpoint, calib_file, tmp_path,
                                                                        monkeypatch):  # noqa: F811
    import prunetool.memory

    monkeypatch.setattr(prunetool.memory, "memory_available_bytes", lambda: 1000)
    extra = {"prune": ["--drop", "2", "--samples", "4", "--output-dir", str(tmp_path / "auto")],
             "score": ["--samples", "4"], "heads": ["--samples", "2"]}[command]
    result = runner.invoke(app, [command, str(tiny_checkpoint("qwen3")), "--calib", str(calib_file), "--seq-len", "32",
                                 "--device", "cpu", "--dtype", "float32", "--json", *extra])
    assert result.exit_code == 0, result.output
    assert "does not fit" in result.stderr and "one decoder layer at a time" in result.stderr
    if command == "prune":
        assert json.loads(result.stdout)["low_memory"]
    if command == "score":
        assert load_current_run()["options"]["low_memory"]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_low_memory_heads_give_the_loaded_models_profiles(arch, tiny_checkpoint, calib_file):  # noqa: F811
    common = ["heads", str(tiny_checkpoint(arch)), "--calib", str(calib_file), "--seq-len", "32", "--samples", "2",
              "--device", "cpu", "--dtype", "float32", "--json"]
    reports = []
    for extra in ([], ["--low-memory"]):
        result = runner.invoke(app, common + extra)
        assert result.exit_code == 0, result.output
        reports.append(json.loads(result.stdout))
    loaded, streamed = reports
    assert [head["pattern"] for head in streamed["heads"]] == [head["pattern"] for head in loaded["heads"]]
    compared = 0
    for ours, theirs in zip(loaded["heads"], streamed["heads"]):
        for key, value in ours.items():
            if isinstance(value, float):
                assert theirs[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
                compared += 1
    assert compared > 0


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("objective", ["down_proj", "lstsq"])
def test_low_memory_patch_fits_what_the_in_memory_patch_fits(arch, objective, tiny_checkpoint, calib_file,
                                                             tmp_path):  # noqa: F811
    """--patch on the layer-streamed path: the same fitted tensors (1e-6) and the same patched perplexity."""
    from safetensors.torch import load_file

    folder = tiny_checkpoint(arch)
    common = [str(folder), "--remove-layers", "2,3", "--patch", "--patch-objective", objective, "--calib",
              str(calib_file), "--seq-len", "32", "--samples", "4", "--patch-windows", "16", "--device", "cpu",
              "--dtype", "float32", "--force"]
    memory = prune_json(common + ["--output-dir", str(tmp_path / "memory")])
    streamed = prune_json(common + ["--output-dir", str(tmp_path / "streamed"), "--low-memory"])
    assert streamed["low_memory"]
    runs = memory["patch"]["runs"]
    assert [run["tensors"] for run in streamed["patch"]["runs"]] == [run["tensors"] for run in runs]
    assert all(run["tensors"] for run in runs)  # something was fitted
    for key in ("plain_cut", "patched"):
        assert streamed["perplexity"][key] == pytest.approx(memory["perplexity"][key], rel=1e-5)
    ours, theirs = load_file(tmp_path / "memory" / "model.safetensors"), load_file(tmp_path / "streamed" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name in {name for run in runs for name in run["tensors"]}:
        assert torch.allclose(theirs[name].double(), ours[name].double(), rtol=1e-6, atol=1e-9), name


def test_low_memory_patch_repair_aware_search_chooses_like_in_memory(tiny_checkpoint, calib_file, tmp_path):  # noqa: F811
    common = [str(tiny_checkpoint("qwen2", num_layers=8)), "--drop", "2", "--patch", "--calib", str(calib_file),
              "--seq-len", "32", "--samples", "8", "--patch-windows", "16", "--device", "cpu", "--dtype", "float32",
              "--force"]
    memory = prune_json(common + ["--output-dir", str(tmp_path / "memory")])
    streamed = prune_json(common + ["--output-dir", str(tmp_path / "streamed"), "--low-memory"])
    judged = memory["plan"]["parameters"]["patched"]
    assert streamed["plan"]["removed"] == memory["plan"]["removed"]
    assert [entry["removed"] for entry in streamed["plan"]["parameters"]["patched"]] == [entry["removed"] for entry in judged]
    compared = 0
    for ours, theirs in zip(judged, streamed["plan"]["parameters"]["patched"]):
        if ours["removed"][0] == 0:  # a run from layer 0: folded into the embedding in memory, left as is streamed
            continue
        assert theirs["patched_perplexity"] == pytest.approx(ours["patched_perplexity"], rel=1e-5), ours["removed"]
        compared += 1
    assert compared >= 1


def test_low_memory_patch_records_a_run_from_layer_0_as_not_patched(tiny_checkpoint, calib_file, tmp_path):  # noqa: F811
    result = prune_json([str(tiny_checkpoint("llama")), "--remove-layers", "0,1", "--patch", "--calib", str(calib_file),
                         "--seq-len", "32", "--samples", "4", "--patch-windows", "16", "--device", "cpu", "--dtype",
                         "float32", "--low-memory", "--output-dir", str(tmp_path / "out")])
    (run,) = result["patch"]["runs"]
    assert run["kind"] == "skip" and "layer 0" in run["action"] and not run["tensors"]


def test_memory_available_follows_a_memory_cgroup(tmp_path):
    """Inside a memory cgroup the room left is its limit minus its usage (skipped where none can be made)."""
    group = Path("/sys/fs/cgroup/memory/prunetool-test")
    try:
        group.mkdir(exist_ok=True)
        (group / "memory.limit_in_bytes").write_text(str(3 * 2**30))
    except OSError:
        pytest.skip("no writable memory cgroup (v1) on this machine")
    code = ("import os, pathlib; pathlib.Path('/sys/fs/cgroup/memory/prunetool-test/cgroup.procs').write_text(str(os.getpid())); "
            "from prunetool.memory import memory_available_bytes as m; print(m())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    assert 0 < int(out) < 3 * 2**30


def test_low_memory_prune_without_text_says_how_to_get_it(tiny_checkpoint, tmp_path):
    """No cached generated text and no model to generate it: one line that names the way out (and not the
    too-short-text hint, which would mislead here)."""
    out = tmp_path / "out"
    result = runner.invoke(app, ["prune", str(tiny_checkpoint("llama")), "--drop", "2", "--seq-len", "32",
                                 "--device", "cpu", "--low-memory", "--output-dir", str(out)])
    assert_refused(result, "not generated yet", "--calib", nothing_at=out)
    assert "--no-verify" not in result.stderr
