"""KV-cache budgets applied: schedules, SnapKV-style compression on every tiny architecture, long-context tasks,
`eval --kv-budget`. References are independent: transformers' own forward and generate, and its eager
attention weights (output_attentions) for the window scores."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from handset_heads import build_handset_model
from test_eval import FAST_CALIB, calib_file  # noqa: F401  (a fixture)
from prunetool.cli import app
from prunetool.errors import OptionError
from prunetool.evaluation import long_context
from prunetool.evaluation.kv_eval import encode_pair
from prunetool.kv import snapkv
from prunetool.kv.schedules import KINDS, layer_budgets, parse_schedule, pyramid_weights
from tiny_models import ARCHITECTURES, SLIDING_WINDOW

runner = CliRunner()
PROMPT = 40
CONTINUATIONS = [[5, 7, 9], [11, 13], [17]]


def load(path, dtype=torch.float32, attn=None):
    kwargs = {"attn_implementation": attn} if attn else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).eval()


def prompt_ids(length: int = PROMPT, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 300) for _ in range(length)]


def reference_logprobs(model, ids: list[int], continuations: list[list[int]]) -> list[float]:
    """Plain transformers forward over prompt + continuation, no cache tricks."""
    totals = []
    with torch.no_grad():
        for continuation in continuations:
            logits = model(torch.tensor([ids + continuation])).logits.float().log_softmax(-1)[0]
            totals.append(sum(float(logits[len(ids) - 1 + i, token]) for i, token in enumerate(continuation)))
    return totals


# ---- schedules (pure) ----

@pytest.mark.parametrize("kind", KINDS)
def test_schedules_sum_exactly_and_respect_caps(kind):
    rng = random.Random(kind)
    for _ in range(50):
        layers = rng.randint(1, 30)
        length = rng.randint(40, 5000)
        window = rng.choice([None, 64, 512])
        caps = [min(length, window - 1) if window and rng.random() < 0.7 else length for _ in range(layers)]
        budget = rng.randint(1, max(1, sum(caps) // layers))
        schedule = parse_schedule(f"{kind}:{budget}", num_layers=layers, max_context=8192)
        similarity = [rng.uniform(-0.1, 1.0) for _ in range(layers)]
        preference = [rng.uniform(0.0, 3.0) for _ in range(layers)]
        full = [cap == length for cap in caps]
        budgets = layer_budgets(schedule, caps, q_similarity=similarity, preference=preference, full_attention=full)
        assert sum(budgets) == budget * layers
        assert all(0 <= b <= cap for b, cap in zip(budgets, caps))
        if kind == "tappa-floor" and not all(full):
            assert all(b >= min(budget, cap) for b, cap, f in zip(budgets, caps, full) if f)


def test_schedules_keep_everything_when_the_layers_hold_less_than_the_total():
    schedule = parse_schedule("uniform:500", num_layers=3, max_context=8192)
    assert layer_budgets(schedule, [100, 300, 400]) == [100, 300, 400]


def test_schedule_shapes():
    caps = [10_000] * 5
    assert layer_budgets(parse_schedule("uniform:100", num_layers=5, max_context=8192), caps) == [100] * 5
    pyramid = layer_budgets(parse_schedule("pyramid:100", num_layers=5, max_context=8192), caps)
    assert pyramid == sorted(pyramid, reverse=True) and pyramid[0] > 150 and pyramid[-1] == 5  # 2B - B/20 ... B/20
    assert sum(pyramid_weights(7)) == pytest.approx(7)
    tappa = layer_budgets(parse_schedule("tappa:100", num_layers=5, max_context=8192), caps,
                          q_similarity=[0.9, 0.1, 0.5, 0.5, 0.0])
    assert tappa[1] > tappa[2] == tappa[3] > tappa[0] and tappa[4] > tappa[1]
    assert tappa[4] / tappa[0] == pytest.approx(10, rel=0.05)  # shares proportional to 1 - q


def test_tappa_floor_gives_full_attention_layers_the_average_at_least():
    caps = [511, 511, 4000, 511, 511, 4000]
    similarity = [0.1, 0.1, 0.9, 0.1, 0.1, 0.9]  # the global layers look stable: TAPPA starves them
    full = [False, False, True, False, False, True]
    plain = layer_budgets(parse_schedule("tappa:128", num_layers=6, max_context=8192), caps, q_similarity=similarity)
    floored = layer_budgets(parse_schedule("tappa-floor:128", num_layers=6, max_context=8192), caps,
                            q_similarity=similarity, full_attention=full)
    assert plain[2] < 128 and floored[2] >= 128 and floored[5] >= 128
    assert sum(plain) == sum(floored) == 128 * 6


def test_schedule_file_from_heads_and_plain_list(tmp_path):
    (tmp_path / "kv_budget.json").write_text(json.dumps({"format": "prunetool-kv-budget/1", "budgets": [10, 20, 30]}))
    (tmp_path / "list.json").write_text("[5, 6, 7]")
    schedule = parse_schedule(str(tmp_path / "kv_budget.json"), num_layers=3, max_context=100)
    assert schedule.kind == "file" and schedule.budget == 20
    assert layer_budgets(schedule, [15, 100, 100]) == [10, 20, 30]
    assert layer_budgets(parse_schedule(str(tmp_path / "list.json"), num_layers=3, max_context=100), [6, 6, 6]) == [5, 6, 6]


@pytest.mark.parametrize("text, message", [
    ("uniform:0", "at least 1 token"),
    ("pyramid:-3", "at least 1 token"),
    ("tappa:5000", "more than the model's context"),
    ("uniform:abc", "whole number"),
    ("cubic:64", "neither"),
])
def test_bad_schedules_are_refused(text, message):
    with pytest.raises(OptionError, match=message):
        parse_schedule(text, num_layers=4, max_context=4096)


def test_schedule_file_for_another_layer_count_is_refused(tmp_path):
    path = tmp_path / "budgets.json"
    path.write_text(json.dumps({"budgets": [8, 8, 8]}))
    with pytest.raises(OptionError, match="3 layers; this model has 4"):
        parse_schedule(str(path), num_layers=4, max_context=4096)
    path.write_text('{"budgets": [8, "x", 8, 8]}')
    with pytest.raises(OptionError, match="whole-token budgets"):
        parse_schedule(str(path), num_layers=4, max_context=4096)


# ---- the compression itself ----

def test_keep_positions_keeps_the_window_then_the_best_scores():
    scores = torch.zeros(2, 20)
    scores[0, 3], scores[1, 11] = 5.0, 7.0
    kept = snapkv.keep_positions(scores, 5, window=4)
    assert kept[0].tolist() == [3, 16, 17, 18, 19] and kept[1].tolist() == [11, 16, 17, 18, 19]
    # at or below the window, everything competes on its score
    assert snapkv.keep_positions(scores, 1, window=4)[:, 0].tolist() == [3, 11]
    # a position outside the sliding window is never kept
    assert 3 not in snapkv.keep_positions(scores, 5, window=2, first_visible=8)[0].tolist()
    assert snapkv.keep_positions(scores, 30, window=4).shape == (2, 20)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_budget_at_or_above_the_prompt_matches_the_uncompressed_model(tiny_checkpoint, arch):
    """Logits and greedy generations through the kept cache equal transformers' own forward and generate."""
    model = load(tiny_checkpoint(arch, num_layers=4))
    ids = prompt_ids()
    prefilled = snapkv.prefill(model, ids, window=4)
    full = snapkv.full_cache(prefilled)
    schedule = parse_schedule(f"uniform:{PROMPT}", num_layers=4, max_context=4096)
    kept = snapkv.compress(prefilled, layer_budgets(schedule, prefilled.caps))
    ours = snapkv.continuation_logprobs(model, kept, prefilled.last_token, CONTINUATIONS)
    assert ours == snapkv.continuation_logprobs(model, full, prefilled.last_token, CONTINUATIONS)
    reference = reference_logprobs(model, ids, CONTINUATIONS)
    assert ours == pytest.approx(reference, rel=1e-5, abs=1e-5)
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    generated = snapkv.greedy_generate(model, snapkv.compress(prefilled, layer_budgets(schedule, prefilled.caps)),
                                       prefilled.last_token, 8)
    assert generated == [expected[0, len(ids):].tolist()]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen2"])
