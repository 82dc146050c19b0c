"""`prune --patch`: the fit, the fold, the written checkpoint, the records, bad inputs.

The reference for every architecture is computed here, independently of prunetool.repair: the base
model's hidden states (output_hidden_states) and its MLP outputs (a hook of this file) give Y, M and
L; torch.linalg.lstsq gives T; the layers are removed and down_proj multiplied by T^T by hand.
"""

import json
import random

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from prunetool.select.calibration import load_calibration
from prunetool.cli import app
from prunetool.commands.prune import patch_warning
from prunetool.errors import UnsupportedModelError
from prunetool.model.in_memory import prune_in_memory
from prunetool.select.plan import PrunePlan
from prunetool.repair.patch import (RIDGE, RIDGES, VALIDATE_EVERY, PatchStats, fit_through_norm, fold_down_proj,
                                    fold_embedding, identity_error, norm_relative_error, refine_cosine, relative_error,
                                    select_ridge, solve_patch)
from prunetool.repair.sites import contiguous_runs
from prunetool.checkpoint.surgery import write_pruned_checkpoint
from tiny_models import _CORPUS

runner = CliRunner()
SEQ_LEN, SAMPLES = 32, 12
WORDS = _CORPUS.split()


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    """Varied text (shuffled corpus words): 384 calibration tokens span the tiny models' 64 dimensions."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(" ".join(rng.choice(WORDS) for _ in range(3000)))
    return path


def prune_args(source, out, layers, calib, *extra):
    """--patch-windows SAMPLES: the tiny text is far shorter than the default DEFAULT_PATCH_TOKENS."""
    return ["prune", str(source), "--remove-layers", layers, "--patch", "--calib", str(calib), "--seq-len",
            str(SEQ_LEN), "--samples", str(SAMPLES), "--patch-windows", str(SAMPLES), "--output", str(out),
            "--json", *extra]


def run_patch(source, out, layers, calib, *extra):
    result = runner.invoke(app, prune_args(source, out, layers, calib, *extra))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), result


def windows(source, calib):
    tokenizer = AutoTokenizer.from_pretrained(source)
    return load_calibration(str(calib), tokenizer, seq_len=SEQ_LEN, samples=SAMPLES, holdout=4)


def reference_activations(model, ids, first, last):
    """(M, Y, L, H) over every calibration token, float64, from the unpruned model (float32)."""
    decoder = model.get_decoder()
    taken = {}
    layer = decoder.layers[first - 1]
    hooks = [layer.mlp.register_forward_hook(lambda m, i, o: taken.__setitem__("m", o)),
             layer.mlp.down_proj.register_forward_hook(lambda m, i, o: taken.__setitem__("h", i[0]))]
    norm = getattr(layer, "post_feedforward_layernorm", None)
    if norm is not None:
        hooks.append(norm.register_forward_hook(lambda m, i, o: taken.__setitem__("added", o)))
    ms, ys, ls, hs = [], [], [], []
    try:
        with torch.no_grad():
            for window in ids:
                states = decoder(input_ids=window[None], output_hidden_states=True).hidden_states
                added = taken.get("added", taken["m"])
                ms.append(taken["m"][0])
                hs.append(taken["h"][0])
                ys.append(states[first][0] - added[0])  # states[k] is layer k's input = layer k-1's output
                ls.append(states[last + 1][0])
    finally:
        for hook in hooks:
            hook.remove()
    return tuple(torch.cat(v).double() for v in (ms, ys, ls, hs))


def tensor_bytes(folder):
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out |= {name: t.contiguous().view(torch.uint8) for name, t in load_file(path).items()}
    return out


def load(folder, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


# ------------------------------------------------------------------ the maths


def test_hand_set_linear_block_is_recovered_to_1e6():
    """A removed block whose effect is exactly M T_true: the fit returns T_true (batched accumulation)."""
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(3000, 48, generator=gen, dtype=torch.float64)
    t_true = torch.randn(48, 48, generator=gen, dtype=torch.float64) / 7
    stats = PatchStats.empty(48, 48)
    for chunk in range(0, 3000, 256):
        stats.add(m[chunk:chunk + 256].float().double(), (m[chunk:chunk + 256] @ t_true))
    t = solve_patch(stats)
    assert (t - t_true).abs().max() < 1e-6
    assert relative_error(stats, t) < 1e-6 < identity_error(stats)


def test_fold_equals_applying_the_map_after_down_proj():
    gen = torch.Generator().manual_seed(1)
    down = torch.nn.Linear(40, 16, bias=True).double()
    h = torch.randn(100, 40, generator=gen, dtype=torch.float64)
    t = torch.randn(16, 16, generator=gen, dtype=torch.float64)
    weight, bias = fold_down_proj(down.weight.detach(), t, down.bias.detach())
    assert torch.allclose(down(h).detach() @ t, h @ weight.T + bias, atol=1e-12)
    embedding = torch.randn(30, 16, generator=gen, dtype=torch.float64)
    assert torch.allclose(fold_embedding(embedding, t)[torch.tensor([3, 7])], embedding[[3, 7]] @ t)


def test_cosine_refinement_never_worsens_its_objective():
    gen = torch.Generator().manual_seed(2)
    m, y = torch.randn(500, 12, generator=gen), torch.randn(500, 12, generator=gen)
    l = y + torch.tanh(m @ torch.randn(12, 12, generator=gen))
    stats = PatchStats.empty(12, 12)
    stats.add(m, l - y)
    t, after, before = refine_cosine(solve_patch(stats), m, y, l, steps=30)
    assert after <= before and t.dtype == torch.float64


def test_fit_through_a_norm_recovers_a_reachable_target():
    """Target = norm(H W_true^T): fitting down_proj through the fixed norm gets close, from W."""
    gen = torch.Generator().manual_seed(3)
    norm = torch.nn.RMSNorm(8)
    h, y = torch.randn(400, 20, generator=gen), torch.randn(400, 8, generator=gen)
    w_true, w = torch.randn(8, 20, generator=gen), torch.randn(8, 20, generator=gen)
    with torch.no_grad():
        l = y + norm(h @ w_true.T)
    new, after, before = fit_through_norm(w, h, y, l, norm, objective="lstsq", steps=200)
    assert after < 1e-3 * before
    assert norm_relative_error(new, h, y, l, norm) < 1e-2 < norm_relative_error(w, h, y, l, norm)


def test_ridge_is_chosen_on_held_back_tokens():
    """Exact linear data keeps the smallest ridge; few noisy tokens for many features get a larger one."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2000, 30, generator=gen, dtype=torch.float64)
    w = torch.randn(30, 6, generator=gen, dtype=torch.float64)
    fit, held = PatchStats.empty(30, 6), PatchStats.empty(30, 6)
    fit.add(x[:1600], x[:1600] @ w)
    held.add(x[1600:], x[1600:] @ w)
    ridge, errors = select_ridge(fit, held)
    assert ridge == min(RIDGES) and set(errors) == set(RIDGES)
    assert select_ridge(fit, PatchStats.empty(30, 6)) == (RIDGE, None)  # nothing held back: the default
    x = torch.randn(140, 120, generator=gen, dtype=torch.float64)
    r = x[:, :4] + 3 * torch.randn(140, 4, generator=gen, dtype=torch.float64)
    fit, held = PatchStats.empty(120, 4), PatchStats.empty(120, 4)
    fit.add(x[:125], r[:125])
    held.add(x[125:], r[125:])
    ridge, errors = select_ridge(fit, held)
    assert ridge > 1e-3 and errors[ridge] < errors[min(RIDGES)]
    assert fit.merged(held).tokens == 140 and torch.equal(fit.merged(None).xtx, fit.xtx)


