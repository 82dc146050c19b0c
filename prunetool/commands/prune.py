"""`prunetool prune`: starting point -> plan -> held-out perplexity -> checkpoint -> checks -> current run.

Order matters for the user: every option is checked before anything slow, perplexity before and
after is measured in memory so the model card can state it, and the written folder is verified by
reloading it (same dtype, same device) before it is published, so a checkpoint that fails a check
never appears.

Two sets of windows come from one calibration stream and never overlap: the selection windows (those
the scores were computed on, and the first of which a perplexity search measures) and the held-out
windows, which start at the first token after the last selection window (calibration.heldout_start).
Both are recorded in prune.json.

With --patch the stream also gives the patch windows: its first --patch-windows windows (by
default as many as make repair.fit.DEFAULT_PATCH_TOKENS tokens; the selection windows are their first
ones), and the held-out windows then start after whichever set reaches further, so they never overlap
either. After the plain cut's perplexity is measured, one hooked pass of the unpruned model over the
patch windows (never the held-out ones) fits a map per contiguous removed run
(prunetool.repair), the new kept tensors are applied to the loaded model exactly as the written
checkpoint will hold them (cast to the source dtype), the patched prune's held-out perplexity becomes
the one the reloaded checkpoint must match, and the surgery writer swaps those tensors in while copying
every other tensor byte for byte.
"""

import dataclasses
import functools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from prunetool.select.calibration import HOLDOUT_WINDOWS, CalibrationSet, load_calibration
from prunetool.checkpoint_io import text_num_layers, text_section
from prunetool.errors import CalibrationError, OptionError
from prunetool.checkpoint.exports import llamacpp_prune_layers, mergekit_yaml, model_card, prune_record
from prunetool.model.loading import load_model, offloaded_to_disk, pick_device, pick_dtype
from prunetool.memory import peak_rss_bytes, use_low_memory
from prunetool.model.runner import as_runner, cut_perplexity
from prunetool.cut import Cut
from prunetool.select.plan import PrunePlan
from prunetool.progress import window_progress
from prunetool.select.ranking import GUIDED_BLOCKS, GUIDED_SHORTLIST, GUIDED_WINDOWS, HALVING_SCREEN_TOKENS
from prunetool.output.runs import current_scores, record_current_run
from prunetool.select.scoring import Scores, score_model
from prunetool.select.selection import (CRITERIA, SUBLAYER_UNITS, make_plan, manual_plan, parse_layers,
                                        validate_selection)
from prunetool.sources import model_key, resolve_model
from prunetool.sources.demo import find_alias
from prunetool.sources.tokenizer import FileTokenizer
from prunetool.checkpoint.surgery import patched_tensor_names, write_cut_checkpoint, write_pruned_checkpoint
from prunetool.checkpoint.surgery.output import check_output
from prunetool.checkpoint.verify import VerifySetting, verify_checkpoint, verify_streamed


@dataclass(frozen=True, kw_only=True)
class PruneRequest:
    """Everything `prune` was asked; built by keyword so a new option cannot shift the others."""

    model: str | None = None
    drop: int | None = None
    layers: str | None = None
    criterion: str = "halving"
    beta: float | None = None  # None: the criterion's own default
    scores_file: Path | None = None
    calib: str | None = None
    seq_len: int = 512
    stride: int | None = None
    samples: int = 16
    protect_first: int = 0
    protect_last: int = 0
    output: Path | None = None
    force: bool = False
    dry_run: bool = False
    verify: bool = True
    dtype: str = "auto"
    device: str = "auto"
    placement: object = None  # loading.Placement: the search's model spread over devices by accelerate
    low_memory: bool = False  # never load the model: one decoder layer at a time from the checkpoint
    batch_size: int = 1
    trust_remote_code: bool = False
    shortlist: int = GUIDED_SHORTLIST  # guided only
    screen_tokens: int = HALVING_SCREEN_TOKENS  # halving only
    screen_dtype: str = "auto"  # halving only: bfloat16 screening where native, or "model"
    refine_windows: int = GUIDED_WINDOWS
    blocks: int = GUIDED_BLOCKS
    plot: Path | None = None
    patch: bool = False
    patch_objective: str | None = None  # None: prunetool.repair.fit.DEFAULT_OBJECTIVE
    patch_windows: int | None = None  # None: patch_windows_for(seq_len)
    unit: str | None = None  # what --drop and --remove-layers count (default block); with --target, the only kind
    target: str | None = None  # --target params=0.85,kv=0.75,...: a budget instead of a count
    pareto: Path | None = None  # --pareto FILE: the quality-cost frontier of the budget search, as JSON


