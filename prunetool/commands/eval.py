"""`prunetool eval`: which models, which tasks, then each model loaded in turn and scored.

With no MODEL the current run supplies the base and what was made from it, side by side: the plain
cut, the patched cut (`prune --patch`) and the healed model (`prunetool heal`), whichever it has. A patched
run wrote only the patched folder; its plain cut is the base with the same layers removed in memory,
which is exactly the checkpoint a plain prune writes (same tensors, same config edits). Tasks are checked before the first model is loaded; models are loaded one at a time
so two checkpoints never sit in memory together.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console

from prunetool import __version__
from prunetool.errors import OptionError
from prunetool.evaluation.runner import (
    BACKENDS, OWN_KINDS, TaskManagers, evaluate_tasks, heldout_perplexity, make_lm, make_vllm_lm, vllm_arguments,
)
from prunetool.evaluation.efficiency import measure_efficiency, relative_to
from prunetool.evaluation.kv_eval import evaluate_long_context
from prunetool.evaluation.long_context import load_haystack, parse_name
from prunetool.evaluation.tasks import (
    DEFAULT_KV, HELDOUT, TaskPlan, data_dir_from, default_task_names, plan_tasks, split_names,
)
from prunetool.kv.schedules import parse_schedule
from prunetool.kv.snapkv import WINDOW
from prunetool.select.calibration import HOLDOUT_WINDOWS, load_calibration, recut_held_out
from prunetool.model.in_memory import prune_in_memory
from prunetool.model.loading import load_model
from prunetool.progress import window_progress
from prunetool.output.runs import current_pruned
from prunetool.sources import model_key, resolve_model

DEFAULT_CALIBRATION = {"calib": None, "seq_len": 512, "stride": 512, "samples": 16}


@dataclass(frozen=True, kw_only=True)
class EvalRequest:
    models: list[str]
    tasks: str | None
    data_dir: Path | None
    limit: int | None
    num_fewshot: int | None
    batch_size: str
    max_length: int | None
    calibration: dict  # for heldout_ppl when MODELs are given
    dtype: str
    device: str
    trust_remote_code: bool
    backend: str = "hf"  # "vllm": lm-eval tasks through vLLM, which loads each folder itself
    tensor_parallel: int = 1  # vllm only
    data_parallel: int = 1  # vllm only; for hf, `accelerate launch -m lm_eval` (docs/evaluation.md)
    placement: object = None  # loading.Placement: hf backend spread over devices by accelerate
    kv_budgets: tuple[str, ...] = ()  # schedules: long-context tasks also run on compressed KV caches
    kv_window: int = WINDOW  # SnapKV's observation window
    efficiency: bool = True  # measure parameters, KV bytes per token, prefill/decode speed per model (hf)


@dataclass(frozen=True)
class Candidate:
    label: str  # the column header: "base" / "pruned" / "patched" / "healed", or what the user typed
    spec: str
    role: str  # "base", "pruned", "patched", "healed" or "model"
    remove: tuple[int, ...] = ()  # layers to remove in memory after loading (the plain cut of a patched run)


def candidates(specs: list[str], calibration: dict) -> tuple[list[Candidate], dict | None, dict]:
    """The models to compare, the pruning record when comparing a prune with its base, and calibration options."""
    if specs:
        labels = []
        for spec in specs:
            label = spec if spec not in labels else f"{spec} #{labels.count(spec) + 1}"
            labels.append(label)
        return [Candidate(label, spec, "model") for label, spec in zip(labels, specs)], None, calibration
    run, folder = current_pruned()
    held_out = run["pruned"].get("held_out")
    if held_out is not None:  # exactly the windows prune held out
        options = {"held_out": held_out}
    else:
        options = {key: run.get("options", {}).get(key, value) for key, value in DEFAULT_CALIBRATION.items()}
        options["stride"] = options["stride"] or options["seq_len"]
    record = read_pruning_record(folder, run["pruned"])
    return run_candidates(run, folder, record), record, options


def run_candidates(run: dict, folder: Path, record: dict) -> list[Candidate]:
    """base | pruned | patched | healed, for whichever of them the current run has."""
    chosen = [Candidate("base", run["model"], "base")]
    if record.get("patch"):
        chosen += [Candidate("pruned", run["model"], "pruned", tuple(record["removed"])),
                   Candidate("patched", str(folder), "patched")]
    else:
        chosen.append(Candidate("pruned", str(folder), "pruned"))
    healed = run["pruned"].get("healed")
    if healed is not None:
        if not Path(healed["path"]).is_dir():
            raise OptionError(f"the current run's healed model {healed['path']} is gone; heal again, or name the "
                              "models to compare")
        chosen.append(Candidate("healed", healed["path"], "healed"))
    return chosen


def read_pruning_record(folder: Path, fallback: dict) -> dict:
    """The pruned folder's prune.json (what was removed, by which criterion, perplexity before and after)."""
    path = folder / "prune.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return dict(fallback)


