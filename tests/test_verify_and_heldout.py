"""Verification in the user's dtype, held-out windows that never overlap the selection windows, and
`--remove-layers` doing no needless work; all on tiny real checkpoints through the CLI.

Numbers these tests lean on (tiny models, CPU, measured when they were written): reloading in the same
dtype reproduces the in-memory perplexity exactly; cached vs uncached log-probabilities differ by at
most 0.10 in bfloat16 and 0.018 in float16 (CACHE_LOGPROB_ATOL is 2.0: SmolLM2-135M's rounding reaches
0.54), while a stale layer index moves them by 5 to 9.5; swapping layers 0 and 2 of the pruned llama
moves its perplexity by ~19%.
"""

import hashlib
import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from prunetool.select.calibration import HOLDOUT_WINDOWS, SMALL_RUNG_UNIT, heldout_start, load_calibration
from prunetool.cli import app
from test_prune_cli import assert_refused  # the one-line refusal check prune tests share
from prunetool.errors import VerificationError
from prunetool.checkpoint.verify import CACHE_LOGPROB_ATOL, PERPLEXITY_RTOL, PROMPT_TOKENS, VerifySetting, cached_logprob_gap, \
    greedy, verify_checkpoint

runner = CliRunner()
PROSE = ("The ferry crossed twice a day; in winter the harbour master logged ice, wind and the names of "
         "late passengers, and in summer he logged tourists who asked about the lighthouse. ") * 30
OTHER_PROSE = ("Bees keep the hive warm in winter by shivering their flight muscles, and the cluster moves "
               "slowly across the comb as the honey near it runs out. ") * 30
SEQ = 16
BF16_ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"]


