"""The prune stage wired together: starting point -> plan -> held-out perplexity -> checkpoint -> checks.

Order matters for the user: every option is checked before anything slow, perplexity before and
after is measured in memory so the model card can state it, and the written folder is verified by
reloading it before it is published, so a checkpoint that fails a check never appears.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from prunetool.calibration import CalibrationSet, load_calibration
from prunetool.errors import CalibrationError, OptionError, PrunetoolError
from prunetool.exports import llamacpp_prune_layers, mergekit_yaml, model_card, prune_record
from prunetool.in_memory import layers_removed
from prunetool.loading import load_model
from prunetool.perplexity import perplexity
from prunetool.plan import PrunePlan
from prunetool.runs import load_current_run, record_current_run
from prunetool.scoring import Scores, score_model
from prunetool.selection import (CRITERIA, GUIDED_BLOCKS, GUIDED_SHORTLIST, GUIDED_WINDOWS, make_plan, manual_plan,
                                 parse_layers, validate_selection)
from prunetool.sources import resolve_model
from prunetool.sources.demo import find_alias
from prunetool.surgery import write_pruned_checkpoint
from prunetool.verify import verify_checkpoint
from prunetool.workflow import model_key, window_progress

HOLDOUT_WINDOWS = 4  # windows after the scored ones, never used for selection: the perplexity table


@dataclass(frozen=True)
class PruneRequest:
    model: str | None
    drop: int | None
    layers: str | None
    criterion: str
    beta: float | None  # None: the criterion's own default
    scores_file: Path | None
    calib: str | None
    seq_len: int
    stride: int | None
    samples: int
    protect_first: int
    protect_last: int
    output: Path | None
    force: bool
    dry_run: bool
    verify: bool
    dtype: str
    device: str
    batch_size: int
    trust_remote_code: bool
    shortlist: int = GUIDED_SHORTLIST  # guided only
    refine_windows: int = GUIDED_WINDOWS
    blocks: int = GUIDED_BLOCKS


def starting_point(request: PruneRequest) -> tuple[str, Scores | None, dict]:
    """MODEL and scores: from --scores, from the current run when MODEL is omitted, or nothing yet."""
    calib = {"calib": request.calib, "seq_len": request.seq_len, "stride": request.stride,
             "samples": request.samples}
    if request.scores_file is not None:
        if not request.scores_file.is_file():
            raise OptionError(f"--scores {request.scores_file} does not exist; write one with "
                              "`prunetool score MODEL --output FILE`")
        try:
            data = json.loads(request.scores_file.read_text())
            scores = Scores.from_json(data)
        except (json.JSONDecodeError, TypeError, KeyError) as error:
            raise OptionError(f"--scores {request.scores_file} is not a prunetool scores file ({error})") from None
        return request.model or scores.model, scores, calib
    if request.model is None:
        run = load_current_run()
        if run.get("scores") is None:
            raise PrunetoolError("the current run has no scores: run `prunetool score MODEL` first, or pass MODEL")
        options = {key: run["options"].get(key, value) for key, value in calib.items()}
        return run["model"], Scores.from_json(run["scores"]), options
    return request.model, None, calib


def text_num_layers(config: dict) -> int:
    return (config.get("text_config") or config)["num_hidden_layers"]


def check_options(request: PruneRequest, num_layers: int) -> tuple[int, ...] | None:
    """Fail on any bad option before loading anything; returns the --layers indices when given."""
    if (request.drop is None) == (request.layers is None):
        raise OptionError("give exactly one of --drop N or --layers 3,7,12")
    if request.layers is not None:
        return parse_layers(request.layers, num_layers)
    validate_selection(request.criterion, request.drop, num_layers, beta=request.beta,
                       protect_first=request.protect_first, protect_last=request.protect_last,
                       shortlist=request.shortlist, refine_windows=request.refine_windows, blocks=request.blocks)
    return None


def calibration_windows(tokenizer, model, source, options: dict, holdout: int) -> tuple[CalibrationSet, object]:
    """The scored windows plus `holdout` windows right after them, from one calibration stream."""
    wanted = options["samples"] + holdout
    try:
        full = load_calibration(options["calib"], tokenizer, seq_len=options["seq_len"], stride=options["stride"],
                                samples=wanted, model=model, model_key=model_key(source))
    except CalibrationError as error:
        raise CalibrationError(f"{error} (prune uses {holdout} held-out windows after the {options['samples']} "
                               "scored ones; pass --no-verify or lower --samples)") from None
    scored = CalibrationSet(full.source, full.sha256, full.seq_len, full.stride, full.input_ids[: options["samples"]])
    return scored, full.input_ids[options["samples"]:]


def choose(request, spec, scores, model, calibration, console: Console) -> tuple[PrunePlan, Scores | None]:
    """Run the criterion, scoring first when it ranks scores nobody recorded yet."""
    num_layers = scores.num_layers if scores is not None else model_layers(model)
    with window_progress(console) as progress:
        if scores is None and CRITERIA[request.criterion].needs in ("scores", "both"):
            task = progress.add_task("scoring windows", total=calibration.windows)
            scores = score_model(model, calibration, model_name=spec, batch_size=request.batch_size,
                                 on_batch=lambda n: progress.advance(task, n))
        search = progress.add_task("perplexity search", total=None,
                                   visible=CRITERIA[request.criterion].needs in ("model", "both"))
        plan = make_plan(spec, request.criterion, request.drop, scores=scores, model=model, calibration=calibration,
                         num_layers=num_layers, beta=request.beta, protect_first=request.protect_first,
                         protect_last=request.protect_last, batch_size=request.batch_size,
                         shortlist=request.shortlist, refine_windows=request.refine_windows, blocks=request.blocks,
                         on_step=lambda done, total: progress.update(search, completed=done, total=total))
    return plan, scores


def model_layers(model) -> int | None:
    return None if model is None else model.config.get_text_config(decoder=True).num_hidden_layers


def default_output(spec: str, plan: PrunePlan) -> Path:
    stem = Path(spec.rstrip("/")).name or "model"
    return Path.cwd() / f"{stem}-pruned-{len(plan.removed)}"


def measure_perplexity(model, held_out, plan: PrunePlan, description: str) -> dict:
    """Held-out perplexity of the base and of the in-memory prune (the written model must match the latter)."""
    before = perplexity(model, held_out)
    with layers_removed(model, plan.removed):
        after = perplexity(model, held_out)
    return {"before": before, "after": after, "description": description}


def side_files(plan: PrunePlan, source, perplexity_info: dict | None, verify: bool) -> dict[str, str]:
    """prune.json, the model card and the same cut for mergekit and llama.cpp."""
    checks = ["reload with AutoModelForCausalLM", "decoder layer count", "greedy decoding with and without the "
              "KV cache agree", "perplexity of the reloaded model equals the in-memory prune (rtol 1e-4)"]
    verification = {"passed_before_publishing": checks} if verify else None
    record = prune_record(plan, source_path=str(source.path), perplexity=perplexity_info, verification=verification)
    config = source.config.get("text_config") or source.config
    command = f"prunetool prune {plan.base_model} --layers {','.join(map(str, plan.removed))}"
    return {
        "prune.json": json.dumps(record, indent=1) + "\n",
        "README.md": model_card(plan, base_model=base_model_name(source), perplexity=perplexity_info, command=command),
        "mergekit.yaml": mergekit_yaml(plan, str(source.path), config.get("dtype") or config.get("torch_dtype")),
        "llama.cpp-prune-layers.txt": llamacpp_prune_layers(plan),
    }


def base_model_name(source) -> str:
    """The Hub id where one is known (demo aliases record theirs), else what the user typed."""
    alias = find_alias(source.spec) if source.kind == "alias" else None
    return alias.hub_id if alias is not None else source.spec


def run_prune(request: PruneRequest, console: Console) -> dict:
    """Choose, measure, write, verify; returns what the CLI prints."""
    spec, scores, options = starting_point(request)
    source = resolve_model(spec, trust_remote_code=request.trust_remote_code)
    num_layers = text_num_layers(source.config)
    if scores is not None and scores.num_layers != num_layers:
        raise OptionError(f"the scores are for a {scores.num_layers}-layer model but {spec} has {num_layers} "
                          "layers; score this model again")
    manual = check_options(request, num_layers)
    writes = not request.dry_run
    ranked_needs = None if manual is not None else CRITERIA[request.criterion].needs
    needs_model = ((writes and request.verify) or ranked_needs in ("model", "both")
                   or (ranked_needs == "scores" and scores is None))
    model = calibration = held_out = None
    if needs_model:
        model, tokenizer = load_model(source, dtype=request.dtype, device=request.device,
                                      trust_remote_code=request.trust_remote_code)
        holdout = HOLDOUT_WINDOWS if writes and request.verify else 0
        calibration, held_out = calibration_windows(tokenizer, model, source, options, holdout)
    if manual is not None:
        plan = manual_plan(spec, manual, num_layers)
    else:
        plan, scores = choose(request, spec, scores, model, calibration, console)
    result = {"plan": plan.to_json(), "dry_run": request.dry_run}
    if request.dry_run:
        return result
    perplexity_info = None
    if request.verify:
        description = (f"{len(held_out)} windows x {calibration.seq_len} tokens of {calibration.source} that follow "
                       f"the {calibration.windows} windows used for selection")
        perplexity_info = measure_perplexity(model, held_out, plan, description)
    output = Path(request.output or default_output(spec, plan))
    verification: dict = {}

    def check(folder: Path) -> None:
        verification.update(verify_checkpoint(folder, expected_layers=len(plan.kept), held_out=held_out,
                                              expected_perplexity=perplexity_info["after"]))

    with window_progress(console) as progress:
        task = progress.add_task("writing shards", total=None)
        write_pruned_checkpoint(source.path, plan, output, force=request.force,
                                extra_files=side_files(plan, source, perplexity_info, request.verify),
                                on_shard=lambda name: progress.advance(task),
                                before_publish=check if request.verify else None)
    pruned = {"path": str(output.resolve()), "removed": list(plan.removed), "criterion": plan.criterion}
    record_current_run(spec, source.path, scores.to_json() if scores is not None else None, options, pruned)
    return result | {"output": str(output), "perplexity": perplexity_info, "verification": verification or None}