def heldout_windows(first_source, model, tokenizer, options: dict):
    """The windows `prune` holds out: after the selection windows of the same calibration text, never overlapping."""
    if "held_out" in options:  # the current run: what prune recorded
        held = options["held_out"]
        held_out = recut_held_out(held, tokenizer, model_key(first_source))
    else:
        windows = load_calibration(options["calib"], tokenizer, seq_len=options["seq_len"], stride=options["stride"],
                                   samples=options["samples"], model=model, model_key=model_key(first_source),
                                   holdout=HOLDOUT_WINDOWS, small=options["samples"] == 0)
        held, held_out = windows.describe_held_out(), windows.held_out
    description = (f"{held['windows']} windows x {held['seq_len']} tokens of {held['source']} from token "
                   f"{held['first_token']}, after the {held['after_windows']} calibration windows")
    return held_out, description


def check_backend(request: EvalRequest) -> None:
    """--backend and its sizes, refused before any model or task is loaded."""
    if request.backend not in BACKENDS:
        raise OptionError(f"--backend must be one of {', '.join(BACKENDS)}, got {request.backend!r}")
    for flag, value in (("--tensor-parallel", request.tensor_parallel), ("--data-parallel", request.data_parallel)):
        if value < 1:
            raise OptionError(f"{flag} must be at least 1, got {value}")
        if value > 1 and request.backend != "vllm":
            raise OptionError(f"{flag} needs --backend vllm (data-parallel hf evaluation: `accelerate launch -m "
                              "lm_eval`, docs/evaluation.md)")
    if request.backend == "vllm" and vllm_mode() is None:
        raise OptionError("--backend vllm needs vLLM: `make engines` (engines/setup.sh vllm) sets up its CPU build "
                          "in a venv of its own, or pip install vllm on a machine with a supported GPU; or use "
                          "--backend hf")
    if request.backend == "vllm" and vllm_mode() == "server" and request.data_parallel > 1:
        raise OptionError("--data-parallel needs vllm installed in this environment (a GPU install); the CPU "
                          "build from `make engines` serves one replica")


def vllm_mode() -> str | None:
    """How --backend vllm runs here: "in-process" where this environment imports vllm (a GPU user's own
    install), "server" where only the engine venv of `make engines` has it (vLLM's CPU build, run as an
    OpenAI-compatible server in a separate process), None where neither."""
    import importlib.util

    from prunetool.serving.engines import vllm_python

    if importlib.util.find_spec("vllm") is not None:
        return "in-process"
    return "server" if vllm_python() is not None else None


def check_vllm_plans(plans, chosen) -> None:
    """vLLM loads folders and returns log-likelihoods only: no in-memory cut, no probes that read hidden states."""
    probes = [plan.name for plan in plans if plan.kind in ("hop", "heldout", "long")]
    if probes:
        raise OptionError(f"--backend vllm runs lm-eval tasks only; {', '.join(probes)} need --backend hf "
                          "(pass --tasks without them)")
    in_memory = [candidate.label for candidate in chosen if candidate.remove]
    if in_memory:
        raise OptionError(f"--backend vllm loads checkpoints from disk, and {', '.join(in_memory)} exists only in "
                          "memory (a patched run's plain cut); write it with `prunetool prune` or use --backend hf")


def kv_plans(plans: list[TaskPlan], request: EvalRequest) -> list[TaskPlan]:
    """With --kv-budget every task runs on compressed caches: the hop probes move to the long-context runner,
    and tasks that cannot (lm-eval's, held-out perplexity) are refused."""
    if not request.kv_budgets:
        return plans
    if request.kv_window < 1:
        raise OptionError(f"--kv-window must be at least 1 token, got {request.kv_window}")
    if request.backend != "hf":
        raise OptionError("--kv-budget compresses the cache inside this process: use --backend hf")
    other = [plan.name for plan in plans if plan.kind not in ("hop", "long")]
    if other:
        raise OptionError(f"--kv-budget applies to the long-context tasks (needle, multikey, hop_number, hop_name, or "
                          f"sized like needle_2048); run {', '.join(other)} without it")
    return [TaskPlan(plan.name, "long") for plan in plans]


