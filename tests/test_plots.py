"""score --plot and prune --plot figures: panels, removed-layer bands, candidate bars, atomic writes, no matplotlib."""

import json
import math
import struct
import sys

import pytest

from prunetool.output import plots
from prunetool.errors import MissingExtraError, OptionError
from prunetool.output.plots import layers_text, plot_layer_scores, plot_prune

LAYERS = 6


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's signature and IHDR chunk."""
    blob = path.read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n" and blob[12:16] == b"IHDR"
    return struct.unpack(">II", blob[16:24])


def expected_size(panels: int) -> tuple[int, int]:
    return round(plots.WIDTH * plots.DPI), round((plots.PANEL_HEIGHT * panels + 0.6) * plots.DPI)


def _scores(post_rope=True, angular=True):
    layers = [{"index": i, "q_similarity": 0.3 + 0.05 * i, "block_influence": 0.4 / (i + 1)} for i in range(LAYERS)]
    for layer in layers if post_rope else []:
        layer["q_similarity_post_rope"] = 0.2 + 0.04 * layer["index"]
    data = {"model": "hand-made", "num_layers": LAYERS, "calibration": {"windows": 2, "seq_len": 16}, "layers": layers}
    if angular:
        data["angular_distance"] = [[abs(i - j) * (0.05 + 0.01 * min(i, j)) for j in range(LAYERS + 1)]
                                    for i in range(LAYERS + 1)]
    return data


def _plan(criterion="guided", removed=(2, 3), values=None, parameters=None):
    if parameters is None and criterion == "guided":
        parameters = {"refine_windows": 2, "greedy_order": [3, 2], "chosen_from": "greedy",
                      "proposals": [{"removed": [2, 3], "kind": "greedy", "perplexity": 11.0},
                                    {"removed": [3, 4], "kind": "block", "perplexity": 950.0},
                                    {"removed": [1, 2], "kind": "block", "perplexity": math.inf}]}
    return json.loads(json.dumps({"base_model": "hand-made", "num_layers": LAYERS, "removed": list(removed),
                                  "criterion": criterion, "parameters": parameters or {},
                                  "criterion_values": values}))  # as read back from plan.json


def _panels(figure) -> dict:
    return {ax.get_label(): ax for ax in figure.axes}


def _bands(ax) -> int:
    return sum(patch.get_gid() == "removed" for patch in ax.patches)


def test_layer_scores_panels_and_removed_bands(tmp_path):
    scores = _scores()
    target = tmp_path / "new" / "folder" / "scores.png"
    figure = plot_layer_scores(scores, target, removed=[1, 4, 5])
    assert png_size(target) == expected_size(3)
    panels = _panels(figure)
    assert list(panels) == ["block_influence", "q_similarity", "angular_distance"]
    for ax in panels.values():
        assert _bands(ax) == 3 and ax.get_xlim() == (-0.5, LAYERS - 0.5)
    assert "removed" in [text.get_text() for text in panels["block_influence"].get_legend().get_texts()]
    pre, post = panels["q_similarity"].get_lines()
    assert list(post.get_ydata()) == [layer["q_similarity_post_rope"] for layer in scores["layers"]]
    (angular,) = panels["angular_distance"].get_lines()
    assert list(angular.get_ydata()) == [scores["angular_distance"][i][i + 1] for i in range(LAYERS)]
    assert [entry.name for entry in tmp_path.rglob("*") if entry.is_file()] == ["scores.png"]


def test_missing_post_rope_and_angular_are_left_out(tmp_path):
    figure = plot_layer_scores(_scores(post_rope=False, angular=False), tmp_path / "s.png", title="mine")
    panels = _panels(figure)
    assert list(panels) == ["block_influence", "q_similarity"] and len(panels["q_similarity"].get_lines()) == 1
    assert all(_bands(ax) == 0 for ax in figure.axes) and figure.get_suptitle() == "mine"
    assert png_size(tmp_path / "s.png") == expected_size(2)


def test_prune_guided_shows_one_bar_per_proposal(tmp_path):
    plan = _plan(values=[0.1 * i for i in range(LAYERS)])
    figure = plot_prune(_scores(), plan, tmp_path / "prune.png")
    panels = _panels(figure)
    assert list(panels) == ["block_influence", "q_similarity", "angular_distance", "criterion", "candidates"]
    assert png_size(tmp_path / "prune.png") == expected_size(5)
    assert all(_bands(panels[name]) == 2 for name in list(panels)[:-1])
    candidates = panels["candidates"]
    assert len(candidates.patches) == 3 and _bands(candidates) == 0
    labels = [tick.get_text() for tick in candidates.get_xticklabels()]
    assert labels == ["greedy\n2-3", "block\n3-4", "block\n1-2"]
    assert [tick.get_fontweight() for tick in candidates.get_xticklabels()] == ["bold", "normal", "normal"]
    assert candidates.patches[0].get_facecolor() != candidates.patches[1].get_facecolor()
    assert candidates.get_yscale() == "log"  # 11 to 950
    assert "\u221e" in [text.get_text() for text in candidates.texts]  # the unmeasurable proposal


