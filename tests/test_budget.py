"""The cut as a value, exact costs, --target parsing, and the exact solve against brute force."""

import itertools
import random

import pytest

from prunetool.errors import OptionError
from prunetool.select.budget import Candidates, Meter, Timing, parse_targets, solve
from prunetool.select.costs import LayerCosts, kv_bytes_per_layer, layer_params
from prunetool.cut import BLOCK, KEPT, STATES, Cut


# ------------------------------------------------------------------ Cut


def test_a_cut_knows_its_blocks_and_sublayers():
    cut = Cut(8, attention=(1, 3, 4), mlp=(3, 4, 6))
    assert cut.blocks == (3, 4) and cut.attention_only == (1,) and cut.mlp_only == (6,)
    assert cut.states == ["kept", "attention", "kept", "block", "block", "kept", "mlp", "kept"]
    assert cut.kind == "mixed" and not cut.blocks_only and cut.size == 6
    assert cut.kept == (0, 1, 2, 5, 6, 7) and cut.index_map[6] == 4
    rest = cut.after_blocks()
    assert (rest.num_layers, rest.attention, rest.mlp) == (6, (1,), (4,))
    assert cut.describe() == "blocks 3-4, attention 1, MLP 6"
    assert Cut.from_json(cut.to_json()) == cut


@pytest.mark.parametrize("unit, kind, kept", [("block", "block", (0, 1, 4)), ("attention", "attention", (0, 1, 2, 3, 4)),
                                              ("mlp", "mlp", (0, 1, 2, 3, 4))])
def test_a_unit_cut_is_the_old_unit(unit, kind, kept):
    cut = Cut.of(unit, [3, 2], 5)
    assert cut.kind == kind and cut.kept == kept and cut.layers_of(unit) == (2, 3)


def test_bad_cuts_are_refused():
    with pytest.raises(OptionError, match="at least one attention must stay"):
        Cut.of("block", range(4), 4)
    with pytest.raises(OptionError, match="attention sublayers"):
        Cut(4, attention=range(4), mlp=(0,))
    Cut.of("mlp", range(4), 4)  # every MLP may go
    with pytest.raises(OptionError, match=r"in 0\.\.3"):
        Cut(4, attention=(4,))
    with pytest.raises(OptionError, match="distinct"):
        Cut(4, attention=(1, 1))
    with pytest.raises(OptionError, match="unknown layer states"):
        Cut.from_states(["kept", "heads"])


def test_engine_rule_counts_only_the_layers_that_stay():
    with pytest.raises(OptionError, match="vLLM cannot serve this cut: layer 0 keeps its MLP"):
        Cut(6, attention=(0,)).check_engines()
    with pytest.raises(OptionError, match="vLLM"):  # block 0 leaves, so layer 1 becomes the first
        Cut(6, attention=(0, 1), mlp=(0,)).check_engines()
    Cut(6, attention=(0, 2), mlp=(0,)).check_engines()  # layer 1 runs attention first
    Cut.of("block", (0, 1), 6).check_engines()  # a standard folder: no nemotron-nas rule


# ------------------------------------------------------------------ costs


def test_layer_params_from_names():
    numel = {"model.embed_tokens.weight": 100, "model.layers.0.self_attn.q_proj.weight": 10,
             "model.layers.0.input_layernorm.weight": 2, "model.layers.0.mlp.up_proj.weight": 30,
             "model.layers.0.post_attention_layernorm.weight": 2, "model.layers.0.pre_feedforward_layernorm.weight": 2,
             "model.layers.1.self_attn.o_proj.weight": 10, "model.norm.weight": 2}
    attention, mlp, block = layer_params(numel, "model.layers.", 2)
    assert attention == [12, 10] and mlp == [32, 0] and block == [46, 10]


def test_kv_bytes_count_sliding_layers_at_the_context():
    config = {"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
              "head_dim": 16, "sliding_window": 512, "layer_types": ["sliding_attention", "full_attention",
                                                                     "sliding_attention"]}
    full = 2 * 2 * 16 * 2
    assert kv_bytes_per_layer(config, 2) == [full] * 3
    assert kv_bytes_per_layer(config, 2, context=2048) == [full / 4, full, full / 4]


def costs_for(n: int, seed: int = 0) -> LayerCosts:
    rng = random.Random(seed)
    attention = tuple(rng.randrange(50, 150) for _ in range(n))
    mlp = tuple(rng.randrange(200, 400) for _ in range(n))
    block = tuple(a + m + rng.randrange(0, 3) for a, m in zip(attention, mlp))
    return LayerCosts(sum(block) + 1000, attention, mlp, block, tuple(float(rng.choice((64, 128))) for _ in range(n)),
                      2.0)