@pytest.fixture
def calib_file(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text(PROSE)
    return path


@pytest.fixture
def other_calib(tmp_path):
    path = tmp_path / "other.txt"
    path.write_text(OTHER_PROSE)
    return path


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def invoke(*args):
    return runner.invoke(app, [str(arg) for arg in args])


def ok(result):
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return result


def prune_json(folder) -> dict:
    return json.loads((folder / "prune.json").read_text())


def tokenizer_of(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def manual_prune(source, out, calib, dtype: str) -> dict:
    """`prune --remove-layers 1,3` in `dtype` on the CPU with verification; returns the --json report."""
    result = ok(invoke("prune", source, "--remove-layers", "1,3", "--dtype", dtype, "--device", "cpu",
                       "--output-dir", out, "--calib", calib, "--seq-len", SEQ, "--json"))
    return json.loads(result.stdout)


def held_out_of(folder, calib) -> torch.Tensor:
    """What a --remove-layers prune holds out: 4 windows from token 0 (no selection windows)."""
    return load_calibration(str(calib), tokenizer_of(folder), seq_len=SEQ, samples=0, holdout=HOLDOUT_WINDOWS).held_out


# ---------------------------------------------------------------- 1. verification in the user's dtype

@pytest.mark.parametrize("arch", BF16_ARCHS)
def test_bfloat16_prune_verifies_in_bfloat16(arch, tiny_checkpoint, calib_file, tmp_path):
    out = tmp_path / "pruned"
    report = manual_prune(tiny_checkpoint(arch), out, calib_file, "bfloat16")
    recorded = prune_json(out)["verification"]
    assert recorded["dtype"] == "bfloat16" and recorded["device"] == "cpu"
    assert recorded["perplexity_rtol"] == 0.005 == PERPLEXITY_RTOL[torch.bfloat16]
    assert recorded["cache_logprob_atol"] == CACHE_LOGPROB_ATOL
    assert recorded["passed_before_publishing"]
    checked = report["verification"]
    assert checked["dtype"] == "bfloat16" and checked["layers"] == 4
    assert "cached_generation_matches" not in checked  # half precision compares log-probs, not tokens
    assert 0 <= checked["cached_logprob_gap"] <= min(0.25, CACHE_LOGPROB_ATOL)  # measured <= 0.10
    assert checked["perplexity"] == pytest.approx(report["perplexity"]["after"], rel=0.005)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 4


def test_float32_records_its_own_tolerance_and_bfloat16_really_ran_in_bfloat16(tiny_checkpoint, calib_file,
                                                                               tmp_path):
    source = tiny_checkpoint("llama")
    f32 = manual_prune(source, tmp_path / "f32", calib_file, "float32")
    bf16 = manual_prune(source, tmp_path / "bf16", calib_file, "bfloat16")
    recorded = prune_json(tmp_path / "f32")["verification"]
    assert recorded["dtype"] == "float32" and recorded["perplexity_rtol"] == 1e-4
    assert "cache_logprob_atol" not in recorded
    assert f32["verification"]["cached_generation_matches"] is True
    assert f32["verification"]["perplexity"] == pytest.approx(f32["perplexity"]["after"], rel=1e-4)
    # Same windows, same layers: only the dtype differs, so a bfloat16 run that silently measured or
    # reloaded in float32 would reproduce float32's numbers.
    assert bf16["perplexity"]["after"] != f32["perplexity"]["after"]
    assert bf16["verification"]["perplexity"] != f32["verification"]["perplexity"]
    assert bf16["perplexity"]["after"] == pytest.approx(f32["perplexity"]["after"], rel=0.05)


@pytest.fixture
def bf16_pruned(tiny_checkpoint, calib_file, tmp_path):
    """A verified bfloat16 --remove-layers 1,3 prune of a tiny model: (folder, report, held-out windows)."""

    def make(arch: str, dtype: str = "bfloat16"):
        out = tmp_path / f"{arch}-{dtype}"
        report = manual_prune(tiny_checkpoint(arch), out, calib_file, dtype)
        return out, report, held_out_of(out, calib_file)

    return make


BF16_CPU = VerifySetting(torch.bfloat16, torch.device("cpu"))


def test_verify_checkpoint_uses_the_bfloat16_tolerance_and_refuses_beyond_it(bf16_pruned):
    out, report, held_out = bf16_pruned("gemma3_text")
    after = report["perplexity"]["after"]

    def check(expected):
        return verify_checkpoint(out, expected_layers=4, held_out=held_out, expected_perplexity=expected,
                                 setting=BF16_CPU)

    assert check(after)["perplexity"] == pytest.approx(after, rel=0.005)
    assert check(after * 1.003)["dtype"] == "bfloat16"  # inside bfloat16's 5e-3, far outside float32's 1e-4
    for wrong in (after * 1.01, after / 1.01, after * 1.1):
        with pytest.raises(VerificationError, match="perplexity.*0.005.*bfloat16 on cpu"):
            check(wrong)


def swap_layers(folder, a: int, b: int) -> None:
    from safetensors.torch import load_file, save_file

    for shard in folder.glob("*.safetensors"):
        tensors = load_file(shard)
        swapped = {}
        for name, tensor in tensors.items():
            for old, new in ((f"layers.{a}.", f"layers.{b}."), (f"layers.{b}.", f"layers.{a}.")):
                if old in name:
                    name = name.replace(old, new)
                    break
            swapped[name] = tensor
        assert swapped.keys() == tensors.keys()
        save_file(swapped, shard, metadata={"format": "pt"})


def edit_config(folder, change) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    change(config.get("text_config", config))
    path.write_text(json.dumps(config, indent=2))


def unpruned_layer_types(config):  # the classic surgery bug: layer_types left at the original length
    config["layer_types"] = config["layer_types"] + ["sliding_attention", "full_attention"]


def flipped_layer_types(config):  # the right length, the wrong kinds (sliding window 8 < 16-token windows)
    config["layer_types"] = ["full_attention" if kind == "sliding_attention" else "sliding_attention"
                             for kind in config["layer_types"]]


@pytest.mark.parametrize("arch,dtype,breakage,words", [
    ("llama", "bfloat16", lambda folder: swap_layers(folder, 0, 2), "perplexity"),  # ~19% off
    ("llama", "bfloat16", lambda folder: edit_config(folder, lambda c: c.update(num_hidden_layers=5)), "5 layers"),
    ("llama", "bfloat16", lambda folder: edit_config(folder, lambda c: c.update(num_hidden_layers=3)), "layers"),
    ("gemma3_text", "bfloat16", lambda folder: edit_config(folder, unpruned_layer_types), "does not reload"),
    # flipped layer types move tiny gemma3's perplexity by only ~2.2%: caught in both dtypes
    ("gemma3_text", "float32", lambda folder: edit_config(folder, flipped_layer_types), "perplexity"),
    ("gemma3_text", "bfloat16", lambda folder: edit_config(folder, flipped_layer_types), "perplexity"),
], ids=["swapped-tensors", "config-5-layers", "config-3-layers", "stale-layer-types", "flipped-layer-types",
        "flipped-layer-types-bf16"])
def test_verify_checkpoint_refuses_a_broken_checkpoint(arch, dtype, breakage, words, bf16_pruned, tmp_path):
    out, report, held_out = bf16_pruned(arch, dtype)
    setting = VerifySetting(getattr(torch, dtype), torch.device("cpu"))
    expected = report["perplexity"]["after"]
    verify_checkpoint(out, expected_layers=4, held_out=held_out, expected_perplexity=expected, setting=setting)
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    breakage(broken)
    with pytest.raises(VerificationError, match=words):
        verify_checkpoint(broken, expected_layers=4, held_out=held_out, expected_perplexity=expected, setting=setting)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text", "phi3"])
def test_half_precision_cache_check_separates_rounding_from_a_stale_layer_index(arch, bf16_pruned):
    """A stale layer index (the bug the cache check exists for) moves log-probs by >5; bf16 rounding by <=0.1.

    (mistral and gemma2 crash with a RuntimeError on a stale index instead: their sliding-window cache
    layers have a fixed size.)
    """
    from transformers import AutoModelForCausalLM

    out, _, held_out = bf16_pruned(arch)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    prompt = held_out[:1, :PROMPT_TOKENS]
    with torch.inference_mode():
        continuation = greedy(model, prompt, use_cache=False)
        assert cached_logprob_gap(model, prompt, continuation, BF16_CPU) <= min(0.25, CACHE_LOGPROB_ATOL)
        model.get_decoder().layers[1].self_attn.layer_idx = 0  # writes into layer 0's cache slot
        with pytest.raises(VerificationError, match="KV cache"):
            cached_logprob_gap(model, prompt, continuation, BF16_CPU)


# ---------------------------------------------------------------- 2. held-out windows never overlap selection

def test_held_out_windows_follow_overlapping_selection_windows(tiny_checkpoint, calib_file):
    tokenizer = tokenizer_of(tiny_checkpoint("llama"))
    samples, stride = 4, 8
    windows = load_calibration(str(calib_file), tokenizer, seq_len=SEQ, stride=stride, samples=samples,
                               holdout=HOLDOUT_WINDOWS)
    stream = tokenizer(PROSE, add_special_tokens=False)["input_ids"]  # the stream, by hand
    first = (samples - 1) * stride + SEQ
    assert heldout_start(SEQ, stride, samples) == first == 40
    assert windows.input_ids.tolist() == [stream[k * stride:k * stride + SEQ] for k in range(samples)]
    assert windows.held_out.tolist() == [stream[first + k * SEQ:first + (k + 1) * SEQ] for k in range(HOLDOUT_WINDOWS)]
    held = windows.describe_held_out()
    assert held["first_token"] == first and held["last_token"] == first + HOLDOUT_WINDOWS * SEQ - 1
    assert held["after_windows"] == samples and held["after_stride"] == stride


def test_prune_holds_out_text_after_the_last_overlapping_selection_window(tiny_checkpoint, calib_file, tmp_path):
    out = tmp_path / "pruned"
    ok(invoke("prune", tiny_checkpoint("llama"), "--drop", "1", "--criterion", "bi", "--calib", calib_file,
              "--seq-len", SEQ, "--stride", 8, "--samples", 4, "--output-dir", out))
    record = prune_json(out)
    assert record["calibration"]["stride"] == 8 and record["calibration"]["windows"] == 4
    held = record["perplexity"]["held_out"]
    last_selection_token = 3 * 8 + SEQ - 1
    assert held["first_token"] == last_selection_token + 1 > last_selection_token
    assert held["windows"] == HOLDOUT_WINDOWS and held["seq_len"] == SEQ and held["sha256"] == sha256(calib_file)


def test_prune_from_a_scores_file_uses_the_scores_calibration(tiny_checkpoint, calib_file, other_calib, tmp_path):
    scores = tmp_path / "S.json"
    ok(invoke("score", tiny_checkpoint("llama"), "--calib", calib_file, "--seq-len", SEQ, "--samples", 4,
              "--output-file", scores))
    out = tmp_path / "pruned"
    ok(invoke("prune", "--scores", scores, "--drop", "1", "--calib", other_calib, "--seq-len", 32,
              "--samples", 2, "--output-dir", out))
    record = prune_json(out)
    assert record["calibration"]["sha256"] == sha256(calib_file) != sha256(other_calib)
    assert record["calibration"]["seq_len"] == SEQ and record["calibration"]["windows"] == 4
    assert record["search_calibration"]["sha256"] == sha256(calib_file)
    assert record["search_calibration"]["seq_len"] == SEQ
    held = record["perplexity"]["held_out"]
    assert held["sha256"] == sha256(calib_file) and held["seq_len"] == SEQ and held["first_token"] == 4 * SEQ


@pytest.mark.parametrize("criterion", ["bi", "qsim"])
def test_scores_only_criteria_also_hold_out_text_after_the_scored_windows(criterion, tiny_checkpoint, calib_file,
                                                                        tmp_path):
    scores = tmp_path / "S.json"
    ok(invoke("score", tiny_checkpoint("llama"), "--calib", calib_file, "--seq-len", SEQ, "--samples", 4,
              "--output-file", scores))
    out = tmp_path / "pruned"
    ok(invoke("prune", "--scores", scores, "--drop", "1", "--criterion", criterion, "--output-dir", out))
    assert prune_json(out)["perplexity"]["held_out"]["first_token"] >= 4 * SEQ


def test_guided_plan_records_the_scores_and_the_search_windows(tiny_checkpoint, calib_file, tmp_path):
    out = tmp_path / "pruned"
    result = ok(invoke("prune", tiny_checkpoint("qwen2"), "--drop", "2", "--calib", calib_file, "--seq-len", SEQ,
                       "--samples", 6, "--refine-windows", 3, "--criterion", "guided", "--output-dir", out, "--json"))
    record = prune_json(out)
    assert record["criterion"] == "guided"
    scored, searched = record["calibration"], record["search_calibration"]
    assert scored["windows"] == 6 and searched["windows"] == 3 == record["parameters"]["refine_windows"]
    assert scored["sha256"] == searched["sha256"] == sha256(calib_file)
    assert searched["seq_len"] == scored["seq_len"] == SEQ
    assert json.loads(result.stdout)["plan"]["search_calibration"] == searched
    assert record["perplexity"]["held_out"]["first_token"] == 6 * SEQ  # after all scored windows


def test_prune_refuses_scores_whose_text_changed(tiny_checkpoint, calib_file, tmp_path):
    scores = tmp_path / "S.json"
    ok(invoke("score", tiny_checkpoint("llama"), "--calib", calib_file, "--seq-len", SEQ, "--samples", 3,
              "--output-file", scores))
    calib_file.write_text(PROSE + " A late edit after scoring.")
    out = tmp_path / "pruned"
    assert_refused(invoke("prune", "--scores", scores, "--drop", "1", "--output-dir", out), "sha256",
                   nothing_at=out)


# ---------------------------------------------------------------- 3. --remove-layers does no needless work

def test_remove_layers_generates_only_a_small_rung(tiny_checkpoint, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("PRUNETOOL_CACHE_DIR", str(cache))
    out = tmp_path / "pruned"
    ok(invoke("prune", tiny_checkpoint("llama"), "--remove-layers", "1", "--seq-len", SEQ, "--output-dir", out))
    generated = sorted(path.name for path in cache.rglob("*-self-seed0-*.jsonl"))
    assert len(generated) == 1 and generated[0].endswith(f"-{SMALL_RUNG_UNIT}.jsonl"), generated
    assert not list(cache.rglob("*-12288.jsonl"))
    held = prune_json(out)["perplexity"]["held_out"]
    assert held["first_token"] == 0 and held["after_windows"] == 0 and held["windows"] == HOLDOUT_WINDOWS


def test_remove_layers_dry_run_loads_no_model(tiny_checkpoint, tmp_path, monkeypatch):
    import prunetool.commands.prune as prune_command

    def refuse(*args, **kwargs):
        raise AssertionError("a --remove-layers dry run loaded something")

    monkeypatch.setattr(prune_command, "load_model", refuse)
    monkeypatch.setattr(prune_command, "load_calibration", refuse)
    out = tmp_path / "never"
    result = ok(invoke("prune", tiny_checkpoint("llama"), "--remove-layers", "1,4", "--dry-run", "--output-dir", out))
    assert "dry run" in result.stdout and "remove" in result.stdout
    result = ok(invoke("prune", tiny_checkpoint("llama"), "--remove-layers", "1,4", "--dry-run", "--json"))
    assert json.loads(result.stdout)["plan"]["removed"] == [1, 4]
    assert not out.exists()


# ---------------------------------------------------------------- 4. eval reuses prune's held-out windows

@pytest.mark.parametrize("prune_args,first_token", [
    (["--remove-layers", "1,3"], 0),
    (["--drop", "1", "--criterion", "bi", "--stride", "8", "--samples", "4"], 40),
], ids=["remove-layers", "scored-stride-8"])
def test_eval_without_model_reuses_the_held_out_windows(prune_args, first_token, tiny_checkpoint, calib_file,
                                                        tmp_path):
    from prunetool.commands.eval import candidates, heldout_windows
    from prunetool.sources import resolve_model

    source = tiny_checkpoint("llama")
    out = tmp_path / "pruned"
    ok(invoke("prune", source, *prune_args, "--calib", calib_file, "--seq-len", SEQ, "--dtype", "float32",
              "--device", "cpu", "--output-dir", out))
    record = prune_json(out)
    held = record["perplexity"]["held_out"]
    assert held["first_token"] == first_token

    _, _, options = candidates([], {})
    tokenizer = tokenizer_of(source)
    windows, description = heldout_windows(resolve_model(str(source)), None, tokenizer, options)
    direct = load_calibration(str(calib_file), tokenizer, seq_len=SEQ, stride=held["after_stride"],
                              samples=held["after_windows"], holdout=HOLDOUT_WINDOWS).held_out
    assert torch.equal(windows, direct)
    stream = tokenizer(PROSE, add_special_tokens=False)["input_ids"]
    assert windows.tolist() == [stream[first_token + k * SEQ:first_token + (k + 1) * SEQ]
                                for k in range(HOLDOUT_WINDOWS)]
    assert f"from token {first_token}" in description

    report_file = tmp_path / "eval.json"
    ok(invoke("eval", "--tasks", "heldout_ppl", "--dtype", "float32", "--device", "cpu", "--output-file",
              report_file))
    models = json.loads(report_file.read_text())["models"]
    assert models["base"]["heldout_ppl"]["perplexity"] == pytest.approx(record["perplexity"]["before"], rel=1e-5)
    assert models["pruned"]["heldout_ppl"]["perplexity"] == pytest.approx(record["perplexity"]["after"], rel=1e-5)