def test_prune_without_scores_draws_what_exists(tmp_path):
    figure = plot_prune(None, _plan("last", removed=(3, 4)), tmp_path / "last.png")
    (ax,) = figure.axes
    assert ax.get_label() == "layers" and _bands(ax) == 2 and ax.get_xlim() == (-0.5, LAYERS - 0.5)
    assert png_size(tmp_path / "last.png") == expected_size(1)
    manual = plot_prune(None, _plan("manual", removed=(0,)), tmp_path / "manual.png")
    assert [_bands(ax) for ax in manual.axes] == [1]


def test_prune_ppl_draws_first_round_perplexities(tmp_path):
    values = [5.0, 6.0, None, 4000.0, 9.0, 8.0]
    figure = plot_prune(None, _plan("ppl", removed=(2, 4), values=values, parameters={"greedy_order": [4, 2]}),
                        tmp_path / "ppl.png")
    (ax,) = figure.axes
    assert ax.get_label() == "ppl" and _bands(ax) == 2 and ax.get_yscale() == "log"
    drawn = list(ax.get_lines()[0].get_ydata())
    assert math.isnan(drawn[2]) and drawn[:2] + drawn[3:] == [5.0, 6.0, 4000.0, 9.0, 8.0]


def test_scores_of_another_model_are_refused(tmp_path):
    plan = {**_plan(), "num_layers": LAYERS + 1}
    with pytest.raises(OptionError, match="score this model again"):
        plot_prune(_scores(), plan, tmp_path / "p.png")
    assert not any(tmp_path.iterdir())


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    target = tmp_path / "s.png"
    target.write_bytes(b"old")

    def broken(self, name, **options):
        with open(name, "wb") as handle:
            handle.write(b"half a picture")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken)
    with pytest.raises(OSError, match="disk full"):
        plot_layer_scores(_scores(), target)
    assert [entry.name for entry in tmp_path.iterdir()] == ["s.png"] and target.read_bytes() == b"old"
    with pytest.raises(OSError):
        plot_layer_scores(_scores(), tmp_path / "fresh.png")
    assert not (tmp_path / "fresh.png").exists() and len(list(tmp_path.iterdir())) == 1


def test_unknown_suffix_is_refused_before_writing(tmp_path):
    with pytest.raises(OptionError, match="FILE.png"):
        plot_layer_scores(_scores(), tmp_path / "sub" / "scores.docx")
    assert not any(tmp_path.iterdir())


def test_missing_matplotlib_is_one_clear_line(tmp_path, monkeypatch):
    for name in [name for name in sys.modules if name == "matplotlib" or name.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for draw in (lambda: plot_layer_scores(_scores(), tmp_path / "s.png"),
                 lambda: plot_prune(None, _plan("last"), tmp_path / "p.png")):
        with pytest.raises(MissingExtraError) as caught:
            draw()
        assert str(caught.value) == "plotting needs matplotlib: pip install 'prunetool[plot]'"
    assert not any(tmp_path.iterdir())


def test_layers_text():
    assert layers_text([9, 3, 4, 5]) == "3-5, 9" and layers_text([7]) == "7" and layers_text([1, 3]) == "1, 3"


def test_real_scores_and_guided_plan(tmp_path, tiny_checkpoint):
    """The dicts the CLI has on hand: a tiny Llama's scores and a guided plan, both through JSON."""
    from prunetool.select.calibration import load_calibration
    from prunetool.model.loading import load_model
    from prunetool.select.scoring import score_model
    from prunetool.select.selection import make_plan
    from prunetool.sources import resolve_model

    model, tokenizer = load_model(resolve_model(str(tiny_checkpoint("llama"))), dtype="float32", device="cpu")
    text = tmp_path / "calib.txt"
    text.write_text("The ferry left at dawn and the harbour master counted the crates twice. " * 40)
    calibration = load_calibration(str(text), tokenizer, seq_len=16, samples=2)
    scores = score_model(model, calibration, model_name="tiny-llama", batch_size=2)
    plan = make_plan("tiny-llama", "guided", 2, scores=scores, model=model, calibration=calibration)
    scores_json, plan_json = json.loads(json.dumps(scores.to_json())), json.loads(json.dumps(plan.to_json()))

    figure = plot_layer_scores(scores_json, tmp_path / "out" / "scores.png", removed=plan_json["removed"])
    assert png_size(tmp_path / "out" / "scores.png") == expected_size(3)
    assert [_bands(ax) for ax in figure.axes] == [2, 2, 2]
    assert len(_panels(figure)["q_similarity"].get_lines()) == 2  # tiny Llama has RoPE: post-RoPE recorded
    figure = plot_prune(scores_json, plan_json, tmp_path / "out" / "prune.png")
    candidates = _panels(figure)["candidates"]
    assert len(candidates.patches) == len(plan_json["parameters"]["proposals"]) >= 1
    assert sum(tick.get_fontweight() == "bold" for tick in candidates.get_xticklabels()) == 1
    assert sorted(entry.name for entry in (tmp_path / "out").iterdir()) == ["prune.png", "scores.png"]
