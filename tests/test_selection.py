"""Layer selection: every criterion on hand-built scores, --layers parsing, plans, in-memory removal
against an independently rebuilt model on every tiny architecture, perplexity against a hand
computation, and the perplexity-greedy criterion against a brute-force re-implementation.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

import prunetool.model.perplexity as perplexity_module
from prunetool.select.calibration import CalibrationSet
from prunetool.errors import OptionError, PrunetoolError
from prunetool.model.in_memory import layers_removed, prune_in_memory
from prunetool.model.loading import load_model
from prunetool.model.perplexity import perplexity
from prunetool.select.scoring import Scores
from prunetool.select.ranking import tappa_importance
from prunetool.select.selection import CRITERIA, make_plan, manual_plan, parse_layers, validate_selection
from prunetool.sources import resolve_model
from tests.tiny_models import ARCHITECTURES

CALIBRATION = {"source": "hand", "sha256": "0" * 64, "seq_len": 8, "stride": 8, "windows": 1, "tokens": 8}


def _scores(qsim=None, bi=None, angular=None, num_layers=None) -> Scores:
    num_layers = num_layers or len(qsim or bi)
    qsim, bi = qsim or [0.0] * num_layers, bi or [0.0] * num_layers
    layers = [{"index": i, "q_similarity": q, "q_similarity_post_rope": q, "q_similarity_lag1": q, "block_influence": b}
              for i, (q, b) in enumerate(zip(qsim, bi))]
    angular = angular or [[0.0] * (num_layers + 1) for _ in range(num_layers + 1)]
    return Scores("hand", num_layers, 1, CALIBRATION, layers, {}, angular)


def _removed(criterion, scores, count, **kwargs):
    return make_plan("hand", criterion, count, scores=scores, **kwargs).removed


# ---------------------------------------------------------------- score criteria on known values

def test_qsim_removes_highest_with_ties_to_lower_index_and_protection():
    scores = _scores(qsim=[0.1, 0.9, 0.5, 0.9, 0.2, 0.3])
    assert _removed("qsim", scores, 1) == (1,)
    assert _removed("qsim", scores, 2) == (1, 3)
    assert _removed("qsim", scores, 3) == (1, 2, 3)
    assert _removed("qsim", scores, 2, protect_first=2) == (2, 3)
    assert _removed("qsim", scores, 2, protect_last=3) == (1, 2)


def test_tappa_values_and_beta_edge_cases():
    # minmax(bi) = [0, .5, 1, .25]; 1 - minmax(qsim) = [.5, 0, 1, .75]; dyadic, so ties are exact
    scores = _scores(qsim=[0.5, 1.0, 0.0, 0.25], bi=[0.0, 0.5, 1.0, 0.25])
    plan = make_plan("hand", "tappa", 2, scores=scores)
    assert plan.criterion_values == pytest.approx([0.15, 0.5, 1.3, 0.475])
    assert plan.removed == (0, 3)
    assert _removed("tappa", scores, 1, beta=0.0) == (0,)  # pure block influence
    assert _removed("tappa", scores, 2, beta=0.0) == (0, 3)
    assert _removed("tappa", scores, 1, beta=1.0) == (0,)  # BI' = [.5, .5, 2, 1]: tie -> lower index
    assert _removed("tappa", scores, 2, beta=1.0) == (0, 1)
    assert _removed("tappa", scores, 1, beta=10.0) == (1,)  # query similarity dominates: the qsim choice
    assert _removed("tappa", scores, 1, beta=10.0) == _removed("qsim", scores, 1)
    assert _removed("tappa", scores, 1, protect_first=1) == (3,)
    flat = _scores(qsim=[0.4] * 4, bi=[0.3, 0.1, 0.3, 0.2])  # constant qsim: minmax -> 0, BI order remains
    assert make_plan("hand", "tappa", 1, scores=flat).criterion_values == pytest.approx([1.3, 0.3, 1.3, 0.8])


def test_bi_removes_lowest_block_influence():
    scores = _scores(bi=[0.5, 0.1, 0.3, 0.1, 0.4, 0.05])
    assert _removed("bi", scores, 1) == (5,)
    assert _removed("bi", scores, 2) == (1, 5)
    assert _removed("bi", scores, 3) == (1, 3, 5)
    assert _removed("bi", scores, 2, protect_last=1) == (1, 3)
    assert make_plan("hand", "bi", 1, scores=scores).criterion_values == [0.5, 0.1, 0.3, 0.1, 0.4, 0.05]


def _angular(num_layers: int, entries: dict) -> list[list[float]]:
    dist = [[0.0 if i == j else 0.5 for j in range(num_layers + 1)] for i in range(num_layers + 1)]
    for (i, j), value in entries.items():
        dist[i][j] = dist[j][i] = value
    return dist


def test_angular_block_keeps_final_layer_ties_and_protection():
    # d(4, 6) is the smallest but [4, 6) contains the final layer 5; [1, 3) and [3, 5) tie at 0.1.
    scores = _scores(num_layers=6, angular=_angular(6, {(4, 6): 0.01, (1, 3): 0.1, (3, 5): 0.1, (2, 4): 0.2}))
    plan = make_plan("hand", "angular", 2, scores=scores)
    assert plan.removed == (1, 2)
    assert plan.criterion_values == [0.5, 0.1, 0.2, 0.1, None, None]
    assert _removed("angular", scores, 2, protect_first=2) == (3, 4)
    assert _removed("angular", scores, 2, protect_first=2, protect_last=2) == (2, 3)  # the only start left
    assert make_plan("hand", "angular", 2, scores=scores, protect_last=2).criterion_values == [0.5, 0.1, 0.2, None, None, None]
    assert _removed("angular", scores, 5) == (0, 1, 2, 3, 4)  # L-1 layers: one block, the final layer stays
    with pytest.raises(OptionError, match="contiguous block and keeps the final layer: layers 3..4 leave room for 2"):
        make_plan("hand", "angular", 3, scores=scores, protect_first=3)  # 3 unprotected, but 5 is the final layer


def test_last_is_the_block_before_the_final_layer():
    plan = make_plan("hand", "last", 2, num_layers=6)
    assert plan.removed == (3, 4) and plan.criterion_values is None and plan.calibration is None
    assert make_plan("hand", "last", 2, num_layers=6, protect_last=3).removed == (1, 2)
    assert make_plan("hand", "last", 5, num_layers=6).removed == (0, 1, 2, 3, 4)
    with pytest.raises(OptionError, match="contiguous block"):
        make_plan("hand", "last", 3, num_layers=6, protect_first=3)


@pytest.mark.parametrize("kwargs, message", [
    (dict(count=0), "at least 1"),
    (dict(count=6), "below the number of layers"),
    (dict(count=3, protect_first=2, protect_last=2), "more than the 2 unprotected layers"),
    (dict(count=1, protect_first=3, protect_last=3), "more than the 0 unprotected"),
    (dict(criterion="nope"), "guided, qsim, tappa, bi, angular, last, ppl, halving"),
    (dict(beta=-0.1), "--beta"),
    (dict(beta=float("nan")), "--beta"),
    (dict(protect_first=-1), "--protect-first"),
])
def test_validation_errors_are_one_line(kwargs, message):
    args = dict(criterion="bi", count=2, num_layers=6) | kwargs
    with pytest.raises(OptionError, match=re.escape(message)) as error:
        validate_selection(args.pop("criterion"), args.pop("count"), args.pop("num_layers"), **args)
    assert "\n" not in str(error.value)


def test_make_plan_records_how_layers_were_chosen():
    scores = _scores(qsim=[0.5, 0.9, 0.1, 0.3, 0.7], bi=[0.2, 0.6, 1.0, 0.4, 0.3])
    plan = make_plan("tiny/model", "tappa", 2, scores=scores, beta=0.5, protect_first=1)
    assert plan.base_model == "tiny/model" and plan.num_layers == 5 and plan.criterion == "tappa"
    assert plan.parameters == {"protect_first": 1, "protect_last": 0, "beta": 0.5}
    assert plan.criterion_values == pytest.approx(tappa_importance(scores.column("block_influence"),
                                                                   scores.column("q_similarity"), 0.5))
    assert plan.calibration == CALIBRATION
    assert make_plan("m", "bi", 1, scores=scores).parameters == {"protect_first": 0, "protect_last": 0}
    with pytest.raises(OptionError, match="disagree"):
        make_plan("m", "bi", 1, scores=scores, num_layers=6)
    with pytest.raises(OptionError, match="score the model first"):
        make_plan("m", "bi", 1, num_layers=5)
    with pytest.raises(OptionError, match="calibration"):
        make_plan("m", "ppl", 1, num_layers=5)
    assert manual_plan("m", (4, 1), 5).to_json()["kept"] == [0, 2, 3]


def test_registry_is_complete():
    assert list(CRITERIA) == ["guided", "qsim", "tappa", "bi", "angular", "last", "ppl", "halving"]


# ---------------------------------------------------------------- --layers

def test_parse_layers_accepts_spaces_and_sorts():
    assert parse_layers("3,7,12", 16) == (3, 7, 12)
    assert parse_layers(" 12 , 3,7 ", 16) == (3, 7, 12)
    assert parse_layers("0", 2) == (0,)


@pytest.mark.parametrize("text, message", [
    ("", "empty"),
    ("3,,7", "item 2 is empty"),
    ("3,", "item 2 is empty"),
    ("x", "'x' is not a whole number"),
    ("1.5", "'1.5' is not a whole number"),
    ("-1", "-1 is negative"),
    ("3,3", "layer 3 is listed twice"),
    ("6", "layer 6 does not exist; indices are 0-based, 0..5"),
    ("0,1,2,3,4,5", "all 6 layers"),
])
def test_parse_layers_errors(text, message):
    with pytest.raises(OptionError, match=re.escape(message)):
        parse_layers(text, 6)


# ---------------------------------------------------------------- in-memory removal on real tiny models

def _load(tiny_checkpoint, arch):
    model, _ = load_model(resolve_model(str(tiny_checkpoint(arch))), dtype="float32", device="cpu")
    return model


def rebuild_pruned(model, removed):
    """The slow, independent path: a fresh model built from an edited config, loaded with renamed weights."""
    keep = [i for i in range(len(model.get_decoder().layers)) if i not in set(removed)]
    config = copy.deepcopy(model.config)
    text = config.get_text_config(decoder=True)
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = [text.layer_types[i] for i in keep]
    text.num_hidden_layers = len(keep)
    pruned = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                              attn_implementation=model.config._attn_implementation)
    prefix = next(name for name, module in model.named_modules() if module is model.get_decoder())
    pattern = re.compile(rf"{re.escape(prefix)}\.layers\.(\d+)\.(.*)")
    state = {}
    for key, value in model.state_dict().items():
        match = pattern.fullmatch(key)
        if match is None:
            state[key] = value
        elif int(match[1]) in keep:
            state[f"{prefix}.layers.{keep.index(int(match[1]))}.{match[2]}"] = value
    pruned.load_state_dict(state, strict=True)
    return pruned.eval()


def _snapshot(model):
    decoder, text = model.get_decoder(), model.config.get_text_config(decoder=True)
    indices = [(name, m.layer_idx) for name, m in decoder.named_modules() if hasattr(m, "layer_idx")]
    return decoder.layers, indices, text.to_dict(), [name for name, _ in model.named_parameters()]


def _greedy_no_cache(model, ids, steps):
    for _ in range(steps):
        ids = torch.cat([ids, model(input_ids=ids, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    return ids


CASES = [(arch, (1, 3, 4)) for arch in ARCHITECTURES] + [("gemma3_text", (2, 5)), ("qwen2", (0, 1, 2))]


@pytest.mark.parametrize("arch, removed", CASES, ids=[f"{a}-{'-'.join(map(str, r))}" for a, r in CASES])
def test_layers_removed_matches_rebuilt_model_and_restores_everything(tiny_checkpoint, arch, removed):
    model = _load(tiny_checkpoint, arch)
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))  # longer than the window 8
    with torch.no_grad():
        before, snapshot = model(input_ids=ids).logits, _snapshot(model)
        want = rebuild_pruned(model, removed)(input_ids=ids).logits
        with layers_removed(model, removed) as keep:
            assert keep == tuple(i for i in range(6) if i not in removed)
            assert len(model.get_decoder().layers) == len(keep)
            text = model.config.get_text_config(decoder=True)
            assert text.num_hidden_layers == len(keep)
            text.validate()  # what save_pretrained checks: per-layer lists match the layer count
            if arch == "qwen2":  # full attention below max_window_layers=3: survivors 0, 2 (or none) are below
                assert text.max_window_layers == {(1, 3, 4): 2, (0, 1, 2): 0}[removed]
            torch.testing.assert_close(model(input_ids=ids).logits, want, atol=1e-5, rtol=0)
            generated = model.generate(ids[:1], max_new_tokens=10, do_sample=False, pad_token_id=0)
            reference = _greedy_no_cache(model, ids[:1], 10)
            assert torch.equal(generated, reference[:, : generated.shape[1]])
        after = model(input_ids=ids).logits
    assert torch.equal(after, before)
    decoder_layers, indices, config, names = _snapshot(model)
    assert decoder_layers is snapshot[0] and indices == snapshot[1] and config == snapshot[2] and names == snapshot[3]


def test_layers_removed_restores_after_an_exception(tiny_checkpoint):
    model = _load(tiny_checkpoint, "qwen3")
    snapshot = _snapshot(model)
    with pytest.raises(RuntimeError, match="boom"), layers_removed(model, [0, 5]):
        raise RuntimeError("boom")
    assert _snapshot(model)[1:] == snapshot[1:] and model.get_decoder().layers is snapshot[0]
    with pytest.raises(OptionError, match="0..5"):
        with layers_removed(model, [6]):
            pass
    assert _snapshot(model)[1:] == snapshot[1:]


def test_prune_in_memory_is_permanent_and_saves(tiny_checkpoint, tmp_path):
    model = _load(tiny_checkpoint, "gemma3")
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(1))
    want = rebuild_pruned(model, (0, 2))(input_ids=ids).logits
    assert prune_in_memory(model, (0, 2)) == (1, 3, 4, 5)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want, atol=1e-5, rtol=0)
    model.save_pretrained(tmp_path)  # validates the config
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


# ---------------------------------------------------------------- perplexity

def hand_perplexity(model, windows):
    """exp of the mean NLL from full logits, log-softmax in float64."""
    with torch.no_grad():
        logits = model(input_ids=windows, use_cache=False).logits.double()  # (W, T, V)
    logp = logits[:, :-1].log_softmax(-1).gather(-1, windows[:, 1:, None])
    return math.exp(-logp.mean().item())


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_perplexity_matches_hand_computation(tiny_checkpoint, arch, monkeypatch):
    model = _load(tiny_checkpoint, arch)
    windows = torch.randint(0, 300, (3, 12), generator=torch.Generator().manual_seed(2))
    want = hand_perplexity(model, windows)
    vocab = model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(perplexity_module, "LOGITS_BUDGET_BYTES", 4 * vocab * 5)  # 5 tokens per head chunk
    for batch_size in (1, 2, 3):
        assert perplexity(model, windows, batch_size=batch_size) == pytest.approx(want, rel=1e-5)
    monkeypatch.setattr(perplexity_module, "TESTED", ())  # the whole-forward fallback for other families
    assert perplexity(model, windows, batch_size=2) == pytest.approx(want, rel=1e-5)


def test_perplexity_rejects_bad_windows(tiny_checkpoint):
    model = _load(tiny_checkpoint, "llama")
    with pytest.raises(OptionError, match="T>=2"):
        perplexity(model, torch.zeros(2, 1, dtype=torch.long))


# ---------------------------------------------------------------- ppl criterion (SLEB-style greedy)

def _calibration(windows):
    return CalibrationSet("random", "f" * 64, windows.shape[1], windows.shape[1], windows)


def test_ppl_criterion_equals_brute_force(tiny_checkpoint):
    model = _load(tiny_checkpoint, "llama")
    windows = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(3))
    first = {layer: hand_perplexity(rebuild_pruned(model, [layer]), windows) for layer in range(6)}
    a = min(first, key=first.get)
    second = {layer: hand_perplexity(rebuild_pruned(model, [a, layer]), windows) for layer in range(6) if layer != a}
    b = min(second, key=second.get)
    steps = []
    with torch.no_grad():
        before = model(input_ids=windows).logits
    plan = make_plan("tiny", "ppl", 2, model=model, calibration=_calibration(windows),
                     on_step=lambda done, total: steps.append((done, total)))
    assert plan.removed == tuple(sorted((a, b))) and plan.parameters["greedy_order"] == [a, b]
    assert plan.criterion_values == pytest.approx([first[i] for i in range(6)], rel=1e-5)
    assert steps == [(done, 11) for done in range(1, 12)]
    assert plan.calibration["sha256"] == "f" * 64 and plan.parameters["batch_size"] == 1
    with torch.no_grad():
        assert torch.equal(model(input_ids=windows).logits, before)


def test_ppl_criterion_respects_protection(tiny_checkpoint):
    model = _load(tiny_checkpoint, "gemma3_text")
    windows = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(4))
    steps = []
    plan = make_plan("tiny", "ppl", 2, model=model, calibration=_calibration(windows), protect_first=1,
                     protect_last=2, batch_size=2, on_step=lambda done, total: steps.append((done, total)))
    assert set(plan.removed) <= {1, 2, 3} and steps[-1] == (5, 5)
    values = plan.criterion_values
    assert values[0] is None and values[4] is None and values[5] is None and None not in values[1:4]


# ---------------------------------------------------------------- guided (the default)

def test_rank01_ties_share_their_mean_rank():
    from prunetool.model.metrics import rank01

    assert rank01(torch.tensor([3.0, 1.0, 2.0, 2.0, 10.0])).tolist() == [0.75, 0.0, 0.375, 0.375, 1.0]
    assert rank01(torch.tensor([5.0, 5.0, 5.0])).tolist() == [0.5, 0.5, 0.5]
    assert rank01(torch.tensor([7.0])).tolist() == [0.0]
    # one extreme value does not squash the rest, unlike min-max
    assert rank01(torch.tensor([0.01, 0.02, 0.03, 100.0])).tolist() == pytest.approx([0, 1 / 3, 2 / 3, 1])


def test_guided_importance_by_hand():
    from prunetool.select.ranking import guided_importance

    bi, qsim = [0.9, 0.1, 0.2, 0.3], [0.5, 0.8, 0.6, 0.7]
    # rank01(bi) = [1, 0, 1/3, 2/3]; 1 - rank01(qsim) = [1, 0, 2/3, 1/3]
    assert guided_importance(bi, qsim, 1.0) == pytest.approx([2, 0, 1, 1])
    assert guided_importance(bi, qsim, 0.0) == pytest.approx([1, 0, 1 / 3, 2 / 3])


def test_contiguous_blocks_rank_by_summed_values_inside_bounds():
    from prunetool.select.ranking import contiguous_blocks

    values = [5.0, 1.0, 1.0, 4.0, 0.5, 0.5, 9.0]
    assert contiguous_blocks(values, 2, 0, 7, 3) == [(4, 5), (1, 2), (3, 4)]  # sums 1, 2, 4.5
    assert contiguous_blocks(values, 2, 0, 5, 1) == [(1, 2)]  # (4, 5) would reach past the end
    assert contiguous_blocks(values, 3, 2, 7, 9) == [(3, 4, 5), (2, 3, 4), (4, 5, 6)]
    assert contiguous_blocks(values, 2, 0, 7, 0) == []


def test_guided_with_everything_shortlisted_and_no_blocks_is_sleb(tiny_checkpoint):
    model = _load(tiny_checkpoint, "qwen3")
    windows = torch.randint(0, 300, (3, 12), generator=torch.Generator().manual_seed(5))
    scores = _scores(qsim=[0.5, 0.1, 0.9, 0.3, 0.7, 0.2], bi=[0.9, 0.2, 0.1, 0.4, 0.3, 0.8])
    sleb = make_plan("tiny", "ppl", 3, model=model, calibration=_calibration(windows))
    guided = make_plan("tiny", "guided", 3, scores=scores, model=model, calibration=_calibration(windows),
                       shortlist=6, refine_windows=3, blocks=0)
    assert guided.removed == sleb.removed
    assert guided.parameters["greedy_order"] == sleb.parameters["greedy_order"]


def test_guided_chooses_the_best_measured_proposal(tiny_checkpoint):
    """Against an independent rebuild: every proposal's perplexity, the greedy path, and the argmin."""
    model = _load(tiny_checkpoint, "llama")
    windows = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(7))
    scores = _scores(qsim=[0.2, 0.9, 0.8, 0.1, 0.6, 0.3], bi=[0.9, 0.1, 0.2, 0.5, 0.3, 0.7])
    steps = []
    plan = make_plan("tiny", "guided", 2, scores=scores, model=model, calibration=_calibration(windows),
                     shortlist=2, refine_windows=2, blocks=2, on_step=lambda done, total: steps.append((done, total)))
    values = plan.criterion_values  # rank01(bi) + 0.3 * (1 - rank01(qsim))
    order = sorted(range(6), key=lambda i: (values[i], i))
    assert order[:2] == [1, 2]
    # the greedy path by hand: the 2 lowest-ranked remaining layers per round, measured on a rebuilt model
    first = {i: hand_perplexity(rebuild_pruned(model, [i]), windows) for i in order[:2]}
    a = min(first, key=lambda i: (first[i], i))
    rest = [i for i in order if i != a][:2]
    second = {i: hand_perplexity(rebuild_pruned(model, [a, i]), windows) for i in rest}
    b = min(second, key=lambda i: (second[i], i))
    assert plan.parameters["greedy_order"] == [a, b]
    proposals = {tuple(p["removed"]): p for p in plan.parameters["proposals"]}
    assert tuple(sorted((a, b))) in proposals
    for removed, proposal in proposals.items():
        assert proposal["perplexity"] == pytest.approx(hand_perplexity(rebuild_pruned(model, list(removed)), windows),
                                                       rel=1e-5)
    best = min(proposals, key=lambda r: proposals[r]["perplexity"])
    assert plan.removed == best and plan.parameters["chosen_from"] == proposals[best]["kind"]
    assert [p["kind"] for p in plan.parameters["proposals"]].count("block") >= 1
    assert steps[-1] == (6, 6)  # 2 rounds x 2 shortlisted + 2 blocks
    assert {k: plan.parameters[k] for k in ("beta", "shortlist", "refine_windows", "blocks")} == \
        {"beta": 0.3, "shortlist": 2, "refine_windows": 2, "blocks": 2}


