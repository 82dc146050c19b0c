"""`prunetool heads`: hand-set heads are named right, the probe matches independent references, budgets follow the rule."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from typer.testing import CliRunner

from handset_heads import EXPECTED, EXPECTED_SWAP, SEASONAL_PERIOD, build_handset_model, handset_windows
from prunetool.cli import app
from prunetool.errors import OptionError
from prunetool.heads.analysis import analyse
from prunetool.heads.budget import kv_budgets
from prunetool.kv.schedules import layer_budgets, parse_schedule, water_fill, whole_tokens
from prunetool.heads.patterns import attention_profiles, classify, profile_rows
from prunetool.heads.probe import probe_heads
from prunetool.heads.rope import rope_angles
from prunetool.select.scoring import score_model
from test_cli import assert_one_line_error, calib_file  # noqa: F401 (calib_file is a fixture)
from tiny_models import ARCHITECTURES

runner = CliRunner()


@pytest.fixture(scope="module")
def handset_report():
    model = build_handset_model()
    evidence = probe_heads(model, handset_windows(), (0,))
    return analyse(evidence, model="handset", calibration={}, kv_budget=None, caps=[128],
                   full_attention=[True]).data


# --- hand-set heads: each pattern, and a known positional and symbolic head -------------------------

@pytest.mark.parametrize("head", sorted(EXPECTED))
def test_handset_head_pattern(handset_report, head):
    entry = handset_report["heads"][head]
    assert entry["type"] == EXPECTED[head], entry["pattern"]


@pytest.mark.parametrize("head", sorted(EXPECTED_SWAP))
def test_handset_head_positional_or_symbolic(handset_report, head):
    swap = handset_report["heads"][head]["swap"]
    assert swap["label"] == EXPECTED_SWAP[head], swap


def test_handset_details(handset_report):
    heads = handset_report["heads"]
    assert heads[0]["pattern"]["fixed_positions"][0] == 0 and heads[0]["pattern"]["re_access"] > 0.95
    assert heads[1]["pattern"]["offset"] == 1 and heads[1]["pattern"]["sequential"] > 0.95
    seasonal = heads[2]
    assert seasonal["rope"]["channel"] == 0  # all its |q||k| mass is in pair 0
    assert seasonal["rope"]["period"] == pytest.approx(SEASONAL_PERIOD, rel=1e-6)
    assert seasonal["pattern"]["period"] == pytest.approx(SEASONAL_PERIOD, rel=0.01)
    [row] = [row for row in handset_report["seasonal"] if row["classified_seasonal"]]
    assert (row["layer"], row["head"]) == (0, 2)
    assert row["measured_period"] / row["predicted_period"] == pytest.approx(1.0, abs=0.01)
    assert heads[3]["rope"]["channel"] in (6, 7)  # the slow content pairs
    assert heads[3]["swap"]["symbolic"] > 0.9 and heads[1]["swap"]["positional"] > 0.9


# --- the classifier on attention maps written down directly ------------------------------------------

def _causal_softmax(logits: torch.Tensor) -> torch.Tensor:
    t = logits.shape[-1]
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    return logits.masked_fill(mask, float("-inf")).softmax(-1)


def _grid(t: int):
    return torch.arange(t)[:, None], torch.arange(t)[None, :]


@pytest.mark.parametrize("name, kind", [("sink", "re-access"), ("two_stripes", "re-access"), ("previous", "sequential"),
                                        ("local_band", "sequential"), ("comb_23.7", "seasonal"),
                                        ("rope_pair0", "seasonal"), ("random", "retrieval")])
def test_classifier_on_written_maps(name, kind):
    t = 512
    q, k = _grid(t)
    offset = (q - k).float()
    generator = torch.Generator().manual_seed(0)
    logits = {
        "sink": 20.0 * (k == 0),
        "two_stripes": 12.0 * ((k == 0) | (k == 5)),
        "previous": 20.0 * (offset == 1),
        "local_band": -0.3 * offset,
        "comb_23.7": 8 * torch.cos(2 * math.pi / 23.7 * offset),
        "rope_pair0": 30 * torch.cos(offset),
        "random": 4 * torch.randn(t, t, generator=generator),
    }[name].float()
    pattern = classify(*attention_profiles(_causal_softmax(logits), profile_rows(t)))
    assert pattern.kind == kind, pattern
    if name == "comb_23.7":
        assert pattern.period == pytest.approx(23.7, rel=0.01)


def test_profiles_match_explicit_loops():
    t, rows = 40, profile_rows(40)
    weights = _causal_softmax(torch.randn(3, t, t, generator=torch.Generator().manual_seed(1)))
    column, offset = attention_profiles(weights, rows)
    for h in range(3):
        for j in range(t - rows):
            want = sum(weights[h, r, j].item() for r in range(t - rows, t)) / rows
            assert column[h, j].item() == pytest.approx(want, abs=1e-7)
        for d in range(t - rows):
            want = sum(weights[h, r, r - d].item() for r in range(t - rows, t)) / rows
            assert offset[h, d].item() == pytest.approx(want, abs=1e-7)


# --- the probe against transformers' own attention weights and the score command -------------------

def _eager(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_probe_matches_output_attentions_and_scores(arch, tiny_checkpoint):
    model = _eager(tiny_checkpoint(arch))
    ids = torch.randint(3, 300, (3, 48), generator=torch.Generator().manual_seed(2))
    layers = (0, 2, 5)
    evidence = probe_heads(model, ids, layers)
    with torch.no_grad():
        attentions = model(input_ids=ids, output_attentions=True, use_cache=False).attentions
    rows = profile_rows(48)
    for index in layers:
        column, offset = attention_profiles(attentions[index], rows)
        assert torch.allclose(evidence.selected[index].column / 3, column.mean(0), atol=1e-5)
        assert torch.allclose(evidence.selected[index].offset / 3, offset.mean(0), atol=1e-5)
    from prunetool.select.calibration import CalibrationSet

    scores = score_model(model, CalibrationSet("ids", "0" * 64, 48, 48, ids), model_name=arch)
    report = analyse(evidence, model=arch, calibration={}, kv_budget=4, caps=[48] * 6,
                     full_attention=[True] * 6).data
    for head in report["heads"]:
        assert head["q_similarity"] == pytest.approx(scores.heads["q_similarity"][head["layer"]][head["head"]], abs=1e-9)
        assert head["q_similarity_post_rope"] == pytest.approx(
            scores.heads["q_similarity_post_rope"][head["layer"]][head["head"]], abs=1e-9)
        assert head["type"] in ("re-access", "sequential", "seasonal", "retrieval")
    assert [layer["index"] for layer in report["layers"]] == list(layers)
    assert sum(report["kv_budget"]["budgets"]) == 4 * 6
    json.dumps(report, allow_nan=False)
    assert "wrapper" not in getattr(ALL_ATTENTION_FUNCTIONS.get("eager"), "__name__", "")


def test_rope_angles_are_the_configured_frequencies(tiny_checkpoint):
    """Gemma 3 uses a different RoPE base on sliding and full layers; the probe reads each layer's own."""
    model = _eager(tiny_checkpoint("gemma3_text"))
    text = model.config.get_text_config()
    evidence = probe_heads(model, torch.randint(3, 300, (1, 32)), tuple(range(6)))
    for index, kind in enumerate(text.layer_types):
        parameters = text.rope_parameters[kind]
        half = torch.arange(0, text.head_dim, 2, dtype=torch.float64) / text.head_dim
        want = parameters["rope_theta"] ** -half
        if parameters.get("rope_type", "default") == "linear":
            want = want / parameters["factor"]
        got = evidence.selected[index].thetas
        assert torch.allclose(got, want, rtol=1e-5), (index, kind)