def kv_schedules(request: EvalRequest, candidate: "Candidate", source) -> list:
    """Each --kv-budget checked against this model's layer count and context, before anything is loaded."""
    if not request.kv_budgets:
        return []
    from transformers import AutoConfig

    from prunetool.sources.checks import ships_our_code

    config = AutoConfig.from_pretrained(source.path,
                                        trust_remote_code=request.trust_remote_code or ships_our_code(source.path))
    text = config.get_text_config(decoder=True)
    layers = text.num_hidden_layers - len(candidate.remove)
    context = getattr(text, "max_position_embeddings", None) or 2**31
    try:
        return [parse_schedule(schedule, num_layers=layers, max_context=context) for schedule in request.kv_budgets]
    except OptionError as error:
        raise OptionError(f"{error} (model {candidate.label})") from None


def check_eval_options(request: EvalRequest) -> None:
    """Every option eval can check before resolving or loading a model."""
    if request.num_fewshot is not None and request.num_fewshot < 0:
        raise OptionError(f"--num-fewshot must be 0 or more, got {request.num_fewshot}")
    if request.limit is not None and request.limit < 1:
        raise OptionError(f"--limit must be at least 1, got {request.limit}")
    if request.max_length is not None and request.max_length < 16:
        raise OptionError(f"--max-length must be at least 16 tokens, got {request.max_length}")
    if request.batch_size != "auto" and not (request.batch_size.isdigit() and int(request.batch_size) >= 1):
        raise OptionError(f"--batch-size must be a positive integer or auto, got {request.batch_size!r}")
    check_backend(request)
    if request.backend == "vllm" and request.placement is not None:
        raise OptionError("--device-map places the hf backend's model; vLLM places its own (--tensor-parallel)")


def run_eval(request: EvalRequest, console: Console) -> dict:
    """Evaluate every candidate on every task; returns the report (also what --output writes)."""
    check_eval_options(request)
    data_dir = data_dir_from(request.data_dir)
    names = split_names(request.tasks) or (list(DEFAULT_KV) if request.kv_budgets else default_task_names(data_dir))
    plans = kv_plans(plan_tasks(names, data_dir), request)
    chosen, pruning, calibration = candidates(request.models, request.calibration)
    if request.backend == "vllm":
        check_vllm_plans(plans, chosen)
    sources = [resolve_model(c.spec, trust_remote_code=request.trust_remote_code) for c in chosen]
    schedules = [kv_schedules(request, candidate, source) for candidate, source in zip(chosen, sources)]
    long_tasks = [parse_name(plan.name) for plan in plans if plan.kind == "long"]
    haystack = load_haystack(data_dir) if long_tasks else None

    started, clock = datetime.now(timezone.utc), time.perf_counter()
    managers = TaskManagers(data_dir)
    models: dict[str, dict] = {}
    for candidate, source, model_schedules in zip(chosen, sources, schedules):
        model_clock = time.perf_counter()
        entry = {"model": candidate.spec, "path": str(source.path), "role": candidate.role}
        if request.backend == "vllm" and vllm_mode() == "server":
            entry |= evaluate_with_vllm_server(request, candidate.label, source, plans, managers, console)
        elif request.backend == "vllm":
            entry |= evaluate_with_vllm(request, source, plans, managers)
        else:
            job = CandidateJob(candidate, source, sources[0], calibration, plans, long_tasks, model_schedules, haystack)
            entry |= evaluate_loaded(request, job, managers, console)
        entry["seconds"] = time.perf_counter() - model_clock
        models[candidate.label] = entry
        gc.collect()
    add_relative_efficiency(models)
    return {
        "prunetool": {
            "version": __version__,
            "models": [{"label": c.label, "model": c.spec, "path": str(s.path), "role": c.role}
                       | ({"removed_in_memory": list(c.remove)} if c.remove else {})
                       for c, s in zip(chosen, sources)],
            "pruning": pruning,
            "tasks": [plan.name for plan in plans],
            "data_dir": str(data_dir) if data_dir else None,
            "limit": request.limit,
            "num_fewshot": request.num_fewshot,
            "backend": request.backend,
            **({"vllm": vllm_report(models)} if request.backend == "vllm" else {}),
            "kv_budgets": list(request.kv_budgets),
            "started": started.isoformat(timespec="seconds"),
            "seconds": time.perf_counter() - clock,
        },
        "models": models,
    }