def test_costs_of_a_cut():
    costs = costs_for(5)
    cut = Cut(5, attention=(1, 2), mlp=(2, 4))
    assert costs.params_removed(cut) == costs.attention_params[1] + costs.block_params[2] + costs.mlp_params[4]
    assert costs.kv(cut) == sum(costs.kv_bytes) - costs.kv_bytes[1] - costs.kv_bytes[2]
    assert costs.memory(cut, 100, 3) == costs.params(cut) * 2.0 + costs.kv(cut) * 300


# ------------------------------------------------------------------ targets


def test_targets_parse():
    params, kv, memory, decode = parse_targets("params=0.85,kv=16KiB,memory=2GiB@ctx=4096,batch=8,decode=1.2x")
    assert (params.name, params.value, params.relative) == ("params", 0.85, True)
    assert (kv.value, kv.relative) == (16384, False)
    assert (memory.value, memory.context, memory.batch) == (2 ** 31, 4096, 8)
    assert (decode.value, decode.is_speed) == (1.2, True)
    assert parse_targets("params=110M")[0].value == 110e6
    assert parse_targets("kv=75%")[0].value == 0.75


@pytest.mark.parametrize("text, words", [
    ("", "empty"), ("size=0.5", "unknown target"), ("params", "no '='"), ("params=abc", "not a number"),
    ("params=1.5", "whole number"), ("kv=3parsecs", "unknown unit"), ("params=0.8,params=0.7", "twice"),
    ("memory=2GiB", "@ctx"), ("decode=0.9x", "at least 1"), ("ctx=4096", "workload"), ("params=0", "above 0"),
    ("memory=1GiB@ctx=0", "whole number"), ("params=100%", "no saving")])
def test_bad_targets_are_one_line(text, words):
    with pytest.raises(OptionError, match=words) as error:
        parse_targets(text)
    assert "\n" not in str(error.value)


# ------------------------------------------------------------------ the exact solve against brute force


def brute_force(meter, targets, damage, candidates, engine_rule=True):
    n = meter.costs.num_layers
    best = None
    for states in itertools.product(STATES, repeat=n):
        if any(state not in candidates.allowed[i] for i, state in enumerate(states)):
            continue
        try:
            cut = Cut.from_states(states)
            if engine_rule and candidates.sublayers:
                cut.check_engines()
        except OptionError:
            continue
        if not all(t.met(meter.base(t), meter.value(t, cut)) for t in targets):
            continue
        total = sum(damage(i, s) for i, s in enumerate(states) if s != KEPT)
        if best is None or total < best[0] - 1e-12:
            best = (total, cut)
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("text", ["params=0.8", "kv=0.6", "params=0.9,kv=0.7", "memory=0.8@ctx=64,batch=2",
                                  "decode=1.25x", "params=0.75,decode=1.1x"])
def test_solve_finds_the_brute_force_optimum(text, seed):
    n = 5
    rng = random.Random(seed)
    costs = costs_for(n, seed)
    timing = Timing(tuple(rng.uniform(1, 2) for _ in range(n)), tuple(rng.uniform(2, 4) for _ in range(n)), 3.0)
    meter = Meter(costs, {"decode": timing})
    table = {(i, s): rng.uniform(0.1, 2.0) * (2.2 if s == BLOCK else 1) for i in range(n) for s in STATES}
    damage = lambda layer, state: table[layer, state]  # noqa: E731
    candidates = Candidates.build(n, protect_first=1 if seed % 2 else 0)
    targets = parse_targets(text)
    cut = solve(meter, targets, damage, candidates)
    expected = brute_force(meter, targets, damage, candidates)
    if expected is None:
        assert cut is None
        return
    assert cut is not None
    found = sum(damage(i, s) for i, s in enumerate(cut.states) if s != KEPT)
    assert found == pytest.approx(expected[0], abs=1e-9)
    assert all(t.met(meter.base(t), meter.value(t, cut)) for t in targets)
    cut.check_engines()


def test_unit_restriction_and_impossible_targets():
    n = 4
    meter = Meter(costs_for(n))
    damage = lambda layer, state: 1.0  # noqa: E731
    blocks = solve(meter, parse_targets("params=0.7"), damage, Candidates.build(n, units=("block",)))
    assert blocks is not None and blocks.blocks_only
    only_attention = Candidates.build(n, units=("attention",))
    assert solve(meter, parse_targets("params=0.5"), damage, only_attention) is None  # attention is too small