def test_rope_angles_ignore_attention_scaling():
    positions = torch.arange(4, dtype=torch.float64)[:, None]
    theta = torch.tensor([1.0, 0.1, 0.01])
    angles = torch.cat([positions * theta, positions * theta], -1)
    got = rope_angles(1.7 * torch.cos(angles)[None], 1.7 * torch.sin(angles)[None])
    assert torch.allclose(got, theta.double())


# --- KV budgets ---------------------------------------------------------------------------------------

def test_budgets_proportional_and_summing():
    similarity = [0.9, 0.5, 0.7, 0.1]
    budget = kv_budgets(similarity, 100, [1000] * 4, [True] * 4)
    p = [1 - s for s in similarity]
    assert sum(budget["budgets"]) == 400 == budget["total"]
    for layer, weight in zip(budget["layers"], p):
        assert layer["share"] == pytest.approx(400 * weight / sum(p))
        assert abs(layer["budget"] - layer["share"]) < 1


def test_budgets_capped_with_redistribution():
    similarity = [0.0, 0.9, 0.9, 0.95]  # layer 0 would get 300 of 400 by proportion
    shares = water_fill([1 - s for s in similarity], 400, [128] * 4)
    assert shares[0] == 128
    assert sum(shares) == pytest.approx(400)
    rest = [1 - s for s in similarity[1:]]
    for share, weight in zip(shares[1:], rest):
        assert share == pytest.approx(272 * weight / sum(rest))
    # a second round: redistribution can push another layer over its cap
    shares = water_fill([10, 5, 1, 1], 60, [20, 20, 20, 20])
    assert shares == pytest.approx([20, 20, 10, 10])