def test_full_budget_matches_in_bfloat16(tiny_checkpoint, arch):
    model = load(tiny_checkpoint(arch, num_layers=4), dtype=torch.bfloat16)
    ids = prompt_ids()
    prefilled = snapkv.prefill(model, ids, window=4)
    assert prefilled.layers[0].keys.dtype == torch.bfloat16
    ours = snapkv.continuation_logprobs(model, snapkv.full_cache(prefilled), prefilled.last_token, CONTINUATIONS)
    reference = reference_logprobs(model, ids, CONTINUATIONS)
    assert ours == pytest.approx(reference, rel=0.03, abs=0.05)  # bfloat16 rounding, different kernels


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_window_scores_equal_eager_attention_weights(tiny_checkpoint, arch):
    """Scores = attention the last `window` queries pay each key (transformers' eager weights), group-averaged."""
    model = load(tiny_checkpoint(arch, num_layers=4), attn="eager")
    ids = prompt_ids()
    window = 6
    prefilled = snapkv.prefill(model, ids, window=window)
    with torch.no_grad():
        attentions = model(torch.tensor([ids[:-1]]), output_attentions=True).attentions
    for layer, weights in zip(prefilled.layers, attentions):
        heads, kv_heads = weights.shape[1], layer.keys.shape[1]
        rows = weights[0, :, -window:, :].double()
        expected = rows.sum(1).view(kv_heads, heads // kv_heads, -1).mean(1)
        torch.testing.assert_close(layer.scores, expected.float(), rtol=1e-5, atol=1e-6)
        entropy = float(-(rows * rows.clamp_min(1e-30).log()).sum(-1).mean())
        shift = float(rows.var(dim=1, unbiased=False).sum(-1).mean())
        assert layer.dispersion == pytest.approx(entropy, rel=1e-4)
        assert layer.shift == pytest.approx(shift, rel=1e-4, abs=1e-9)


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma2", "gemma3_text", "gemma3"])
def test_sliding_layers_never_keep_more_than_their_window(tiny_checkpoint, arch):
    model = load(tiny_checkpoint(arch, num_layers=6))
    prefilled = snapkv.prefill(model, prompt_ids(), window=2)
    sliding = [layer.sliding_window for layer in prefilled.layers]
    assert any(sliding) and all(w in (None, SLIDING_WINDOW) for w in sliding)
    for kind in KINDS:
        schedule = parse_schedule(f"{kind}:20", num_layers=6, max_context=4096)
        budgets = layer_budgets(schedule, prefilled.caps, q_similarity=prefilled.q_similarity,
                                preference=prefilled.preference, full_attention=prefilled.full_attention)
        kept = snapkv.compress(prefilled, budgets)
        for layer, count, positions in zip(prefilled.layers, kept.kept, kept.positions):
            if layer.sliding_window:
                assert count <= layer.sliding_window - 1
                assert int(positions.min()) >= prefilled.length - (layer.sliding_window - 1)
        assert sum(kept.kept) == sum(budgets) == min(20 * 6, sum(prefilled.caps))


def test_gqa_heads_choose_their_own_positions(tiny_checkpoint):
    model = load(tiny_checkpoint("llama", num_layers=4))
    prefilled = snapkv.prefill(model, prompt_ids(), window=2)
    kept = snapkv.compress(prefilled, [6] * 4)
    assert all(p.shape == (1, 2, 6) for p in kept.positions)  # 4 query heads share 2 KV heads
    assert any(not torch.equal(p[0, 0], p[0, 1]) for p in kept.positions)
    assert all(k.shape == (1, 2, 6, 16) for k in kept.keys)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gemma2"])
def test_stacked_caches_decode_like_each_alone(tiny_checkpoint, arch):
    """Several schedules' caches in one batch (padded per layer) give each cache's own logits and generations."""
    model = load(tiny_checkpoint(arch, num_layers=4))
    prefilled = snapkv.prefill(model, prompt_ids(), window=3)
    budgets = [[3, 9, 5, 20], [7, 7, 7, 7], prefilled.caps]
    alone = [snapkv.next_token_logprobs(model, snapkv.compress(prefilled, b), prefilled.last_token) for b in budgets]
    stacked = snapkv.stack([snapkv.compress(prefilled, b) for b in budgets])
    assert stacked.rows == 3
    together = snapkv.next_token_logprobs(model, stacked, prefilled.last_token)
    torch.testing.assert_close(together, torch.cat(alone), rtol=1e-5, atol=1e-5)
    generated = snapkv.greedy_generate(model, snapkv.stack([snapkv.compress(prefilled, b) for b in budgets]),
                                       prefilled.last_token, 5)
    for row, b in enumerate(budgets):
        assert generated[row] == snapkv.greedy_generate(model, snapkv.compress(prefilled, b), prefilled.last_token, 5)[0]


def test_a_small_budget_changes_the_answer_distribution(tiny_checkpoint):
    """The compressed path is not a no-op: a few tokens per layer move the log-likelihoods."""
    model = load(tiny_checkpoint("llama", num_layers=4))
    prefilled = snapkv.prefill(model, prompt_ids(), window=2)
    full = snapkv.continuation_logprobs(model, snapkv.full_cache(prefilled), prefilled.last_token, CONTINUATIONS)
    small = snapkv.continuation_logprobs(model, snapkv.compress(prefilled, [3] * 4), prefilled.last_token, CONTINUATIONS)
    assert max(abs(a - b) for a, b in zip(full, small)) > 1e-2


@pytest.mark.parametrize("budget", [1, 2, 3, 4])
def test_handset_head_keeps_the_token_it_attends_to(budget):
    """Head 0 of the hand-set model attends to the flagged token (id 0) wherever it is: a budget of a few
    tokens keeps that position, and only the window and best scores besides."""
    model = build_handset_model()
    rng = random.Random(1)
    ids = [rng.randrange(1, 64) for _ in range(64)]
    ids[17] = 0  # the answer token, far from the window
    prefilled = snapkv.prefill(model, ids, window=2)
    kept = snapkv.compress(prefilled, [budget])
    assert 17 in kept.positions[0][0, 0].tolist()
    assert kept.kept == [budget]


# ---- long-context tasks and eval ----

def test_needle_documents_hold_their_answer_at_the_asked_depth(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama", num_layers=4))
    haystack, _ = long_context.load_haystack(None)
    documents = long_context.needle_documents("needle", 256, tokenizer, haystack)
    assert len(documents) == len(long_context.DEPTHS) * long_context.DOCS_PER_DEPTH
    assert [d["depth"] for d in documents[:5]] == list(long_context.DEPTHS)
    for document in documents:
        answer = document["target"].strip()
        assert len(answer) == long_context.DIGITS and document["target"].startswith(" ")
        assert document["prompt"].count(f"is {answer}.") == 1
        tokens = len(tokenizer(document["prompt"])["input_ids"])
        assert 200 <= tokens <= 300
    early = documents[0]["prompt"].index("special magic number for", len(long_context.INTRO))
    late = documents[4]["prompt"].index("special magic number for", len(long_context.INTRO))
    assert early < late
    again = long_context.needle_documents("needle", 256, tokenizer, haystack)
    assert again == documents


def test_multikey_asks_one_key_among_several(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama", num_layers=4))
    haystack, _ = long_context.load_haystack(None)
    for document in long_context.needle_documents("multikey", 300, tokenizer, haystack):
        assert document["prompt"].count("The special magic number for") == long_context.KEYS_IN_MULTIKEY + 1  # + question
        key = document["prompt"].rsplit("special magic number for ", 1)[1].removesuffix(" is")
        assert key in document["keys"] and len(set(document["keys"])) == long_context.KEYS_IN_MULTIKEY
        assert f"{key} is{document['target']}." in document["prompt"]
        for other in document["keys"]:
            assert document["prompt"].count(f"The special magic number for {other} is ") == 1
        assert document["prompt"].endswith(f"The special magic number for {key} is")


def test_long_task_names():
    assert long_context.expand("needle") == ["needle_512", "needle_1024", "needle_2048"]
    assert long_context.expand("multikey_4096") == ["multikey_4096"]
    assert long_context.expand("needle_7") == [] and long_context.expand("wikitext") == []
    assert long_context.parse_name("hop_name_512").kind == "hop_name"


def test_encode_pair_matches_lm_eval_split(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama", num_layers=4))
    context, continuation = encode_pair(tokenizer, "The capital of France is", " Paris")
    assert tokenizer.decode(context + continuation, skip_special_tokens=True) == "The capital of France is Paris"


def test_eval_full_cache_agrees_with_lm_eval_on_hop_probes(tiny_checkpoint):
    """The long-context runner's full cache scores the hop probe documents exactly as lm-eval does."""
    model = str(tiny_checkpoint("qwen2", num_layers=4))
    plain = runner.invoke(app, ["eval", model, "--tasks", "hop_name_16,hop_number_16", "--limit", "12", "--json"])
    assert plain.exit_code == 0, plain.output
    compressed = runner.invoke(app, ["eval", model, "--tasks", "hop_name_16,hop_number_16", "--limit", "12",
                                     "--kv-budget", "uniform:8", "--kv-window", "4", "--json"])
    assert compressed.exit_code == 0, compressed.output
    lm_eval = json.loads(plain.stdout)["models"][model]["lm_eval"]["results"]
    ours = json.loads(compressed.stdout)["models"][model]["long_context"]
    for task in ("hop_name_16", "hop_number_16"):
        assert ours["tasks"][task]["accuracy"]["full"] == pytest.approx(lm_eval[task]["acc,none"])
        assert ours["tasks"][task]["documents"] == 12
    assert ours["columns"] == ["full", "uniform:8"]
    assert ours["cache"]["uniform:8"]["mean_tokens_per_layer"] == 8


def test_eval_kv_budget_reports_every_schedule(tiny_checkpoint, tmp_path):
    model = str(tiny_checkpoint("gemma3_text", num_layers=3))
    budgets = tmp_path / "kv_budget.json"
    budgets.write_text(json.dumps({"budgets": [4, 4, 40]}))
    result = runner.invoke(app, ["eval", model, "--tasks", "needle_128", "--limit", "3", "--kv-budget", "pyramid:8",
                                 "--kv-budget", "tappa-floor:8", "--kv-budget", str(budgets), "--kv-window", "4"])
    assert result.exit_code == 0, result.output
    assert "long-context accuracy by KV cache" in result.stdout
    assert "tappa-floor:8" in result.stdout and "pyramid:8" in result.stdout


@pytest.mark.parametrize("arguments, message", [
    (["--kv-budget", "uniform:0"], "at least 1 token"),
    (["--kv-budget", "uniform:5000"], "more than the model's context (4096)"),
    (["--kv-budget", "uniform:8", "--kv-window", "0"], "--kv-window must be at least 1"),
    (["--kv-budget", "uniform:8", "--tasks", "heldout_ppl"], "run heldout_ppl without it"),
])
def test_eval_kv_budget_refusals(tiny_checkpoint, arguments, message):
    model = str(tiny_checkpoint("llama", num_layers=4))
    if "--tasks" not in arguments:
        arguments = arguments + ["--tasks", "needle_128"]
    result = runner.invoke(app, ["eval", model, *arguments])
    assert result.exit_code == 1
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_eval_kv_budget_file_for_another_layer_count(tiny_checkpoint, tmp_path):
    model = str(tiny_checkpoint("llama", num_layers=4))
    path = tmp_path / "kv.json"
    path.write_text(json.dumps({"budgets": [8] * 6}))
    result = runner.invoke(app, ["eval", model, "--tasks", "needle_128", "--kv-budget", str(path)])
    assert result.exit_code == 1 and "6 layers; this model has 4" in result.output
    assert len(result.output.strip().splitlines()) == 1


# ---- real models ----

@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_real_model_full_budget_matches_forward(name):
    """A 1k-token prompt (past Gemma 3's 512-token sliding window): the kept cache at full budget reproduces
    transformers' forward and generates the needle's value as the model does; a 64-token schedule keeps
    exactly its budget."""
    from prunetool.model.loading import load_model
    from prunetool.sources import resolve_model

    model, tokenizer = load_model(resolve_model(name), dtype="float32", device="cpu")
    haystack, _ = long_context.load_haystack(None)
    document = long_context.needle_documents("needle", 1024, tokenizer, haystack)[2]
    choices = [document["target"], " 123456", " 987650"]
    pairs = [encode_pair(tokenizer, document["prompt"], choice) for choice in choices]
    ids = pairs[0][0]
    prefilled = snapkv.prefill(model, ids)
    ours = snapkv.continuation_logprobs(model, snapkv.full_cache(prefilled), prefilled.last_token, [c for _, c in pairs])
    assert ours == pytest.approx(reference_logprobs(model, ids, [c for _, c in pairs]), rel=1e-4, abs=1e-3)
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=len(pairs[0][1]), do_sample=False)
    generated = snapkv.greedy_generate(model, snapkv.full_cache(prefilled), prefilled.last_token, len(pairs[0][1]))
    assert generated == [expected[0, len(ids):].tolist()]
    layers = len(prefilled.layers)
    schedule = parse_schedule("tappa-floor:64", num_layers=layers, max_context=8192)
    budgets = layer_budgets(schedule, prefilled.caps, q_similarity=prefilled.q_similarity,
                            preference=prefilled.preference, full_attention=prefilled.full_attention)
    assert sum(snapkv.compress(prefilled, budgets).kept) == 64 * layers
    assert all(math.isfinite(q) for q in prefilled.q_similarity)


def test_eval_kv_budget_on_the_current_run_compares_base_and_pruned(tiny_checkpoint, tmp_path, calib_file):
    """With no MODEL each model gets its own schedule (the pruned one has fewer layers); a file for one
    layer count is refused for the other, naming the model."""
    source = tiny_checkpoint("gemma3_text", num_layers=6)
    assert runner.invoke(app, ["score", str(source), "--calib", str(calib_file), *FAST_CALIB]).exit_code == 0
    assert runner.invoke(app, ["prune", "--drop", "2", "--output", str(tmp_path / "pruned")]).exit_code == 0
    result = runner.invoke(app, ["eval", "--tasks", "needle_128", "--limit", "2", "--kv-budget", "tappa-floor:6",
                                 "--kv-window", "2", "--json"])
    assert result.exit_code == 0, result.output
    models = json.loads(result.stdout)["models"]
    assert list(models) == ["base", "pruned"]
    for label in models:
        assert models[label]["long_context"]["cache"]["tappa-floor:6"]["mean_tokens_per_layer"] == 6
    path = tmp_path / "four.json"
    path.write_text(json.dumps([5, 5, 5, 5]))
    refused = runner.invoke(app, ["eval", "--tasks", "needle_128", "--kv-budget", str(path)])
    assert refused.exit_code == 1 and "this model has 6 (model base)" in refused.output
