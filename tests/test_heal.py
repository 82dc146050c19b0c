"""`prunetool heal` on tiny real checkpoints: the loss maths, real training runs, resume, LoRA merge, refusals."""

import json
import math

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from prunetool.cli import app
from prunetool.commands import heal as heal_module
from prunetool.commands.heal import HealRequest, repeated_windows, run_heal
from prunetool.repair.distill import distill_loss, kl_loss, lr_factor, token_loss
from prunetool.output.runs import load_current_run, record_current_run
from test_prune_cli import assert_refused  # the one-line refusal check prune tests share
from rich.console import Console

runner = CliRunner()
WORDS = ("the ferry crossed twice a day in winter and the harbour master logged ice wind and the names of late "
         "passengers while in summer he logged tourists who asked about the old lighthouse on the hill").split()
SEQ = 16


def prose(words: int, seed: int = 0) -> str:
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(WORDS), (words,), generator=generator).tolist()
    return " ".join(WORDS[i] for i in picks) + "."


@pytest.fixture
def calib_file(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text(prose(3000))
    return path


def prune_tiny(tiny_checkpoint, arch, calib_file, out, layers="2,3"):
    result = runner.invoke(app, ["prune", str(tiny_checkpoint(arch)), "--remove-layers", layers, "--calib",
                                 str(calib_file), "--seq-len", str(SEQ), "--output-dir", str(out)])
    assert result.exit_code == 0, result.output
    return out


def tensors(folder):
    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                found[name] = f.get_tensor(name)
    return found


# ------------------------------------------------------------------------------------------ pure maths

def test_kl_loss_matches_a_slow_reference_with_temperature():
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 11) * 3, torch.randn(2, 5, 11) * 3
    for temperature in (1.0, 0.5, 2.0):
        expected, count = 0.0, 0
        for b in range(2):
            for t in range(5):
                p = [math.exp(v / temperature) for v in teacher[b, t].tolist()]
                q = [math.exp(v / temperature) for v in student[b, t].tolist()]
                p = [v / sum(p) for v in p]
                q = [v / sum(q) for v in q]
                expected += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
                count += 1
        for chunk in (11, 33, 10**6):  # one row per chunk, 3 rows with a ragged last chunk, everything at once
            assert float(kl_loss(student, teacher, temperature, chunk_elements=chunk)) == pytest.approx(
                expected / count * temperature**2, rel=1e-5)
    assert float(kl_loss(teacher, teacher, 2.0)) == pytest.approx(0.0, abs=1e-6)


def test_kl_loss_gradient_is_the_softmax_difference():
    """d/ds of T^2 KL(p_T || q_T), averaged over N tokens, is T (q_T - p_T) / N: the fused form must keep it."""
    torch.manual_seed(2)
    teacher = torch.randn(3, 4, 13) * 2
    for temperature, chunk in ((1.0, 13 * 5), (2.0, 10**6)):  # chunks of 5 rows, and one chunk
        student = (torch.randn(3, 4, 13) * 2).requires_grad_(True)
        kl_loss(student, teacher, temperature, chunk_elements=chunk).backward()
        expected = temperature * (torch.softmax(student.detach() / temperature, -1)
                                  - torch.softmax(teacher / temperature, -1)) / 12
        torch.testing.assert_close(student.grad, expected, rtol=1e-5, atol=1e-7)


def test_distill_loss_mixes_kl_and_next_token_ce():
    torch.manual_seed(1)
    student, teacher = torch.randn(2, 6, 9), torch.randn(2, 6, 9)
    ids = torch.randint(9, (2, 6))
    kl = kl_loss(student[:, :-1], teacher[:, :-1], 2.0)
    ce = torch.nn.functional.cross_entropy(student[:, :-1].reshape(-1, 9), ids[:, 1:].reshape(-1))
    mixed = distill_loss(student, teacher, ids, temperature=2.0, ce_weight=0.25)
    assert float(mixed) == pytest.approx(float(0.75 * kl + 0.25 * ce), rel=1e-6)
    assert float(distill_loss(student, teacher, ids, ce_weight=1.0)) == pytest.approx(float(ce), rel=1e-6)