def test_patch_warning_only_when_the_patch_hurts_held_out_text():
    assert patch_warning(50.0, 40.0) is None and patch_warning(50.0, 50.0) is None
    warning = patch_warning(50.0, 61.25)
    assert "50.000 to 61.250" in warning and "\n" not in warning


def test_contiguous_runs():
    assert contiguous_runs([7, 1, 2, 3, 9, 10]) == [(1, 3), (7, 7), (9, 10)]


# ------------------------------------------------------------------ every architecture, end to end

FOLDED = ["llama", "mistral", "qwen2", "qwen3", "phi3"]
THROUGH_NORM = ["gemma2", "gemma3_text"]


@pytest.mark.parametrize("arch", FOLDED + THROUGH_NORM)
def test_patched_checkpoint_equals_an_independent_application(arch, tiny_checkpoint, calib_file, tmp_path):
    source = tiny_checkpoint(arch)
    out = tmp_path / "patched"
    first, last = 2, 3
    report, result = run_patch(source, out, f"{first},{last}", calib_file, "--patch-objective", "lstsq")
    (run,) = report["patch"]["runs"]
    down = f"model.layers.{first - 1}.mlp.down_proj.weight"
    hurt = report["perplexity"]["patched"] > report["perplexity"]["plain_cut"]
    assert ("the patch raised held-out perplexity" in result.stderr) == hurt
    assert run["layers"] == [first, last] and run["tensors"] == [down]
    assert run["residual_error"]["after"] <= run["residual_error"]["before"]
    assert report["perplexity"]["after"] == report["perplexity"]["patched"]
    assert report["perplexity"]["after"] == pytest.approx(report["verification"]["perplexity"], rel=1e-4)

    written = load(out)
    assert len(written.get_decoder().layers) == 4 and written.config.num_hidden_layers == 4
    base = load(source)
    m, y, l, h = reference_activations(base, windows(source, calib_file).input_ids, first, last)
    reference = load(source)
    prune_in_memory(reference, [first, last])
    kept = reference.get_decoder().layers[first - 1].mlp.down_proj
    if arch in FOLDED:
        assert run["action"] == f"folded into {down.removesuffix('.weight')}"
        t = torch.linalg.lstsq(m, l - y).solution
        with torch.no_grad():
            kept.weight.copy_((t.T @ kept.weight.double()).float())
    else:  # no exact fold: the written down_proj is the fit; check it is the base's everything else
        assert run["action"].startswith("fitted through post_feedforward_layernorm")
        norm = reference.get_decoder().layers[first - 1].post_feedforward_layernorm
        new_weight = written.get_decoder().layers[first - 1].mlp.down_proj.weight.detach()
        assert norm_relative_error(new_weight, h, y, l, norm) < norm_relative_error(kept.weight.detach(), h, y, l,
                                                                                    norm)
        with torch.no_grad():
            kept.weight.copy_(new_weight)
    prompt = windows(source, calib_file).held_out[:2]
    with torch.no_grad():
        got, want = written(prompt).logits, reference(prompt).logits
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()

    before, after = tensor_bytes(source), tensor_bytes(out)
    renamed = {f"model.layers.{old}.": f"model.layers.{new}." for new, old in enumerate([0, 1, 4, 5])}
    expected = {}
    for name in before:
        prefix = next((p for p in renamed if name.startswith(p)), None)
        if prefix is not None:
            expected[name] = renamed[prefix] + name[len(prefix):]
        elif not name.startswith("model.layers."):
            expected[name] = name
    assert set(after) == set(expected.values())
    for name, new_name in expected.items():  # every tensor but the patched one is byte-identical
        assert torch.equal(after[new_name], before[name]) == (new_name != down), new_name
    card = (out / "README.md").read_text()
    assert "Weights of kept layers were changed" in card and down in card