@dataclass(frozen=True)
class StartingPoint:
    """MODEL, its scores if recorded, the calibration they came from and where that was decided."""

    spec: str | None
    scores: Scores | None
    calibration: dict = field(default_factory=dict)  # calib, seq_len, stride, samples
    origin: str = "command line"
    sha256: str | None = None  # of the scores' text: the windows prune loads must be the same


def calibration_of(scores: Scores, fallback: dict) -> dict:
    """Load options that reproduce the windows the scores were computed on (older files: the fallback)."""
    recorded = scores.calibration or {}
    if "spec" not in recorded:
        return fallback
    return {"calib": recorded["spec"], "seq_len": recorded["seq_len"], "stride": recorded["stride"],
            "samples": recorded["windows"]}


def starting_point(request: PruneRequest) -> StartingPoint:
    """From --scores, from the current run when MODEL is omitted, or from MODEL and the command line."""
    options = {"calib": request.calib, "seq_len": request.seq_len, "stride": request.stride,
               "samples": request.samples}
    if request.scores_file is not None:
        if not request.scores_file.is_file():
            raise OptionError(f"--scores {request.scores_file} does not exist; write one with "
                              "`prunetool score MODEL --output FILE`")
        try:
            scores = Scores.from_json(json.loads(request.scores_file.read_text()))
        except (json.JSONDecodeError, TypeError, KeyError) as error:
            raise OptionError(f"--scores {request.scores_file} is not a prunetool scores file ({error})") from None
        return StartingPoint(request.model or scores.model, scores, calibration_of(scores, options),
                             f"--scores {request.scores_file}", scores.calibration.get("sha256"))
    if request.model is None:
        spec, data, recorded = current_scores()
        scores = Scores.from_json(data)
        fallback = {key: recorded.get(key, value) for key, value in options.items()}
        return StartingPoint(spec, scores, calibration_of(scores, fallback), "the current run",
                             scores.calibration.get("sha256"))
    return StartingPoint(request.model, None, options)


def check_options(request: PruneRequest, num_layers: int) -> tuple[int, ...] | None:
    """Fail on any bad option before loading anything; returns the --layers indices when given."""
    if request.target is not None:
        raise AssertionError("--target requests are checked by check_target_options")
    if (request.drop is None) == (request.layers is None):
        raise OptionError("give exactly one of --drop N, --remove-layers 3,7,12 or --target params=0.85,...")
    if request.unit not in SUBLAYER_UNITS:
        raise OptionError(f"--unit must be one of {', '.join(SUBLAYER_UNITS)}, got {request.unit!r}")
    if request.layers is not None:
        removed = parse_layers(request.layers, num_layers, allow_all=request.unit != "block")
        if request.unit == "attention" and len(removed) >= num_layers:
            raise OptionError(f"--remove-layers names all {num_layers} attention sublayers; at least one must stay")
        Cut.of(request.unit, removed, num_layers).check_engines()
        return removed
    validate_selection(request.criterion, request.drop, num_layers, beta=request.beta,
                       protect_first=protected_first(request), protect_last=request.protect_last,
                       shortlist=request.shortlist, refine_windows=request.refine_windows, blocks=request.blocks,
                       screen_tokens=request.screen_tokens, screen_dtype=request.screen_dtype, unit=request.unit)
    return None


def protected_first(request: PruneRequest) -> int:
    """Layers at the start that no search removes: layer 0's attention stays for --unit attention, since vLLM's
    nemotron_nas forward cannot run an MLP before any attention (checkpoint.nemotron_nas.convert)."""
    return max(request.protect_first, 1) if request.unit == "attention" else request.protect_first


def check_sublayer_request(request: PruneRequest, source) -> None:
    """A sublayer cut is written as a nemotron-nas folder: refuse what that format cannot express, at once."""
    from prunetool.checkpoint.nemotron_nas.convert import check_expressible

    if request.low_memory:
        raise OptionError(f"--unit {request.unit} does not run with --low-memory yet; load the model (drop "
                          "--low-memory) or prune whole blocks")
    check_expressible(source.config)