def test_whole_tokens_keep_the_sum_and_caps():
    shares = water_fill([0.31, 0.27, 0.29, 0.13], 3 * 17, [17] * 4)
    budgets = whole_tokens(shares, [17] * 4)
    assert sum(budgets) == 51 and max(budgets) <= 17
    assert all(abs(b - s) < 1 for b, s in zip(budgets, shares))


def test_budgets_floor_full_attention_layers_of_hybrid_models():
    """Gemma-like: slow-RoPE full layers look predictable, yet they are the only ones that see far back."""
    similarity = [0.5, 0.6, 0.9, 0.5, 0.6, 0.95]
    full = [False, False, True, False, False, True]
    caps = [64, 64, 1024, 64, 64, 1024]
    budget = kv_budgets(similarity, 100, caps, full)
    assert budget["budgets"][2] >= 100 and budget["budgets"][5] >= 100
    assert sum(budget["budgets"]) == 600 == budget["total"]
    assert all(b <= c for b, c in zip(budget["budgets"], caps))
    # the file is eval's tappa-floor schedule for the same prompt statistics
    schedule = parse_schedule("tappa-floor:100", num_layers=6, max_context=4096)
    assert budget["budgets"] == layer_budgets(schedule, caps, q_similarity=similarity, full_attention=full)
    # with no sliding layers it is TAPPA's plain rule
    plain = kv_budgets(similarity, 100, [1024] * 6, [True] * 6)
    shares = water_fill([1 - s for s in similarity], 600, [1024] * 6)
    assert [layer["share"] for layer in plain["layers"]] == pytest.approx(shares)


def test_budget_errors():
    with pytest.raises(OptionError, match="more than the sequence length"):
        kv_budgets([0.5, 0.5], 600, [512, 512], [True, True])
    with pytest.raises(OptionError, match="at least 1"):
        kv_budgets([0.5, 0.5], 0, [512, 512], [True, True])
    with pytest.raises(OptionError, match="exceeds what the layers can hold"):
        water_fill([1, 1], 300, [100, 100])


# --- the command ---------------------------------------------------------------------------------------

def heads_args(model, calib, *extra):
    return ["heads", str(model), "--calib", str(calib), "--seq-len", "32", "--samples", "2", *extra]