def test_run_at_layer_0_folds_into_untied_embeddings(tiny_checkpoint, calib_file, tmp_path):
    source = tiny_checkpoint("llama")
    out = tmp_path / "patched"
    report, _ = run_patch(source, out, "0,1,5", calib_file, "--no-verify", "--patch-objective", "lstsq")
    first, final = report["patch"]["runs"]
    assert first["layers"] == [0, 1] and first["action"] == "folded into model.embed_tokens.weight"
    assert first["residual_error"]["after"] <= first["residual_error"]["before"]
    assert final["layers"] == [5, 5] and final["tensors"] == ["model.layers.4.mlp.down_proj.weight"]
    before, after = tensor_bytes(source), tensor_bytes(out)
    assert not torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    assert torch.equal(before["lm_head.weight"], after["lm_head.weight"])
    # the embedding fold is exact: E' rows = E rows @ T, with T fitted from layer 0's input to layer 2's
    base = load(source)
    ids = windows(source, calib_file).input_ids
    with torch.no_grad():
        states = [base(input_ids=w[None], output_hidden_states=True).hidden_states for w in ids]
    x = torch.cat([s[0][0] for s in states]).double()
    target = torch.cat([s[2][0] for s in states]).double()
    t = torch.linalg.lstsq(x, target).solution
    expected = (base.get_input_embeddings().weight.double() @ t).float()
    got = load_file(out / "model.safetensors")["model.embed_tokens.weight"]
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_tied_embeddings_run_at_layer_0_is_recorded_not_skipped_silently(tiny_checkpoint, calib_file, tmp_path):
    source = tiny_checkpoint("gemma3_text")
    assert AutoModelForCausalLM.from_pretrained(source).config.tie_word_embeddings
    out = tmp_path / "patched"
    report, result = run_patch(source, out, "0,3", calib_file)
    first, second = report["patch"]["runs"]
    assert first["action"].startswith("not patched:") and "tied" in first["action"] and first["tensors"] == []
    assert "warning: layers 0-0 not patched" in result.stderr
    assert second["tensors"] == ["model.layers.2.mlp.down_proj.weight"]
    record = json.loads((out / "prune.json").read_text())
    assert record["patch"]["runs"][0]["action"] == first["action"]
    assert "not patched" in (out / "README.md").read_text()