def check_patch_options(request: PruneRequest) -> None:
    from prunetool.repair.fit import OBJECTIVES

    if request.patch and request.unit != "block":
        raise OptionError(f"--unit {request.unit} --patch: no fold exists for a removed {request.unit} sublayer (its "
                          "output is not a linear map of the stream that a kept weight could absorb"
                          + (", and attention mixes other tokens" if request.unit == "attention" else "")
                          + "); prune without --patch and heal instead")

    if request.patch_objective is not None and request.patch_objective not in OBJECTIVES:
        raise OptionError(f"--patch-objective must be one of {', '.join(OBJECTIVES)}, got {request.patch_objective!r}")
    if request.patch_objective is not None and not request.patch:
        raise OptionError("--patch-objective needs --patch")
    if request.patch_windows is not None and not request.patch:
        raise OptionError("--patch-windows needs --patch")
    if request.patch_windows is not None and request.patch_windows < 1:
        raise OptionError(f"--patch-windows must be at least 1, got {request.patch_windows}")


def patch_windows_for(request: PruneRequest, seq_len: int) -> int:
    """How many windows the patch fit reads: --patch-windows, else DEFAULT_PATCH_TOKENS worth of windows."""
    from prunetool.repair.fit import DEFAULT_PATCH_TOKENS

    return request.patch_windows or -(-DEFAULT_PATCH_TOKENS // seq_len)


def load_windows(start: StartingPoint, tokenizer, model, source, *, selection: bool, holdout: int,
                 patch_windows: int = 0, after_tokenizing=None) -> CalibrationSet:
    """The selection windows (if the run selects), the patch windows (the first `patch_windows`; the
    selection windows are a prefix of them or they of the selection windows) and `holdout` windows after
    both, from one stream. Callers take the selection windows with .first(options["samples"]).

    Without selection or patch (--layers) only the held-out windows are cut, from the start of the text,
    and generated text is only as long as they need.
    """
    options = start.calibration
    samples = max(options["samples"] if selection else 0, patch_windows)
    try:
        windows = load_calibration(options["calib"], tokenizer, seq_len=options["seq_len"], stride=options["stride"],
                                   samples=samples, model=model, model_key=model_key(source), holdout=holdout,
                                   small=not selection, after_tokenizing=after_tokenizing)
    except CalibrationError as error:
        if getattr(error, "available", None) is None:  # not a too-short text: the hint below would mislead
            raise
        what = f"{samples} selection" if not patch_windows else f"{samples} selection and patch"
        fix = "--samples" if not patch_windows else "--samples or --patch-windows"
        raise CalibrationError(f"{error} (prune holds out {holdout} windows after the {what} windows; pass "
                               f"--no-verify or lower {fix})") from None
    if selection and start.sha256 and windows.sha256 != start.sha256:
        raise CalibrationError(f"the calibration text of the scores ({start.origin}, sha256 {start.sha256[:12]}…) "
                               f"is not the text loaded now ({windows.source}, sha256 {windows.sha256[:12]}…), so "
                               "held-out windows could overlap the scored ones; score again")
    return windows


def choose(request, spec, scores, model, calibration, console: Console) -> tuple[PrunePlan, Scores | None]:
    """Run the criterion, scoring first when it ranks scores nobody recorded yet."""
    from prunetool.repair.fit import DEFAULT_OBJECTIVE

    num_layers = scores.num_layers if scores is not None else model.config.get_text_config(decoder=True).num_hidden_layers
    needs = CRITERIA[request.criterion].needs
    with window_progress(console) as progress:
        if scores is None and needs in ("scores", "both"):
            task = progress.add_task("scoring windows", total=calibration.windows)
            runner = as_runner(model)  # a streamed model's embedding holds only the rows these windows use
            renumbered = dataclasses.replace(calibration, input_ids=runner.input_rows(calibration.input_ids))
            scores = score_model(runner.model, renumbered, model_name=spec, batch_size=request.batch_size,
                                 on_batch=lambda n: progress.advance(task, n), device=runner.device,
                                 dtype=runner.dtype)
        search = progress.add_task("perplexity search", total=None, visible=needs in ("model", "both"))
        plan = make_plan(spec, request.criterion, request.drop, scores=scores, model=model, calibration=calibration,
                         num_layers=num_layers, beta=request.beta, protect_first=protected_first(request),
                         protect_last=request.protect_last, batch_size=request.batch_size,
                         shortlist=request.shortlist, refine_windows=request.refine_windows, blocks=request.blocks,
                         screen_tokens=request.screen_tokens, screen_dtype=request.screen_dtype,
                         patch_objective=(request.patch_objective or DEFAULT_OBJECTIVE) if request.patch else None,
                         unit=request.unit,
                         on_step=lambda done, total: progress.update(search, completed=done, total=total))
    return plan, scores


def default_output(spec: str, plan: PrunePlan) -> Path:
    stem = Path(spec.rstrip("/")).name or "model"
    return Path.cwd() / f"{stem}-pruned-{len(plan.removed)}"


def measure_perplexity(model, calibration: CalibrationSet, plan: PrunePlan) -> dict:
    """Held-out perplexity of the base and of the in-memory prune (the written model must match the latter)."""
    held = calibration.describe_held_out()
    after = (f"that follow the {held['after_windows']} selection windows, from token {held['first_token']}"
             if held["after_windows"] else f"from token {held['first_token']} (no selection windows: --layers)")
    before = cut_perplexity(model, calibration.held_out)
    pruned = cut_perplexity(model, calibration.held_out, plan.cut)
    return {"before": before, "after": pruned, "held_out": held,
            "description": f"{held['windows']} windows x {held['seq_len']} tokens of {held['source']} {after}"}


def patch_warning(plain_cut: float, patched: float) -> str | None:
    """A patch fitted on calibration text can still hurt other text (Gemma's norm-bound fits did): say so."""
    if patched <= plain_cut:
        return None
    return (f"warning: the patch raised held-out perplexity from {plain_cut:.3f} to {patched:.3f}; the written model "
            "keeps it (prune without --patch, or heal afterwards, e.g. `prunetool heal`)")


def patch_model(model, plan: PrunePlan, calibration: CalibrationSet, source, request: PruneRequest,
                console: Console) -> tuple[dict, dict]:
    """Fit and apply the patch in memory; returns ({source tensor name: new tensor}, prune.json's record).

    The loaded model gets each new tensor rounded to the source checkpoint's dtype and then to its own,
    which is what a reload of the written checkpoint in the same dtype holds, so the in-memory perplexity
    is the reference the written checkpoint must match.
    """
    from prunetool.repair import capture_runs, fit_runs
    from prunetool.repair.fit import DEFAULT_OBJECTIVE
    from prunetool.repair.patch import CACHE_TOKENS, RIDGE
    from prunetool.repair.sites import runner_sites

    objective = request.patch_objective or DEFAULT_OBJECTIVE
    clock = time.perf_counter()
    runner = as_runner(model)
    sites = runner_sites(runner, plan.removed)
    with window_progress(console) as progress:
        task = progress.add_task("patch: calibration pass", total=calibration.windows)  # the patch windows
        data = capture_runs(runner, calibration.input_ids, sites, objective, batch_size=request.batch_size,
                            on_batch=lambda n: progress.advance(task, n))
    patches = fit_runs(runner, data, objective)
    relative = [name for patch in patches for name in patch.tensors]
    on_disk = patched_tensor_names(source.path, relative) if relative else {}
    decoder = runner.decoder
    replacements, runs, in_model = {}, [], {}
    for patch in patches:
        record = dict(patch.record)
        if patch.tensors:
            names = [on_disk[name][0] for name in patch.tensors]
            record["tensors"] = names
            record["action"] = record["action"].replace(next(iter(patch.tensors)).removesuffix(".weight"),
                                                        names[0].removesuffix(".weight"), 1)
        else:
            console.print(f"warning: layers {record['layers'][0]}-{record['layers'][1]} {record['action']}",
                          highlight=False, soft_wrap=True)
        for name, value in patch.tensors.items():
            disk_name, disk_dtype = on_disk[name]
            parameter = decoder.get_parameter(name)
            in_model[name] = value.to(disk_dtype).to(parameter.dtype)
            replacements[disk_name] = value
        runs.append(record)
    runner.replace_tensors(in_model)  # a streamed model loads each patched layer's new tensors from now on
    record = {"objective": objective, "windows": calibration.windows, "tokens": calibration.tokens,
              "seq_len": calibration.seq_len, "stride": calibration.stride,
              "windows_used": "the first windows of the calibration stream (the selection windows and, "
                              "when more, the ones after them), never the held-out ones",
              "ridge": f"lambda = ridge x mean(diag X^T X): {RIDGE:g} for the map T; whole down_proj: "
                       "chosen per run on every 8th patch window (runs[].ridge)", "cache_tokens_cap": CACHE_TOKENS,
              "runs": runs, "seconds": round(time.perf_counter() - clock, 3)}
    return replacements, record


def side_files(plan: PrunePlan, source, perplexity_info: dict | None, setting: VerifySetting | None,
               patch: dict | None = None, command: str | None = None) -> dict[str, str]:
    """prune.json, the model card and the same cut for mergekit and llama.cpp."""
    verification = None
    if setting is not None:
        verification = {"passed_before_publishing": [
            "reload with AutoModelForCausalLM", "decoder layer count",
            "decoding with and without the KV cache agrees (float32: identical greedy tokens; half precision: "
            "log-probabilities along one sequence within cache_logprob_atol)",
            "perplexity of the reloaded model equals the in-memory prune's within perplexity_rtol"],
            **setting.describe()}
    record = prune_record(plan, source_path=str(source.path), perplexity=perplexity_info, verification=verification,
                          patch=patch)
    config = text_section(source.config)
    if command is None:
        command = f"prunetool prune {plan.base_model} --remove-layers {','.join(map(str, plan.removed))}"
        if plan.unit != "block":
            command += f" --unit {plan.unit}"
        if patch is not None:
            command += f" --patch --patch-objective {patch['objective']}"
    files = {
        "prune.json": json.dumps(record, indent=1) + "\n",
        "README.md": model_card(plan, base_model=base_model_name(source), perplexity=perplexity_info, command=command,
                                patch=patch),
    }
    if plan.cut.blocks_only:  # mergekit and llama.cpp's layer lists remove whole layers only
        files["mergekit.yaml"] = mergekit_yaml(plan, str(source.path), config.get("dtype") or config.get("torch_dtype"))
        files["llama.cpp-prune-layers.txt"] = llamacpp_prune_layers(plan)
    return files


def streamed_model(source, calibration: CalibrationSet, request: PruneRequest):
    """A StreamedModel whose embedding holds the rows every selection, patch and held-out window uses."""
    import torch

    from prunetool.model.loading import pick_device, pick_dtype
    from prunetool.model.streaming import build_streamed

    target = pick_device(request.device)
    ids = calibration.input_ids.reshape(-1)
    if calibration.held_out is not None:
        ids = torch.cat([ids, calibration.held_out.reshape(-1)])
    return build_streamed(source, ids, dtype=pick_dtype(request.dtype, target), device=target)


def base_model_name(source) -> str:
    """The Hub id where one is known (demo aliases record theirs), else what the user typed."""
    alias = find_alias(source.spec) if source.kind == "alias" else None
    return alias.hub_id if alias is not None else source.spec


def load_for_prune(request: PruneRequest, start, source, low_memory: bool, selection: bool, console: Console):
    """The model (loaded, or streamed under --low-memory), its windows and the verification setting."""
    verifying = request.verify and not request.dry_run
    patching = request.patch and not request.dry_run
    clock = time.perf_counter()
    if low_memory:
        model, tokenizer = None, FileTokenizer(source.path)
    else:
        model, tokenizer = load_model(source, dtype=request.dtype, device=request.device,
                                      trust_remote_code=request.trust_remote_code, placement=request.placement)
    if patching and offloaded_to_disk(model):  # the fit writes into the kept weights, which sit on `meta`
        raise OptionError("--patch needs every kept weight in memory; raise --max-memory so nothing is offloaded "
                          "to disk, or prune first and patch on a larger machine")
    # a criterion's windows are cut even when only recorded scores rank: the held-out text must start
    # after the text those scores saw (and after the patch windows), and its sha256 is checked against theirs
    patch_windows = patch_windows_for(request, start.calibration["seq_len"]) if patching else 0
    calibration = load_windows(start, tokenizer, model, source, selection=selection,
                               holdout=HOLDOUT_WINDOWS if verifying else 0, patch_windows=patch_windows,
                               after_tokenizing=tokenizer.release if low_memory else None)
    if low_memory:
        model = streamed_model(source, calibration, request)
    console.print(f"loaded the model and {calibration.windows} selection/patch + "
                  f"{0 if calibration.held_out is None else len(calibration.held_out)} held-out windows in "
                  f"{time.perf_counter() - clock:.1f}s", highlight=False)
    target = pick_device(request.device)
    setting = VerifySetting(pick_dtype(request.dtype, target), target) if verifying else None
    return model, calibration, setting


def run_prune(request: PruneRequest, console: Console) -> dict:
    """Choose, measure, write, verify; returns what the CLI prints."""
    if request.target is not None:
        raise AssertionError("--target runs commands.budget.run_budget")
    if request.unit is None:
        request = dataclasses.replace(request, unit="block")
    start = starting_point(request)
    source = resolve_model(start.spec, trust_remote_code=request.trust_remote_code)
    spec = start.spec or source.spec
    num_layers = text_num_layers(source.config)
    if start.scores is not None and start.scores.num_layers != num_layers:
        raise OptionError(f"the scores are for a {start.scores.num_layers}-layer model but {spec} has {num_layers} "
                          "layers; score this model again")
    manual = check_options(request, num_layers)
    check_patch_options(request)
    if request.unit != "block":
        check_sublayer_request(request, source)
    verifying = request.verify and not request.dry_run
    patching = request.patch and not request.dry_run
    needs = None if manual is not None else CRITERIA[request.criterion].needs
    selects_on_windows = needs in ("model", "both") or (needs == "scores" and start.scores is None)
    if request.output is not None and not request.dry_run:  # before minutes of loading and searching
        check_output(source.path, Path(request.output), request.force)
    low_memory = use_low_memory(request.low_memory, request.placement, source.path, console)
    model = calibration = setting = None
    if verifying or selects_on_windows or patching:
        model, calibration, setting = load_for_prune(request, start, source, low_memory, manual is None, console)
    patch_windows = patch_windows_for(request, start.calibration["seq_len"]) if patching else 0
    scores = start.scores
    if manual is not None:
        plan = manual_plan(spec, manual, num_layers, unit=request.unit)
    else:
        selection = calibration.first(min(start.calibration["samples"], calibration.windows))
        plan, scores = choose(request, spec, scores, model, selection, console)
    result = {"plan": plan.to_json(), "dry_run": request.dry_run, "scores": scores.to_json() if scores else None}
    if request.dry_run:
        return result | {"low_memory": low_memory, "peak_rss_bytes": peak_rss_bytes()}
    perplexity_info = measure_perplexity(model, calibration, plan) if verifying else None
    replacements = patch = None
    if patching:
        patch_set = calibration.first(patch_windows)
        replacements, patch = patch_model(model, plan, patch_set, source, request, console)
        if perplexity_info is not None:
            patched = cut_perplexity(model, calibration.held_out, plan.cut)
            perplexity_info |= {"plain_cut": perplexity_info["after"], "patched": patched, "after": patched}
            warning = patch_warning(perplexity_info["plain_cut"], patched)
            if warning:
                console.print(warning, highlight=False, soft_wrap=True)
    output, verification = Path(request.output or default_output(spec, plan)), {}

    def check(folder: Path) -> None:
        verify = verify_streamed if low_memory else functools.partial(verify_checkpoint,
                                                                     shipped_code=not plan.cut.blocks_only)
        verification.update(verify(folder, expected_layers=len(plan.kept), held_out=calibration.held_out,
                                   expected_perplexity=perplexity_info["after"], setting=setting))

    with window_progress(console) as progress:
        task = progress.add_task("writing shards", total=None)
        extra = side_files(plan, source, perplexity_info, setting, patch)
        if plan.cut.blocks_only:  # the source's own format (and the only cut a patch applies to)
            write_pruned_checkpoint(source.path, plan, output, force=request.force, extra_files=extra,
                                    on_shard=lambda name: progress.advance(task),
                                    before_publish=check if verifying else None, replacements=replacements)
        else:
            write_cut_checkpoint(source.path, plan.cut, output, force=request.force, extra_files=extra,
                                 on_shard=lambda name: progress.advance(task),
                                 before_publish=check if verifying else None)
    pruned = {"path": str(output.resolve()), "removed": list(plan.removed), "criterion": plan.criterion,
              "held_out": perplexity_info["held_out"] if perplexity_info else None}
    record_current_run(spec, source.path, scores.to_json() if scores is not None else None, start.calibration, pruned)
    return result | {"output": str(output), "perplexity": perplexity_info, "verification": verification or None,
                     "patch": patch, "low_memory": low_memory, "peak_rss_bytes": peak_rss_bytes()}