def _autograd_mix(student, teacher, targets, temperature, ce_weight):
    """The slow, independent form: autograd through log_softmax, kl_div and cross_entropy on float copies."""
    vocab = student.shape[-1]
    s, t = student.float().reshape(-1, vocab), teacher.float().reshape(-1, vocab)
    kl = torch.nn.functional.kl_div(torch.log_softmax(s / temperature, -1), torch.log_softmax(t / temperature, -1),
                                    reduction="batchmean", log_target=True) * temperature**2
    ce = torch.nn.functional.cross_entropy(s, targets.reshape(-1))
    return (1 - ce_weight) * kl + ce_weight * ce


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mix_matches_autograd_in_value_and_gradient(dtype):
    """KL and CE share one chunked pass: value and gradient equal autograd's for every mix, temperature and chunking."""
    torch.manual_seed(3)
    teacher = (torch.randn(2, 7, 17) * 2).to(dtype)
    targets = torch.randint(17, (2, 7))
    tolerance = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    for temperature in (1.0, 2.0):
        for ce_weight in (0.0, 0.3, 1.0):
            for chunk in (17, 17 * 4, 10**6):  # a row per chunk, ragged chunks of 4 rows, one chunk
                start = (torch.randn(2, 7, 17) * 2).to(dtype)
                fused, reference = start.clone().requires_grad_(True), start.clone().requires_grad_(True)
                value = token_loss(fused, None if ce_weight == 1 else teacher, None if ce_weight == 0 else targets,
                                   temperature=temperature, ce_weight=ce_weight, chunk_elements=chunk)
                expected = _autograd_mix(reference, teacher, targets, temperature, ce_weight)
                value.backward()
                expected.backward()
                assert float(value.detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
                assert fused.grad.dtype == dtype
                torch.testing.assert_close(fused.grad.float(), reference.grad.float(), **tolerance)


def test_plain_fine_tuning_needs_no_teacher():
    torch.manual_seed(4)
    student, ids = torch.randn(2, 6, 9), torch.randint(9, (2, 6))
    ce = torch.nn.functional.cross_entropy(student[:, :-1].reshape(-1, 9), ids[:, 1:].reshape(-1))
    assert float(distill_loss(student, None, ids, ce_weight=1.0)) == pytest.approx(float(ce), rel=1e-6)
    with pytest.raises(ValueError, match="ce_weight"):
        token_loss(student, student, ids, ce_weight=1.5)


def test_schedule_warms_up_linearly_then_decays_by_cosine():
    factors = [lr_factor(step, 10, 2) for step in range(10)]
    assert factors[:2] == [0.5, 1.0]
    assert factors[2] == pytest.approx(1.0) and all(a > b for a, b in zip(factors[2:], factors[3:]))
    assert factors[-1] > 0 and lr_factor(6, 10, 2) == pytest.approx(0.5)


# ------------------------------------------------------------------------------------------ real runs

def test_heal_lowers_the_loss_and_records_everything(tiny_checkpoint, calib_file, tmp_path):
    pruned = prune_tiny(tiny_checkpoint, "llama", calib_file, tmp_path / "pruned")
    out = tmp_path / "healed"
    result = runner.invoke(app, ["heal", "--train", "all", "--tokens", "2048", "--seq-len", "32", "--batch-size", "2",
                                 "--lr", "1e-3", "--ce-weight", "0", "--output-dir", str(out), "--json"])
    assert result.exit_code == 0, result.output
    heal = json.loads(result.stdout)["heal"]
    curve = [loss for _, loss in heal["loss_summary"]["curve"]]
    assert heal["steps"] == 32 and heal["tokens"] == 2048
    assert heal["loss_summary"]["mean_last_10pct"] < 0.8 * heal["loss_summary"]["first"], curve
    assert heal["perplexity"]["after"] < heal["perplexity"]["before"]
    held = heal["perplexity"]["held_out"]
    assert heal["data"]["first_token"] == held["last_token"] + 1 > held["first_token"]
    record = json.loads((out / "prune.json").read_text())
    assert record["heal"]["tensors"] and record["removed"] == [2, 3]
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 4
    assert "## Healed by distillation" in (out / "README.md").read_text()
    assert load_current_run()["pruned"]["healed"]["path"] == str(out.resolve())
    assert not (tmp_path / "healed.checkpoint").exists()
    assert json.loads(result.stdout)["verification"]["perplexity"] == pytest.approx(heal["perplexity"]["after"],
                                                                                     rel=1e-4)


def test_heal_defaults_to_half_kl_half_cross_entropy(tiny_checkpoint, calib_file, tmp_path):
    """The default loss mixes in the text's next token (docs/repair.md); its CE half has a floor (the text's
    entropy under a 4-layer model), so it falls less than pure KL does, but it falls."""
    prune_tiny(tiny_checkpoint, "llama", calib_file, tmp_path / "pruned")
    result = runner.invoke(app, ["heal", "--train", "all", "--tokens", "2048", "--seq-len", "32", "--batch-size", "2",
                                 "--lr", "1e-3", "--output-dir", str(tmp_path / "healed"), "--json"])
    assert result.exit_code == 0, result.output
    heal = json.loads(result.stdout)["heal"]
    assert heal["ce_weight"] == 0.5 and "--ce-weight 0.5" in heal["command"]
    assert heal["loss_summary"]["mean_last_10pct"] < 0.95 * heal["loss_summary"]["first"]
    assert heal["perplexity"]["after"] < heal["perplexity"]["before"]


def test_repeated_windows_keep_the_first_pass_and_permute_each_later_one():
    unique = torch.arange(5).unsqueeze(1).expand(5, 3)
    rows = repeated_windows(unique, 12, seed=0)
    assert rows.shape == (12, 3) and torch.equal(rows[:5], unique)
    assert sorted(rows[5:10, 0].tolist()) == list(range(5)) and rows[10:, 0].tolist() != [0, 1]
    assert torch.equal(rows, repeated_windows(unique, 12, seed=0))
    assert not torch.equal(rows, repeated_windows(unique, 12, seed=1))
    assert torch.equal(repeated_windows(unique, 3, seed=0), unique[:3])


def test_epochs_read_a_third_of_the_text_and_record_it(pruned_llama, tmp_path):
    out = tmp_path / "healed"
    result = runner.invoke(app, ["heal", str(pruned_llama), "--train", "lora", "--tokens", "1536", "--epochs", "3",
                                 "--seq-len", "32", "--batch-size", "2", "--output-dir", str(out), "--json"])
    assert result.exit_code == 0, result.output
    heal = json.loads(result.stdout)["heal"]
    assert heal["tokens"] == 1536 and heal["steps"] == 24
    assert heal["data"]["windows"] == 16 and heal["data"]["epochs"] == 3
    assert heal["data"]["last_token"] - heal["data"]["first_token"] + 1 == 16 * 32
    assert "--epochs 3" in heal["command"] and "3 passes over 16 windows" in (out / "README.md").read_text()


def request_for(pruned, out, **extra):
    options = dict(model=str(pruned), tokens=6 * 2 * 24, seq_len=24, batch_size=2, train="adjacent", lr=1e-3,
                   output=out, checkpoint_dir=out.parent / "ckpt", save_every=2)
    return HealRequest(**(options | extra))


@pytest.mark.parametrize("train", ["adjacent", "lora"])
def test_resume_reproduces_the_uninterrupted_run_exactly(train, tiny_checkpoint, calib_file, tmp_path, monkeypatch):
    pruned = prune_tiny(tiny_checkpoint, "qwen2", calib_file, tmp_path / "pruned", layers="1,2")
    console = Console(stderr=True, quiet=True)
    whole = run_heal(request_for(pruned, tmp_path / "whole", train=train), console)
    assert len(whole["losses"]) == 6

    real = heal_module.report_step

    def interrupt(progress, task, step, loss):
        real(progress, task, step, loss)
        if step == 5:
            raise KeyboardInterrupt

    monkeypatch.setattr(heal_module, "report_step", interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_heal(request_for(pruned, tmp_path / "resumed", train=train), console)
    assert not (tmp_path / "resumed").exists() and (tmp_path / "ckpt" / "state.pt").exists()
    monkeypatch.setattr(heal_module, "report_step", real)
    resumed = run_heal(request_for(pruned, tmp_path / "resumed", train=train, resume=True), console)
    assert resumed["heal"]["resumed_from_step"] == 4
    assert resumed["losses"] == whole["losses"]
    first, second = tensors(tmp_path / "whole"), tensors(tmp_path / "resumed")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    with pytest.raises(Exception, match="different heal run"):  # a checkpoint of other options is refused
        monkeypatch.setattr(heal_module, "report_step", interrupt)
        with pytest.raises(KeyboardInterrupt):
            run_heal(request_for(pruned, tmp_path / "third", train=train), console)
        run_heal(request_for(pruned, tmp_path / "third", train=train, resume=True, lr=5e-4), console)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"])
def test_lora_checkpoint_equals_a_hand_merge_of_the_same_adapters(arch, tiny_checkpoint, calib_file, tmp_path):
    from transformers import AutoModelForCausalLM

    pruned = prune_tiny(tiny_checkpoint, arch, calib_file, tmp_path / "pruned")
    out = tmp_path / "healed"
    result = run_heal(HealRequest(model=str(pruned), train="lora", tokens=4 * 32, seq_len=32, lr=1e-2, output=out),
                      Console(stderr=True, quiet=True))
    adapters = result["adapters"]
    assert adapters and all(float(a["B"].abs().max()) > 0 for a in adapters.values())
    reference = AutoModelForCausalLM.from_pretrained(pruned, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, adapter in adapters.items():  # W + B @ A * scale, by hand
            module = reference.get_submodule(name)
            module.weight += adapter["B"] @ adapter["A"] * adapter["scale"]
    healed = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert len(healed.model.layers) == 4 and healed.config.num_hidden_layers == 4
    ids = torch.randint(100, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = reference(ids).logits, healed(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(pruned, dtype=torch.float32).eval()(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-4)  # the adapters did change the model
    before, after = tensors(pruned), tensors(out)
    changed = set(result["heal"]["tensors"])
    assert changed == {f"{name}.weight" for name in adapters} and before.keys() == after.keys()
    for name in before:
        if name not in changed:  # untouched tensors: byte-identical
            assert before[name].dtype == after[name].dtype and before[name].view(torch.uint8).equal(
                after[name].view(torch.uint8)), name


# ------------------------------------------------------------------------------------------ refusals

def test_no_pruned_model_in_the_current_run_is_refused(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = tiny_checkpoint("llama")
    record_current_run("llama", source, None, {}, pruned=None)
    assert_refused(runner.invoke(app, ["heal", "--tokens", "64"]), "no pruned model")
    assert not list(tmp_path.iterdir())


@pytest.fixture
def pruned_llama(tiny_checkpoint, calib_file, tmp_path):
    return prune_tiny(tiny_checkpoint, "llama", calib_file, tmp_path / "pruned")


@pytest.mark.parametrize("args,words", [
    (["--tokens", "0"], ["--tokens"]),
    (["--tokens", "-5"], ["--tokens"]),
    (["--tokens", "1000000"], ["calibration text too short for --tokens 1000000", "tokens after the held-out"]),
    (["--train", "half"], ["--train"]),
    (["--ce-weight", "2"], ["--ce-weight"]),
    (["--epochs", "0"], ["--epochs"]),
    (["--tokens", "1000000", "--epochs", "3"], ["calibration text too short for --tokens 1000000", "raise --epochs"]),
])
def test_bad_options_are_refused_and_nothing_is_published(args, words, pruned_llama, tmp_path):
    out = tmp_path / "healed"
    result = runner.invoke(app, ["heal", str(pruned_llama), "--seq-len", "32", *args, "--output-dir", str(out)])
    assert_refused(result, *words, nothing_at=out)
    assert not (tmp_path / "healed.checkpoint").exists()


def test_a_teacher_with_another_tokenizer_is_refused(pruned_llama, tiny_checkpoint, tmp_path):
    import shutil

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_checkpoint("llama"), teacher)
    data = json.loads((teacher / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # same size, two ids swapped
    (teacher / "tokenizer.json").write_text(json.dumps(data))
    out = tmp_path / "healed"
    result = runner.invoke(app, ["heal", str(pruned_llama), "--teacher", str(teacher), "--tokens", "64",
                                 "--seq-len", "32", "--output-dir", str(out)])
    assert_refused(result, "tokenizer", nothing_at=out)


def test_existing_output_needs_force(pruned_llama, tmp_path):
    out = tmp_path / "healed"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    args = ["heal", str(pruned_llama), "--tokens", "64", "--seq-len", "32", "--output-dir", str(out)]
    assert_refused(runner.invoke(app, args), "--force")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert runner.invoke(app, [*args, "--force"]).exit_code == 0
    assert (out / "prune.json").exists() and not (out / "keep.txt").exists()


def test_a_nan_loss_stops_training_and_publishes_nothing(pruned_llama, tmp_path, monkeypatch):
    from prunetool.repair import train as train_module

    monkeypatch.setattr(train_module, "distill_loss", lambda *a, **k: torch.tensor(float("nan"), requires_grad=True))
    out = tmp_path / "healed"
    result = runner.invoke(app, ["heal", str(pruned_llama), "--tokens", "64", "--seq-len", "32", "--output-dir",
                                 str(out)])
    assert result.exit_code != 0 and not out.exists()
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "loss became nan at step 1" in errors[0], result.stderr


def test_eval_with_no_model_shows_base_pruned_patched_and_healed(tiny_checkpoint, calib_file, tmp_path):
    """A patched and healed run: the plain cut is rebuilt in memory and must score what prune recorded for it."""
    out = tmp_path / "patched"
    result = runner.invoke(app, ["prune", str(tiny_checkpoint("qwen3")), "--remove-layers", "2,3", "--patch",
                                 "--patch-windows", "8", "--calib", str(calib_file), "--seq-len", str(SEQ),
                                 "--output-dir", str(out)])
    assert result.exit_code == 0, result.output
    healed = tmp_path / "healed"
    result = runner.invoke(app, ["heal", "--train", "all", "--tokens", "256", "--seq-len", "32", "--lr", "1e-3",
                                 "--output-dir", str(healed)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["eval", "--tasks", "heldout_ppl", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert list(report["models"]) == ["base", "pruned", "patched", "healed"]
    models = report["models"]
    assert models["pruned"]["removed_in_memory"] == [2, 3] and models["patched"]["path"] == str(out.resolve())
    record = json.loads((out / "prune.json").read_text())["perplexity"]
    ppl = {label: entry["heldout_ppl"]["perplexity"] for label, entry in models.items()}
    assert ppl["base"] == pytest.approx(record["before"], rel=1e-4)
    assert ppl["pruned"] == pytest.approx(record["plain_cut"], rel=1e-4)
    assert ppl["patched"] == pytest.approx(record["patched"], rel=1e-4) and ppl["patched"] != ppl["pruned"]
    after = json.loads((healed / "prune.json").read_text())["heal"]["perplexity"]["after"]
    assert ppl["healed"] == pytest.approx(after, rel=1e-4)


def test_eval_refuses_a_healed_model_that_is_gone(pruned_llama, tmp_path):
    out = tmp_path / "healed"
    assert runner.invoke(app, ["heal", "--train", "all", "--tokens", "64", "--seq-len", "32",
                               "--output-dir", str(out)]).exit_code == 0
    import shutil

    shutil.rmtree(out)
    assert_refused(runner.invoke(app, ["eval", "--tasks", "heldout_ppl"]), "healed model", "is gone")


def test_heal_in_bfloat16_trains_under_autocast_and_verifies_in_bfloat16(pruned_llama, tmp_path):
    out = tmp_path / "healed"
    result = runner.invoke(app, ["heal", "--train", "all", "--tokens", "2048", "--seq-len", "32", "--batch-size", "2",
                                 "--lr", "1e-3", "--ce-weight", "0", "--dtype", "bfloat16", "--output-dir", str(out),
                                 "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    heal = report["heal"]
    assert heal["loss_summary"]["mean_last_10pct"] < 0.8 * heal["loss_summary"]["first"]
    assert heal["perplexity"]["after_dtype"] == "bfloat16" and heal["perplexity"]["after"] < heal["perplexity"]["before"]
    assert report["verification"]["dtype"] == "bfloat16" and heal["compute"] == "float32 weights under bfloat16 autocast"
    assert "--dtype bfloat16" in heal["command"]