def test_bfloat16_patch_verifies(tiny_checkpoint, calib_file, tmp_path):
    source = tiny_checkpoint("qwen3")
    out = tmp_path / "bf16"
    report, _ = run_patch(source, out, "2,3", calib_file, "--dtype", "bfloat16", "--patch-objective", "cosine")
    assert report["verification"]["dtype"] == "bfloat16"
    assert report["perplexity"]["patched"] == pytest.approx(report["verification"]["perplexity"], rel=2e-2)
    (run,) = report["patch"]["runs"]
    assert run["method"] == "cosine" and run["cosine_loss"]["after"] <= run["cosine_loss"]["before"]
    written = load_file(out / "model.safetensors")
    assert written["model.layers.1.mlp.down_proj.weight"].dtype == torch.float32  # the source's dtype


def test_down_proj_objective_fits_the_whole_matrix(tiny_checkpoint, calib_file, tmp_path):
    source = tiny_checkpoint("llama")
    out = tmp_path / "dp"
    report, _ = run_patch(source, out, "2,3", calib_file, "--patch-objective", "down_proj")
    (run,) = report["patch"]["runs"]
    assert run["method"] == "down_proj" and run["residual_error"]["after"] < run["residual_error"]["before"]
    m, y, l, h = reference_activations(load(source), windows(source, calib_file).input_ids, 2, 3)
    r = l - y
    # independently: the ridge with the least error on window 7 (every 8th) when fitted on the other 11 ...
    held = torch.zeros(h.shape[0], dtype=torch.bool)
    held[(VALIDATE_EVERY - 1) * SEQ_LEN:VALIDATE_EVERY * SEQ_LEN] = True

    def ridge_solve(rows, ridge):
        xtx = h[rows].T @ h[rows]
        return torch.linalg.solve(xtx + ridge * xtx.diagonal().mean() * torch.eye(h.shape[1], dtype=h.dtype),
                                  h[rows].T @ r[rows])

    errors = {ridge: float((h[held] @ ridge_solve(~held, ridge) - r[held]).norm()) for ridge in RIDGES}
    assert run["ridge"] == min(errors, key=errors.get)
    assert run["held_back_error_by_ridge"][f"{run['ridge']:g}"] == pytest.approx(
        errors[run["ridge"]] / float(r[held].norm()), rel=1e-4)
    # ... then the solve on all 12 windows
    w = ridge_solve(torch.ones_like(held), run["ridge"]).T
    got = load_file(out / "model.safetensors")["model.layers.1.mlp.down_proj.weight"].double()
    assert (got - w).abs().max() <= 1e-3 * w.abs().max()