def vllm_report(models: dict[str, dict]) -> dict:
    """How --backend vllm ran: in this process (lm-eval's VLLM) or as the engine venv's server, and which vLLM."""
    mode = vllm_mode()
    if mode == "in-process":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return {"mode": mode, "version": version("vllm")}
        except PackageNotFoundError:
            return {"mode": mode}
    versions = sorted({entry["backend"]["vllm_version"] for entry in models.values() if "backend" in entry})
    report = {"mode": mode, "version": versions[0] if len(versions) == 1 else versions,
              "lm_eval_model": "local-completions (echo + logprobs)"}
    settings = [entry["efficiency"]["setting"] for entry in models.values() if entry.get("efficiency")]
    if settings:
        report["efficiency_workload"] = settings[0]["workload"]
    return report


def add_relative_efficiency(models: dict[str, dict]) -> None:
    """Each model's efficiency also relative to the base's, where eval measured the base."""
    base = next((entry.get("efficiency") for entry in models.values() if entry.get("role") == "base"), None)
    for entry in models.values():
        if base and entry.get("efficiency"):
            entry["efficiency"]["relative_to_base"] = relative_to(base, entry["efficiency"])


def evaluate_with_vllm(request: EvalRequest, source, plans, managers) -> dict:
    """lm-eval's tasks through vLLM, which loads the checkpoint itself."""
    arguments = vllm_arguments(str(source.path), dtype=request.dtype, tensor_parallel=request.tensor_parallel,
                               data_parallel=request.data_parallel, batch_size=request.batch_size,
                               max_length=request.max_length, trust_remote_code=request.trust_remote_code)
    entry = {"backend": {"name": "vllm"} | {k: v for k, v in arguments.items() if k != "pretrained"}}
    entry["lm_eval"], entry["task_seconds"] = evaluate_tasks(
        make_vllm_lm(arguments), plans, managers, limit=request.limit, num_fewshot=request.num_fewshot)
    return entry


SERVER_KV_CACHE_GIB = 2  # VLLM_CPU_KVCACHE_SPACE for eval's server: lm-eval batches and the efficiency workload
EFFICIENCY_WORKLOAD = dict(prompt_tokens=512, new_tokens=32, concurrency=1, waves=3, warmup_waves=1)


def folder_context(folder: Path) -> int | None:
    """The model's context (max_position_embeddings) from config.json, its text config's where it nests one."""
    config = json.loads((Path(folder) / "config.json").read_text())
    config = config.get("text_config") or config
    return config.get("max_position_embeddings")


def evaluate_with_vllm_server(request: EvalRequest, label: str, source, plans, managers, console: Console) -> dict:
    """lm-eval's tasks through lm-eval's `local-completions` model against vLLM's OpenAI-compatible server (the
    CPU build of `make engines`, a separate process), then the efficiency workload against the same server."""
    from prunetool.evaluation.efficiency import folder_structure, served_efficiency
    from prunetool.evaluation.runner import make_server_lm, server_batch, server_lengths
    from prunetool.serving.load import Workload, measure
    from prunetool.serving.vllm_server import ServerSettings, VllmError, VllmServer, needs_remote_code
    from prunetool.sources.checks import ships_our_code

    folder = Path(source.path)
    trust = request.trust_remote_code or ships_our_code(folder) or needs_remote_code(folder)
    length, api_length = server_lengths(request.max_length, folder_context(folder))
    dtype = "float32" if request.dtype == "auto" else request.dtype  # vLLM's CPU build; as the hf backend's auto
    settings = ServerSettings(dtype=dtype, max_model_len=api_length, kv_cache_gib=SERVER_KV_CACHE_GIB,
                              trust_remote_code=trust, tensor_parallel=request.tensor_parallel)
    entry: dict = {}
    with window_progress(console) as progress:
        bar = progress.add_task(f"{label}: starting vLLM", total=len(plans) + request.efficiency)

        def show(name: str):
            progress.update(bar, description=f"{label}: {name} (vLLM)")

        with VllmServer(folder, settings) as server:
            entry["backend"] = {"name": "vllm", "engine": f"vLLM {server.version} (CPU build, OpenAI-compatible "
                                "server in a separate process)", "vllm_version": server.version,
                                "lm_eval_model": "local-completions", "max_length": length,
                                "api_max_length": api_length, "trust_remote_code": trust,
                                "server": settings.describe(), "start_seconds": round(server.start_seconds_taken, 1)}
            lm = make_server_lm(server.completions_url, server.model, str(folder), max_length=api_length,
                                batch_size=request.batch_size, trust_remote_code=trust)
            entry["backend"]["batch_size"] = server_batch(request.batch_size)
            try:
                entry["lm_eval"], entry["task_seconds"] = evaluate_tasks(
                    lm, plans, managers, limit=request.limit, num_fewshot=request.num_fewshot, on_task=show,
                    on_done=lambda name: progress.advance(bar))
                if request.efficiency:
                    show("efficiency")
                    workload = Workload(**EFFICIENCY_WORKLOAD | {
                        "prompt_tokens": min(EFFICIENCY_WORKLOAD["prompt_tokens"],
                                             api_length - EFFICIENCY_WORKLOAD["new_tokens"])})
                    special = set(lm.tokenizer.all_special_ids)
                    pool = [token for token in range(len(lm.tokenizer)) if token not in special]
                    speeds = measure(server.completions_url, server.model, workload, pool)
                    entry["efficiency"] = served_efficiency(
                        folder_structure(folder, dtype=dtype, trust_remote_code=trust), speeds,
                        engine=f"vLLM {server.version}", dtype=dtype, kv_cache_gib=settings.kv_cache_gib)
                    progress.advance(bar)
            except VllmError:
                raise
            except Exception as error:  # a failed request: one line naming vLLM, with the reason it logged
                raise server.failure(error) from error
    return entry


