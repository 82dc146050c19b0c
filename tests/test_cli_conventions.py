"""CLI conventions: usage errors are one line with exit 2, -h works, each MODEL help states its real
default, option names mean one thing (old spellings still accepted, hidden), checks before slow work."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from prunetool.cli import app

runner = CliRunner()
PROSE = "The lighthouse keeper wrote the tide tables by hand, and the gulls watched him from the rail. " * 40


@pytest.fixture
def calib_file(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text(PROSE)
    return path


def one_line_usage_error(result, *words):
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:"), lines[0]
    assert "╭" not in result.output and "Traceback" not in result.output
    for word in words:
        assert word.lower() in lines[0].lower(), lines[0]


@pytest.mark.parametrize("args, words", [
    (["score", "--seq-len", "abc"], ["--seq-len", "integer"]),
    (["prune", "--no-such-option"], ["--no-such-option"]),
    (["prune", "--drop"], ["--drop"]),
    (["heads", "--samples", "1.5"], ["--samples"]),
    (["no-such-command"], ["no-such-command"]),
])
def test_usage_errors_are_one_line_with_exit_2(args, words):
    one_line_usage_error(runner.invoke(app, args), *words)


def test_usage_error_through_the_console_script_is_one_line():
    done = subprocess.run([sys.executable, "-m", "prunetool", "eval", "--limit", "many"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "--limit" in lines[0], done.stderr


@pytest.mark.parametrize("command", [[], ["score"], ["prune"], ["heads"], ["eval"], ["models"]])
def test_short_help_works(command):
    short, long = runner.invoke(app, [*command, "-h"]), runner.invoke(app, [*command, "--help"])
    assert short.exit_code == 0 and short.stdout == long.stdout
    assert "Usage" in short.stdout


@pytest.mark.parametrize("command, default", [
    ("score", "default: smollm2-135m"),
    ("prune", "default: the current run's model and its scores"),
    ("heads", "default: the current run's model, else smollm2-135m"),
    ("eval", "default: the current run's pruned model and its base"),
])
def test_model_help_states_the_real_default(command, default):
    text = " ".join(runner.invoke(app, [command, "--help"], terminal_width=400).stdout.split())
    assert default in text.replace("│", " ").replace("  ", " ") or default in " ".join(text.replace("│", " ").split())


@pytest.mark.parametrize("command, shown, hidden", [
    ("score", "--output-file", "--output"),
    ("eval", "--output-file", "--output"),
    ("prune", "--output-dir", "--output"),
    ("heads", "--output-dir", "--output"),
    ("prune", "--remove-layers", "--layers"),
    ("heads", "--only-layers", "--layers"),
])
def test_option_names_say_what_they_take_and_old_spellings_are_hidden(command, shown, hidden):
    words = runner.invoke(app, [command, "--help"], terminal_width=400).stdout.replace(",", " ").split()
    assert shown in words and hidden not in words


def test_old_and_new_spellings_do_the_same(tiny_checkpoint, calib_file, tmp_path):
    model = str(tiny_checkpoint("llama"))
    common = ["--calib", str(calib_file), "--seq-len", "16", "--samples", "2", "--no-verify"]
    new = runner.invoke(app, ["prune", model, "--remove-layers", "1,4", "--output-dir", str(tmp_path / "new"), *common])
    old = runner.invoke(app, ["prune", model, "--layers", "1,4", "-o", str(tmp_path / "old"), *common])
    assert new.exit_code == 0 and old.exit_code == 0, (new.output, old.output)
    plans = [json.loads((tmp_path / name / "prune.json").read_text())["removed"] for name in ("new", "old")]
    assert plans == [[1, 4], [1, 4]]
    card = (tmp_path / "new" / "README.md").read_text()
    assert "--remove-layers 1,4" in card


def test_both_spellings_at_once_are_refused(tiny_checkpoint, tmp_path):
    result = runner.invoke(app, ["prune", str(tiny_checkpoint("llama")), "--remove-layers", "1", "--layers", "2",
                                 "--no-verify", "--output-dir", str(tmp_path / "x")])
    assert result.exit_code == 1 and "once" in result.stderr and not (tmp_path / "x").exists()


def test_score_drop_is_checked_before_loading(tiny_checkpoint, calib_file, monkeypatch):
    import prunetool.model.loading

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before --drop was checked")

    monkeypatch.setattr(prunetool.model.loading, "load_model", no_loading)
    result = runner.invoke(app, ["score", str(tiny_checkpoint("llama")), "--calib", str(calib_file), "--drop", "6"])
    assert result.exit_code == 1 and "--drop 6 must be below the number of layers (6)" in result.stderr


def test_score_output_file_that_is_a_folder_is_refused_before_loading(tiny_checkpoint, tmp_path, monkeypatch):
    import prunetool.model.loading

    monkeypatch.setattr(prunetool.model.loading, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    result = runner.invoke(app, ["score", str(tiny_checkpoint("llama")), "--output-file", str(tmp_path)])
    assert result.exit_code == 1 and "is a folder" in result.stderr


def test_prune_request_is_built_by_keyword():
    from prunetool.commands.prune import PruneRequest

    with pytest.raises(TypeError):
        PruneRequest("model", 2)  # positional arguments would silently shift when an option is added
    assert PruneRequest(model="m", drop=2).criterion == "halving"


def test_score_and_prune_plots(tiny_checkpoint, calib_file, tmp_path):
    from prunetool.output.plots import prune_figure

    model = str(tiny_checkpoint("qwen2"))
    calib = ["--calib", str(calib_file), "--seq-len", "16", "--samples", "6"]
    scored = runner.invoke(app, ["score", model, *calib, "--drop", "2", "--plot", str(tmp_path / "s.png")])
    assert scored.exit_code == 0, scored.output
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pruned = runner.invoke(app, ["prune", "--drop", "2", "--refine-windows", "2", "--output-dir", str(tmp_path / "p"),
                                 "--plot", str(tmp_path / "p.png"), "--json"])
    assert pruned.exit_code == 0, pruned.output
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plan = json.loads(pruned.stdout)["plan"]
    # the figure the CLI drew has one bar per candidate the search measured
    record = json.loads((tmp_path / "p" / "prune.json").read_text())
    figure = prune_figure(None, record)
    bars = [ax for ax in figure.axes if "perplexity" in ax.get_ylabel() or "perplexity" in ax.get_xlabel()]
    assert bars and len(bars[-1].patches) >= len(plan["parameters"]["proposals"])


@pytest.mark.parametrize("name, words", [("plot.docx", ["docx"]), ("", ["folder"])])
def test_bad_plot_target_is_refused_before_scoring(tiny_checkpoint, tmp_path, monkeypatch, name, words):
    import prunetool.model.loading

    monkeypatch.setattr(prunetool.model.loading, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    result = runner.invoke(app, ["score", str(tiny_checkpoint("llama")), "--plot", str(tmp_path / name)])
    assert result.exit_code == 1 and all(word in result.stderr for word in words), result.stderr