# ------------------------------------------------------------------ options


def test_patch_without_verification_still_writes(tiny_checkpoint, calib_file, tmp_path):
    out = tmp_path / "nv"
    report, _ = run_patch(tiny_checkpoint("phi3"), out, "1,2", calib_file, "--no-verify")
    assert report["perplexity"] is None and report["verification"] is None
    record = json.loads((out / "prune.json").read_text())
    assert record["patch"]["objective"] == "down_proj"  # the measured default
    assert record["patch"]["runs"][0]["tensors"] == ["model.layers.0.mlp.down_proj.weight"]
    assert record["patch"]["tokens"] == SEQ_LEN * SAMPLES


def test_patch_dry_run_loads_nothing(tiny_checkpoint, calib_file, tmp_path, monkeypatch):
    import prunetool.commands.prune as prune_module

    def refuse(*args, **kwargs):
        raise AssertionError("a dry run must not load the model")

    monkeypatch.setattr(prune_module, "load_model", refuse)
    out = tmp_path / "never"
    result = runner.invoke(app, prune_args(tiny_checkpoint("llama"), out, "1,2", calib_file, "--dry-run"))
    assert result.exit_code == 0, result.output
    assert not out.exists()


def test_patch_windows_beyond_the_selection_move_the_held_out_windows(tiny_checkpoint, calib_file, tmp_path):
    """--samples 4 --patch-windows 12: the fit reads 12 windows and the held-out ones start after them."""
    out = tmp_path / "pw"
    args = prune_args(tiny_checkpoint("llama"), out, "2,3", calib_file, "--samples", "4", "--patch-windows", "12")
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["patch"]["windows"] == 12 and report["patch"]["tokens"] == 12 * SEQ_LEN
    assert report["perplexity"]["held_out"]["first_token"] == 12 * SEQ_LEN  # windows(): 12 windows, then 4 held out
    assert report["perplexity"]["held_out"]["after_windows"] == 12
    assert report["patch"]["runs"][0]["ridge_chosen_on"].startswith(f"{SEQ_LEN} tokens of every 8th")


def test_default_patch_windows_cover_the_default_tokens():
    from prunetool.commands.prune import PruneRequest, patch_windows_for
    from prunetool.repair.fit import DEFAULT_PATCH_TOKENS

    assert patch_windows_for(PruneRequest(patch=True), 512) * 512 == DEFAULT_PATCH_TOKENS
    assert patch_windows_for(PruneRequest(patch=True), 300) == -(-DEFAULT_PATCH_TOKENS // 300)
    assert patch_windows_for(PruneRequest(patch=True, patch_windows=7), 512) == 7


@pytest.mark.parametrize("extra,words", [
    (["--patch-objective", "magic"], ["--patch-objective", "lstsq"]),
    (["--patch-windows", "0"], ["--patch-windows"]),
])
def test_bad_patch_options_are_refused(extra, words, tiny_checkpoint, calib_file, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, prune_args(tiny_checkpoint("llama"), out, "1", calib_file, *extra))
    assert result.exit_code != 0 and not out.exists()
    assert all(word in result.stderr for word in words), result.stderr


def test_objective_needs_patch(tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["prune", str(tiny_checkpoint("llama")), "--remove-layers", "1", "--no-verify",
                                 "--patch-objective", "cosine", "--output", str(out)])
    assert result.exit_code != 0 and "needs --patch" in result.stderr and not out.exists()
    result = runner.invoke(app, ["prune", str(tiny_checkpoint("llama")), "--remove-layers", "1", "--no-verify",
                                 "--patch-windows", "8", "--output", str(out)])
    assert result.exit_code != 0 and "--patch-windows needs --patch" in result.stderr and not out.exists()


def test_surgery_refuses_bad_replacements(tiny_checkpoint, tmp_path):
    source = tiny_checkpoint("llama")
    plan = PrunePlan("m", 6, (2,), "manual")
    for name, tensor, word in [("model.layers.2.mlp.down_proj.weight", torch.zeros(64, 128), "removed"),
                               ("model.layers.1.mlp.down_proj.weight", torch.zeros(3, 3), "shape"),
                               ("model.nothing.weight", torch.zeros(1), "no such")]:
        with pytest.raises(UnsupportedModelError, match=word):
            write_pruned_checkpoint(source, plan, tmp_path / "out", replacements={name: tensor})
        assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ repair-aware selection

def test_patched_perplexities_equal_an_independent_fold_and_leave_the_model_as_it_was(tiny_checkpoint, calib_file):
    """Each cut's perplexity after its lstsq patch = a hand fold of torch.linalg.lstsq into a fresh copy."""
    from prunetool.model.perplexity import perplexity
    from prunetool.repair.judge import patched_perplexities

    source = tiny_checkpoint("llama")
    ids = windows(source, calib_file).input_ids
    fit, judge = ids[4:], ids[:4]
    model = load(source)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    got = patched_perplexities(model, [(2, 3), (1, 2, 4)], fit, judge, "lstsq")
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())

    for cut in ((2, 3), (1, 2, 4)):
        reference = load(source)
        for first, last in contiguous_runs(cut):
            m, y, l, _ = reference_activations(load(source), fit, first, last)
            t = torch.linalg.lstsq(m, l - y).solution
            kept = reference.get_decoder().layers[first - 1].mlp.down_proj
            with torch.no_grad():
                kept.weight.copy_((t.T @ kept.weight.double()).float())
        prune_in_memory(reference, list(cut))
        assert got[cut] == pytest.approx(perplexity(reference, judge), rel=1e-4), cut
        plain = load(source)
        prune_in_memory(plain, list(cut))
        assert got[cut] != pytest.approx(perplexity(plain, judge), rel=1e-3)  # the patch did change something