@dataclass
class CandidateJob:
    """What one candidate's hf evaluation needs besides the request."""

    candidate: object
    source: object
    base_source: object  # held-out text is the base's (generated calibration text is cached under its key)
    calibration: dict
    plans: list
    long_tasks: list
    schedules: list
    haystack: tuple | None


def evaluate_loaded(request: EvalRequest, job: CandidateJob, managers, console: Console) -> dict:
    """Load one candidate (pruned in memory where it is a cut of its base) and run every task on it."""
    candidate, plans = job.candidate, job.plans
    entry: dict = {}
    model, tokenizer = load_model(job.source, dtype=request.dtype, device=request.device,
                                  trust_remote_code=request.trust_remote_code, placement=request.placement)
    if candidate.remove:
        prune_in_memory(model, candidate.remove)
        entry["removed_in_memory"] = list(candidate.remove)
    held_out = None
    if any(plan.kind == "heldout" for plan in plans):  # may generate calibration text: its own progress bar
        held_out = heldout_windows(job.base_source, model, tokenizer, job.calibration)
    lm = None  # lm-eval's wrapper only when an lm-eval task runs (held-out and long-context tasks are ours)
    if any(plan.kind not in OWN_KINDS for plan in plans):
        lm = make_lm(model, tokenizer, request.batch_size, request.max_length)
        entry["max_length"], entry["batch_size"] = lm.max_length, lm.batch_size
    with window_progress(console) as progress:
        bar = progress.add_task(candidate.label, total=len(plans))

        def show(name: str, label=candidate.label):
            progress.update(bar, description=f"{label}: {name}")

        entry["lm_eval"], entry["task_seconds"] = evaluate_tasks(
            lm, plans, managers, limit=request.limit, num_fewshot=request.num_fewshot,
            on_task=show, on_done=lambda name: progress.advance(bar))
        if held_out is not None:
            show(HELDOUT)
            entry[HELDOUT] = heldout_perplexity(model, *held_out)
            progress.advance(bar)
        if job.long_tasks:
            def document_done(task: str, number: int, total: int):
                show(f"{task} {number}/{total}")
                if number == total:
                    progress.advance(bar)

            entry["long_context"] = evaluate_long_context(
                model, tokenizer, job.long_tasks, job.schedules, window=request.kv_window, haystack=job.haystack[0],
                limit=request.limit, on_document=document_done) | {"haystack": job.haystack[1]}
        if request.efficiency:
            show("efficiency")
            entry["efficiency"] = measure_efficiency(model)
    del lm, model, tokenizer
    return entry


def jsonable(report: dict) -> dict:
    """lm-eval's configs hold callables (dataset loaders); JSON gets their names, as lm-eval's own writer does."""
    from lm_eval.utils import handle_non_serializable

    return json.loads(json.dumps(report, default=handle_non_serializable))