def test_guided_measures_each_set_once_with_a_shared_memo(tiny_checkpoint, monkeypatch):
    from prunetool.select.ranking import SelectionRequest
    from prunetool.select.search import select_guided

    model = _load(tiny_checkpoint, "mistral")
    windows = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(2))
    scores = _scores(qsim=[0.2, 0.9, 0.8, 0.1, 0.6, 0.3], bi=[0.9, 0.1, 0.2, 0.5, 0.3, 0.7])
    from prunetool.select import cut_engine

    calls, built = [], []
    real, engine_measure, engine_init = (perplexity_module.perplexity, cut_engine.CutEngine.perplexity_without,
                                         cut_engine.CutEngine.__init__)
    monkeypatch.setattr(perplexity_module, "perplexity", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(cut_engine.CutEngine, "perplexity_without",
                        lambda self, *a, **k: calls.append(1) or engine_measure(self, *a, **k))
    monkeypatch.setattr(cut_engine.CutEngine, "__init__",
                        lambda self, *a, **k: built.append(1) or engine_init(self, *a, **k))
    memo: dict = {}
    first = select_guided(SelectionRequest(6, 2, scores, model=model, windows=windows, measured=memo))
    measured = len(calls)
    assert built == [1] and measured == len(memo)  # the self-check replays one window, it measures no cut
    again = select_guided(SelectionRequest(6, 2, scores, model=model, windows=windows, measured=memo))
    assert again.removed == first.removed and len(calls) == measured and built == [1]  # all from the memo


@pytest.mark.parametrize("option, value, flag", [("shortlist", 0, "--shortlist"), ("refine_windows", 0, "--refine-windows"),
                                                 ("blocks", -1, "--blocks"), ("screen_tokens", 1, "--screen-tokens"),
                                                 ("screen_dtype", "float16", "--screen-dtype")])
def test_guided_options_are_checked(option, value, flag):
    with pytest.raises(OptionError, match=flag):
        validate_selection("guided", 2, 6, **{option: value})


def test_halving_matches_sleb_when_it_confirms_every_candidate_and_measures_what_it_reports(tiny_checkpoint):
    """With shortlist >= the candidates, halving's greedy path is SLEB's; every reported perplexity is real."""
    from prunetool.select.cut_engine import screening_model
    from prunetool.model.in_memory import layers_removed
    from prunetool.select.ranking import SelectionRequest
    from prunetool.select.search import select_halving, select_ppl

    model = _load(tiny_checkpoint, "gemma3_text")
    windows = torch.randint(0, 300, (4, 12), generator=torch.Generator().manual_seed(3))
    sleb = select_ppl(SelectionRequest(6, 2, model=model, windows=windows[:3]))
    wide = select_halving(SelectionRequest(6, 2, model=model, windows=windows, shortlist=6, refine_windows=3,
                                           screen_tokens=4, blocks=0))
    assert wide.extra["greedy_order"] == list(sleb.extra["greedy_order"])
    assert (wide.extra["refine_windows"], wide.extra["screen_tokens"]) == (3, 4)
    screened_on = screening_model(model)  # bfloat16 where that is native, as the search's screening
    assert wide.extra["screened_in"] == str(screened_on.dtype).removeprefix("torch.")
    for layer in range(6):  # round one screened each layer on the first 4 tokens of the 3 measuring windows
        with layers_removed(screened_on, [layer]):
            assert wide.values[layer] == pytest.approx(perplexity_module.perplexity(screened_on, windows[:3, :4]), rel=1e-5)
    own = select_halving(SelectionRequest(6, 2, model=model, windows=windows, shortlist=6, refine_windows=3,
                                          screen_tokens=4, blocks=0, screen_dtype="model"))
    assert own.extra["screened_in"] == "float32" and own.extra["greedy_order"] == wide.extra["greedy_order"]
    for layer in range(6):  # --screen-dtype model: screened on the float32 model itself
        with layers_removed(model, [layer]):
            assert own.values[layer] == pytest.approx(perplexity_module.perplexity(model, windows[:3, :4]), rel=1e-5)
    narrow = select_halving(SelectionRequest(6, 3, model=model, windows=windows, shortlist=1, refine_windows=2,
                                             screen_tokens=6, blocks=2))
    for proposal in narrow.extra["proposals"] + [{"removed": list(narrow.removed), "perplexity": narrow.extra["perplexity"]}]:
        with layers_removed(model, proposal["removed"]):
            assert proposal["perplexity"] == pytest.approx(perplexity_module.perplexity(model, windows[:2]), rel=1e-5)
    assert narrow.extra["perplexity"] <= min(p["perplexity"] for p in narrow.extra["proposals"])
    assert [p["kind"] for p in narrow.extra["proposals"]].count("block") >= 1


def test_halving_screens_every_layer_once_then_round_ones_better_half(tiny_checkpoint, monkeypatch):
    from prunetool.select import search
    from prunetool.select.ranking import SelectionRequest

    model, _ = load_model(resolve_model(str(tiny_checkpoint("llama", num_layers=12))), dtype="float32", device="cpu")
    windows = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(5))
    screened: list[list[tuple[int, ...]]] = []
    real = search._screen
    monkeypatch.setattr(search, "_screen", lambda req, holder, base, extras, keep=None: screened.append(list(extras))
                        or real(req, holder, base, extras, keep))
    chosen = search.select_halving(SelectionRequest(12, 3, model=model, windows=windows, shortlist=1, refine_windows=2,
                                                    screen_tokens=6, blocks=0))
    first = chosen.values
    better_half = sorted(range(12), key=lambda i: (first[i], i))[:6]
    assert [len(extras) for extras in screened] == [12, 5, 4]  # the pool minus the layers already removed
    assert all({extra[0] for extra in extras} <= set(better_half) for extras in screened[1:])
    assert set(chosen.extra["greedy_order"]) <= set(better_half)