@pytest.mark.parametrize("arch", ["qwen2", "gemma3_text"])
def test_halving_with_patch_chooses_the_proposal_best_after_repair(arch, tiny_checkpoint, calib_file):
    """Every proposal is re-measured patched (fit on the windows after the measuring ones); the lowest wins."""
    from prunetool.select.ranking import SelectionRequest
    from prunetool.repair.judge import patched_perplexities
    from prunetool.select.search import select_halving

    source = tiny_checkpoint(arch)
    ids = windows(source, calib_file).input_ids
    model = load(source)
    chosen = select_halving(SelectionRequest(6, 2, model=model, windows=ids, refine_windows=3, blocks=3,
                                             patch_objective="lstsq"))
    judged = chosen.extra["judged_after_patch"]
    assert judged == {"objective": "lstsq", "fit_windows": SAMPLES - 3, "fit_on_measuring_windows": False}
    cuts = [tuple(p["removed"]) for p in chosen.extra["patched"]]
    assert len(cuts) >= 2 and any(p["kind"] == "block" for p in chosen.extra["patched"])
    again = patched_perplexities(model, cuts, ids[3:], ids[:3], "lstsq")
    for proposal in chosen.extra["patched"]:
        assert proposal["patched_perplexity"] == pytest.approx(again[tuple(proposal["removed"])], rel=1e-6)
    assert chosen.removed == min(again, key=lambda c: (again[c], c))
    assert chosen.extra["patched_perplexity"] == pytest.approx(min(again.values()), rel=1e-6)


def test_prune_with_patch_records_the_repair_aware_choice(tiny_checkpoint, calib_file, tmp_path):
    source = tiny_checkpoint("mistral")
    args = ["prune", str(source), "--drop", "2", "--criterion", "halving", "--patch", "--calib", str(calib_file),
            "--seq-len", str(SEQ_LEN), "--samples", str(SAMPLES), "--patch-windows", str(SAMPLES),
            "--refine-windows", "3", "--output", str(tmp_path / "out"), "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    parameters = json.loads(result.stdout)["plan"]["parameters"]
    assert parameters["judged_after_patch"]["objective"] == "down_proj"
    best = min(parameters["patched"], key=lambda p: (p["patched_perplexity"], p["removed"]))
    assert json.loads(result.stdout)["plan"]["removed"] == best["removed"]