def test_heads_command_writes_report(tiny_checkpoint, calib_file, tmp_path):
    output = tmp_path / "report"
    result = runner.invoke(app, heads_args(tiny_checkpoint("qwen3"), calib_file, "--kv-budget", "16", "--output",
                                           str(output), "--json"))
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed == json.loads((output / "heads.json").read_text())
    assert json.loads((output / "kv_budget.json").read_text()) == printed["kv_budget"]
    assert sum(printed["kv_budget"]["budgets"]) == 16 * 6
    assert (output / "report.html").is_file() and list((output / "heatmaps").glob("*.png"))
    assert len(printed["heads"]) == 6 * 4
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_heads_budget_file_floors_full_layers_of_gemma3(tiny_checkpoint, calib_file):
    """On a sliding + full model the written budgets are eval's tappa-floor schedule: full layers >= B."""
    result = runner.invoke(app, heads_args(tiny_checkpoint("gemma3_text"), calib_file, "--kv-budget", "6", "--json"))
    assert result.exit_code == 0, result.output
    budget = json.loads(result.stdout)["kv_budget"]
    full = [layer["full_attention"] for layer in budget["layers"]]
    assert any(full) and not all(full) and budget["schedule"] == "tappa-floor"
    assert all(layer["budget"] >= 6 for layer in budget["layers"] if layer["full_attention"])
    assert all(layer["budget"] <= layer["cap"] for layer in budget["layers"])
    assert sum(budget["budgets"]) == 6 * len(full)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_layer_caps_follow_the_window_attention_uses(arch, tiny_checkpoint):
    """Caps and the floor's full-attention layers agree with the window each layer's attention is called with."""
    from prunetool.commands.heads import layer_caps, sliding_layers
    from prunetool.kv import snapkv

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(arch), dtype=torch.float32)
    prefilled = snapkv.prefill(model, list(range(3, 40)))
    config = model.config.get_text_config(decoder=True)
    layers = len(prefilled.layers)
    assert [not sliding for sliding in sliding_layers(config, layers)] == prefilled.full_attention
    assert layer_caps(config, 32, layers) == [min(32, layer.sliding_window or 32) for layer in prefilled.layers]


def test_heads_table_and_layers(tiny_checkpoint, calib_file):
    result = runner.invoke(app, heads_args(tiny_checkpoint("gemma3_text"), calib_file, "--layers", "1,4"))
    assert result.exit_code == 0, result.output
    assert "q-similarity vs predictable" in result.stdout
    rows = [line.split()[0] for line in result.stdout.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert rows == ["1", "4"]


@pytest.mark.parametrize("extra, words", [
    (["--kv-budget", "64"], ["more than the sequence length (32)"]),
    (["--kv-budget", "0"], ["at least 1"]),
    (["--layers", "9"], ["does not exist"]),
    (["--layers", "a"], ["not a whole number"]),
    (["--samples", "0"], ["at least 1"]),
])
def test_heads_bad_options(extra, words, tiny_checkpoint, calib_file):
    assert_one_line_error(runner.invoke(app, heads_args(tiny_checkpoint("llama"), calib_file, *extra)), *words)


def test_heads_short_window_and_existing_output(tiny_checkpoint, calib_file, tmp_path):
    model = tiny_checkpoint("llama")
    result = runner.invoke(app, ["heads", str(model), "--calib", str(calib_file), "--seq-len", "8"])
    assert_one_line_error(result, "too short")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert_one_line_error(runner.invoke(app, heads_args(model, calib_file, "--output", str(taken))), "not empty")
    assert (taken / "keep.txt").read_text() == "mine"
    result = runner.invoke(app, heads_args(model, calib_file, "--output", str(taken), "--force"))
    assert result.exit_code == 0, result.output
    assert not (taken / "keep.txt").exists() and (taken / "heads.json").is_file()


def test_swap_blocks_cover_the_recent_tokens():
    from prunetool.heads.swap import candidate_blocks

    for seq_len, block in ((512, 8), (128, 2), (37, 4), (16, 1)):
        starts = candidate_blocks(seq_len, block).tolist()
        covered = {start + i for start in starts for i in range(block)}
        assert seq_len - 2 in covered and 0 not in covered and seq_len - 1 not in covered
        assert starts == sorted(starts) and all(b - a == block for a, b in zip(starts, starts[1:]))


def test_swap_reruns_in_chunks_give_the_same_verdicts(monkeypatch):
    """Bounding the rerun's memory (one swapped copy per pass) must not change the swap test."""
    import prunetool.heads.probe as probe

    model, windows = build_handset_model(), handset_windows(windows=2)
    whole = probe.probe_heads(model, windows, (0,)).selected[0].swaps
    monkeypatch.setattr(probe, "SWAP_ATTENTION_BYTES", 1)
    chunked = probe.probe_heads(model, windows, (0,)).selected[0].swaps
    assert chunked.swaps == whole.swaps > 0
    assert torch.allclose(chunked.positional, whole.positional) and torch.allclose(chunked.symbolic, whole.symbolic)