def _peaked_model_and_own_text(tiny_checkpoint, arch: str):
    """A tiny model whose layers differ a lot in how much they matter, and windows it predicts well (its own
    greedy text): removing one layer then costs anywhere from little to a hundredfold in perplexity, as in
    real models, where random weights and random text make every cut look alike."""
    model, _ = load_model(resolve_model(str(tiny_checkpoint(arch, num_layers=12))), dtype="float32", device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            for name, weight in layer.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):  # what each layer writes to the residual
                    weight.mul_(float(torch.empty(()).uniform_(1, 12, generator=generator)))
        start = torch.randint(0, 300, (4, 1), generator=torch.Generator().manual_seed(7))
        windows = model.generate(start, max_new_tokens=15, min_new_tokens=15, do_sample=False)
    return model, windows


@pytest.mark.parametrize("arch", ["llama", "gemma2", "phi3"])
def test_halving_gives_up_on_hopeless_candidates_without_changing_its_choice(arch, tiny_checkpoint, monkeypatch):
    """Screening, confirmation and swaps stop measuring a candidate once it is certainly worse than what the
    search holds; everything the search returns (cut, values, proposals, swaps) equals a run that measures
    every candidate in full, and some windows were really skipped."""
    from prunetool.select import cut_engine, search
    from prunetool.select.ranking import SelectionRequest

    model, windows = _peaked_model_and_own_text(tiny_checkpoint, arch)
    request = dict(model=model, windows=windows, shortlist=2, refine_windows=4, screen_tokens=8, blocks=2)
    engines = []
    real_init = cut_engine.CutEngine.__init__
    monkeypatch.setattr(cut_engine.CutEngine, "__init__", lambda self, *a, **k: engines.append(self) or real_init(self, *a, **k))
    memo: dict = {}  # shared across drop counts, as bench/quality.py does: given-up sets are kept as bounds
    quick = [search.select_halving(SelectionRequest(12, count, measured=memo, **request)) for count in (4, 3)]
    assert sum(engine.batches_skipped for engine in engines) > 0
    assert any(isinstance(value, search._LowerBound) for value in memo.values())

    real = cut_engine.CutEngine.perplexity_without
    monkeypatch.setattr(cut_engine.CutEngine, "perplexity_without",
                        lambda self, extra, batches=None, give_up_above=math.inf: real(self, extra, batches))
    full = [search.select_halving(SelectionRequest(12, count, **request)) for count in (4, 3)]
    for mine, theirs in zip(quick, full):
        assert (mine.removed, mine.values, mine.extra) == (theirs.removed, theirs.values, theirs.extra)


def test_a_remembered_give_up_answers_only_callers_whose_limit_it_exceeds():
    """The memo keeps a given-up measurement as a lower bound: enough for a caller with a lower limit, and
    measured again for one whose limit is above the bound."""
    from types import SimpleNamespace

    from prunetool.select import search
    from prunetool.select.ranking import SelectionRequest

    truth, calls = 10.0, []

    def perplexity_without(key, give_up_above=math.inf):  # gives up just above the limit, as the engine may
        calls.append(give_up_above)
        return truth if give_up_above >= truth else give_up_above + 1

    engine = SimpleNamespace(removed=(), set_cut=lambda key: None, perplexity_without=perplexity_without)
    holder = SimpleNamespace(get=lambda: engine)
    req = SelectionRequest(6, 1, measured={})
    assert search._measure(req, None, [1], holder, give_up_above=3) == 4 and len(calls) == 1
    assert search._measure(req, None, [1], holder, give_up_above=3.5) == 4 and len(calls) == 1  # 4 > 3.5: enough
    assert search._measure(req, None, [1], holder, give_up_above=12) == truth and len(calls) == 2  # 4 <= 12: again
    assert search._measure(req, None, [1], holder) == truth and len(calls) == 2  # now exact in the memo


def test_sublayer_units_rank_by_what_is_measured_across_the_sublayer():
    scores = _scores(qsim=[0.9, 0.1, 0.5, 0.2], bi=[0.1, 0.2, 0.3, 0.4])  # block ranking: 0 first
    for layer, attention, mlp, angle in zip(scores.layers, [0.4, 0.05, 0.3, 0.2], [0.01, 0.5, 0.02, 0.6],
                                            [0.3, 0.2, 0.1, 0.4]):
        layer.update(attention_influence=attention, mlp_influence=mlp, attention_angular=angle, mlp_angular=1 - angle)
    assert _removed("bi", scores, 1) == (0,)
    assert _removed("bi", scores, 2, unit="attention") == (1, 3)
    assert _removed("bi", scores, 2, unit="mlp") == (0, 2)
    assert _removed("angular", scores, 2, unit="attention") == (1, 2)  # not contiguous: the N smallest angles
    assert _removed("angular", scores, 1, unit="mlp") == (3,)
    # TAPPA at the attention unit: minmax(attention BI) = [1, 0, .714, .429], 1 - minmax(qsim) = [0, 1, .5, .875]
    plan = make_plan("hand", "tappa", 1, scores=scores, unit="attention", beta=0.3)
    assert plan.criterion_values == pytest.approx([1.0, 0.3, 5 / 7 + 0.15, 3 / 7 + 0.2625])
    assert plan.removed == (1,) and plan.unit == "attention"


def test_sublayer_criteria_refuse_scores_without_sublayer_measures():
    scores = _scores(bi=[0.1, 0.2, 0.3, 0.4])  # as written before these columns existed, or a Gemma model
    with pytest.raises(PrunetoolError, match="no attention_influence for layers \\[0, 1, 2, 3\\]"):
        make_plan("hand", "bi", 1, scores=scores, unit="attention")
    with pytest.raises(OptionError, match="does not rank mlp sublayers"):
        make_plan("hand", "qsim", 1, scores=scores, unit="mlp")
