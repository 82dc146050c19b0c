"""`prunetool heal`: distil the unpruned base back into a pruned checkpoint, then write, verify, record.

Order, as in prune: every option and the output folder are checked before anything slow; the teacher's
tokenizer must be the student's; the training text is cut before training starts, so a text too short for
the budget fails with one line; training runs (checkpoints every --save-every steps); the trained tensors
are rounded to the checkpoint's dtype in memory, the held-out perplexity of that exact model is the one the
reloaded folder must match, and the folder is published only after verify_checkpoint passes.

Text: prune's held-out windows (prune.json perplexity.held_out) are re-cut from the same stream and must
hash the same; training windows start at the first token after them (`last_token + 1`), so they overlap
neither the selection windows nor the held-out ones. `--calib SOURCE` trains on other text instead, from
its first token. The written folder is the pruned folder with the trained tensors replaced: every other
tensor is byte-identical, and config.json is unchanged.

Interruption (Ctrl-C) leaves the last checkpoint and publishes nothing; `--resume` continues from it.
"""

import dataclasses
import json
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from prunetool.model.architecture import decoder_of
from prunetool.select.calibration import load_calibration, recut_held_out
from prunetool.checkpoint_io import remove_tree, write_json_atomic
from prunetool.errors import CalibrationError, ModelSourceError, OptionError, PrunetoolError
from prunetool.model.loading import load_model, offloaded_to_disk, pick_device, pick_dtype
from prunetool.memory import peak_memory
from prunetool.model.perplexity import perplexity
from prunetool.progress import window_progress
from prunetool.output.runs import current_pruned, current_run_path
from prunetool.sources import model_key, resolve_model
from prunetool.checkpoint.verify import VerifySetting, verify_checkpoint
from prunetool.repair.distributed import check_launch, open_world, sharded_launch

TRAIN_MODES = ("lora", "adjacent", "all")
REPORT_TO = ("tensorboard", "wandb")
DEFAULT_LR = {"lora": 1e-3, "adjacent": 2e-5, "all": 2e-5}  # lora: bench/results/repair_heal_lr.json
LORA_ALPHA_PER_RANK = 2  # lora_alpha = 2 r: merged update B @ A * 2


@dataclass(frozen=True, kw_only=True)
class HealRequest:
    """Everything `heal` was asked; built by keyword so a new option cannot shift the others."""

    model: str | None = None  # a folder written by prune; None: the current run's pruned model
    teacher: str | None = None  # None: the base prune.json names
    calib: str | None = None  # None: prune's calibration text, after its held-out windows
    tokens: int
    epochs: int = 1  # passes over the training text: the budget needs tokens / epochs of unseen text
    seq_len: int = 256
    train: str = "lora"
    lora_rank: int = 8
    lr: float | None = None  # None: DEFAULT_LR[train]
    batch_size: int = 4
    grad_accum: int = 1
    temperature: float = 1.0
    ce_weight: float = 0.5  # half KL, half CE: beat pure KL and pure CE in bench/results/repair_heal-*-h200.json
    save_every: int | None = None
    resume: bool = False
    checkpoint_dir: Path | None = None
    output: Path | None = None
    force: bool = False
    verify: bool = True
    dtype: str = "auto"
    device: str = "auto"
    placement: object = None  # loading.Placement: teacher and student spread over devices by accelerate
    seed: int = 0
    trust_remote_code: bool = False
    report_to: str | None = None  # an accelerate tracker (tensorboard, wandb); None: no tracker


def check_options(request: HealRequest) -> None:
    if request.tokens < 1:
        raise OptionError(f"--tokens must be at least 1, got {request.tokens}")
    if request.train not in TRAIN_MODES:
        raise OptionError(f"--train must be one of {', '.join(TRAIN_MODES)}, got {request.train!r}")
    if request.seq_len < 2:
        raise OptionError(f"--seq-len must be at least 2 (one predicted token), got {request.seq_len}")
    for flag, value in (("--batch-size", request.batch_size), ("--grad-accum", request.grad_accum),
                        ("--epochs", request.epochs),
                        ("--lora-rank", request.lora_rank), ("--save-every", request.save_every)):
        if value is not None and value < 1:
            raise OptionError(f"{flag} must be at least 1, got {value}")
    if not request.temperature > 0:
        raise OptionError(f"--temperature must be positive, got {request.temperature}")
    if not 0 <= request.ce_weight <= 1:
        raise OptionError(f"--ce-weight must be in [0, 1], got {request.ce_weight}")
    if request.lr is not None and not request.lr > 0:
        raise OptionError(f"--lr must be positive, got {request.lr}")
    if request.report_to is not None and request.report_to not in REPORT_TO:
        raise OptionError(f"--report-to must be one of {', '.join(REPORT_TO)}, got {request.report_to!r}")
    if request.report_to is not None:
        from accelerate.utils import is_tensorboard_available, is_wandb_available

        if not {"tensorboard": is_tensorboard_available, "wandb": is_wandb_available}[request.report_to]():
            raise OptionError(f"--report-to {request.report_to}: the {request.report_to} package is not installed "
                              f"(pip install {request.report_to})")
    check_launch(global_batch=request.batch_size * request.grad_accum, batch_size=request.batch_size,
                 placement=request.placement, save_every=request.save_every, resume=request.resume)


def student_folder(request: HealRequest) -> tuple[Path, dict | None]:
    """The pruned folder and, when it is the current run's, the run record (to add `healed` to)."""
    if request.model is None:
        run, folder = current_pruned()
        return folder.resolve(), run
    folder = Path(request.model).expanduser()
    if not (folder / "prune.json").is_file():
        raise OptionError(f"{request.model} is not a folder written by `prunetool prune` (no prune.json)")
    try:  # MODEL named the current run's pruned model: record the healed one there too
        run, current = current_pruned()
    except PrunetoolError:
        return folder.resolve(), None
    return folder.resolve(), run if current.resolve() == folder.resolve() else None


def default_output(folder: Path) -> Path:
    return Path.cwd() / f"{folder.name}-healed"


def check_same_tokenizer(student_tokenizer, teacher_tokenizer, student, teacher, teacher_spec: str) -> None:
    """Distillation compares distributions over token ids, so both must mean the same thing by every id."""
    vocab = [m.config.get_text_config(decoder=True).vocab_size for m in (student, teacher)]
    if vocab[0] != vocab[1]:
        raise OptionError(f"the teacher {teacher_spec} has a vocabulary of {vocab[1]} tokens and the student "
                          f"{vocab[0]}; heal needs the pruned model's own base (or one with its tokenizer)")
    if (len(student_tokenizer) != len(teacher_tokenizer) or student_tokenizer.get_vocab() != teacher_tokenizer.get_vocab()
            or student_tokenizer.all_special_ids != teacher_tokenizer.all_special_ids):
        raise OptionError(f"the teacher {teacher_spec} has a different tokenizer from the student's (token ids do "
                          "not match); heal needs the pruned model's own base (or one with its tokenizer)")


def training_windows(request: HealRequest, held: dict, tokenizer, key: str | None, count: int) -> tuple[torch.Tensor, dict]:
    """`count` windows of --seq-len: after prune's held-out windows in its text, or from the start of --calib.

    With --epochs E only ceil(count / E) distinct windows are read; each later pass repeats them in its own
    seeded order, so a budget larger than the text is an explicit choice, never a silent reuse."""
    spec = request.calib if request.calib is not None else held["spec"]
    first = 0 if request.calib is not None else held["last_token"] + 1
    where = f"in {request.calib}" if request.calib is not None else "after the held-out windows"
    distinct = math.ceil(count / request.epochs)
    try:
        windows = load_calibration(spec, tokenizer, seq_len=request.seq_len, samples=0, holdout=distinct,
                                   holdout_from=first, model_key=key)
    except CalibrationError as error:
        available = getattr(error, "available", None)
        if available is None:
            raise
        raise CalibrationError(f"calibration text too short for --tokens {request.tokens}: have {available} tokens "
                               f"{where} ({distinct} windows of {request.seq_len} needed; lower --tokens, raise "
                               "--epochs or pass --calib with more text)") from None
    if request.calib is None and windows.sha256 != held["sha256"]:
        raise CalibrationError(f"prune's calibration text {held['source']} has changed since it was pruned; prune again")
    record = {"source": windows.source, "spec": spec, "sha256": windows.sha256, "seq_len": request.seq_len,
              "windows": distinct, "epochs": request.epochs, "first_token": first,
              "last_token": first + distinct * request.seq_len - 1,
              "disjoint_from": ("prune's selection and held-out windows (same text, after held_out.last_token)"
                                if request.calib is None else "prune's windows: a different text (--calib)")}
    return repeated_windows(windows.held_out, count, request.seed), record


def repeated_windows(unique: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    """The first `count` rows of: `unique` in order, then each further pass in its own permutation (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    passes = [unique]
    while sum(len(part) for part in passes) < count:
        passes.append(unique[torch.randperm(len(unique), generator=generator)])
    return torch.cat(passes)[:count]


def adjacent_layers(record: dict) -> list[int]:
    """New indices of the kept layers right before and after each contiguous removed run."""
    from prunetool.repair.sites import contiguous_runs

    index_map = {int(old): new for old, new in record["index_map"].items()}
    found = set()
    for first, last in contiguous_runs(record["removed"]):
        for neighbour in (first - 1, last + 1):
            if neighbour in index_map:
                found.add(index_map[neighbour])
    return sorted(found)


def lora_targets(model) -> list[str]:
    """Full names of every nn.Linear inside the decoder layers (attention and MLP projections)."""
    owner = {id(module): name for name, module in model.named_modules()}
    names = []
    for layer in decoder_of(model).layers:
        for name, module in layer.named_modules():
            if isinstance(module, torch.nn.Linear) and name:
                names.append(f"{owner[id(layer)]}.{name}")
    return names


def prepare_student(model, request: HealRequest, record: dict):
    """Freeze everything, then make trainable what --train names; returns (model to train, description)."""
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    if request.train == "lora":
        from peft import LoraConfig, get_peft_model

        targets = lora_targets(model)
        torch.manual_seed(request.seed)  # the adapters' A init
        config = LoraConfig(r=request.lora_rank, lora_alpha=LORA_ALPHA_PER_RANK * request.lora_rank,
                            lora_dropout=0.0, target_modules=targets, bias="none")
        with warnings.catch_warnings():  # peft calls transformers' deprecated is_gradient_checkpointing
            warnings.simplefilter("ignore", FutureWarning)
            wrapped = get_peft_model(model, config)
        return wrapped, {"lora_rank": request.lora_rank,
                                               "lora_alpha": LORA_ALPHA_PER_RANK * request.lora_rank,
                                               "modules": len(targets)}
    if request.train == "adjacent":
        layers = adjacent_layers(record)
        decoder = decoder_of(model)
        for index in layers:
            for parameter in decoder.layers[index].parameters():
                parameter.requires_grad_(True)
        return model, {"layers": layers}
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    return model, {}


def lora_adapters(peft_model) -> dict[str, dict]:
    """{base module name: {"A", "B", "scale"}} before merging: what an independent merge needs."""
    adapters = {}
    for name, module in peft_model.base_model.model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            adapters[name] = {"A": module.lora_A["default"].weight.detach().clone(),
                              "B": module.lora_B["default"].weight.detach().clone(),
                              "scale": float(module.scaling["default"])}
    return adapters


def disk_names(folder: Path, model, names: list[str]) -> dict[str, tuple[str, torch.dtype]]:
    """Model parameter names -> (tensor name in the pruned folder, its dtype)."""
    from prunetool.checkpoint.surgery import patched_tensor_names
    from prunetool.checkpoint.surgery.safetensors_io import torch_dtype_of
    from prunetool.sources.weights import read_weights

    decoder = decoder_of(model)
    relative_of = {id(p): name for name, p in decoder.named_parameters(remove_duplicate=False)}
    parameters = dict(model.named_parameters())
    relative = {name: relative_of[id(parameters[name])] for name in names if id(parameters[name]) in relative_of}
    found = patched_tensor_names(folder, list(relative.values())) if relative else {}
    entries = {entry.name: entry for shard in read_weights(folder).shards for entry in shard.entries}
    result = {}
    for name in names:
        if name in relative:
            result[name] = found[relative[name]]
        elif name in entries:
            result[name] = (name, torch_dtype_of(entries[name]))
        else:
            raise ModelSourceError(f"cannot find the trained tensor {name} in {folder}")
    return result


def heal_progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[speed]}"), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console, transient=True)


def report_step(progress: Progress, task, step: int, loss: float) -> None:
    """One finished optimizer step (the tests replace this to interrupt a run)."""
    progress.update(task, completed=step, loss=f"{loss:.4f}")


def step_reporter(progress: Progress, task, tokens_per_step: int, first_step: int):
    """report_step plus tokens/s of the whole run (every rank's tokens: the global batch per step)."""
    clock = time.perf_counter()

    def on_step(step: int, loss: float) -> None:
        report_step(progress, task, step, loss)
        speed = (step - first_step) * tokens_per_step / max(time.perf_counter() - clock, 1e-9)
        progress.update(task, speed=f"{speed:,.0f} tok/s")

    return on_step


def loss_summary(losses: list[float]) -> dict:
    tail = losses[-max(1, len(losses) // 10):]
    points = sorted({round(i * (len(losses) - 1) / 19) for i in range(20)}) if len(losses) > 1 else [0]
    return {"first": losses[0], "last": losses[-1], "min": min(losses), "mean_last_10pct": sum(tail) / len(tail),
            "curve": [[step + 1, losses[step]] for step in points]}


def passes(data: dict) -> str:
    """`3 passes over 512 windows; ` where the text was repeated, else nothing."""
    epochs = data.get("epochs", 1)
    return f"{epochs} passes over {data['windows']} windows; " if epochs > 1 else ""


def heal_paragraph(heal: dict) -> str:
    ppl = heal["perplexity"]
    rows = ""
    if ppl is not None:
        rows = (f"\n\nHeld-out perplexity (prune's held-out windows): {ppl['before']:.3f} before healing, "
                f"{ppl['after']:.3f} after.")
    trained = {"lora": f"LoRA adapters (r={heal['parameters'].get('lora_rank')}) on every attention and MLP "
                       "projection, merged into the weights",
               "adjacent": f"all weights of the kept layers next to each cut (new indices "
                           f"{heal['parameters'].get('layers')})",
               "all": "every weight"}[heal["train"]]
    return (f"\n## Healed by distillation\n\nAfter the cut, `prunetool heal` trained {trained} to match the base "
            f"model's next-token distributions (forward KL, temperature {heal['temperature']:g}, cross-entropy weight "
            f"{heal['ce_weight']:g}) on {heal['tokens']} tokens of {heal['data']['source']} that no selection or "
            f"held-out window used ({passes(heal['data'])}{heal['steps']} steps, AdamW, peak learning rate {heal['lr']:g}, warmup then "
            f"cosine). {len(heal['tensors'])} tensors changed; every other tensor is byte-identical to the pruned "
            f"checkpoint.{rows}\n\nReproduce:\n\n```bash\n{heal['command']}\n```\n")


def trained_tensors(model, student, train: str, folder: Path):
    """(the student with LoRA merged, the adapters or None, {checkpoint name: trained tensor}); the student's
    parameters are rounded to the checkpoint's dtype, which is what a reload of the written folder holds."""
    adapters = None
    if train == "lora":
        adapters = lora_adapters(model)
        names = [f"{name}.weight" for name in adapters]
        student = model.merge_and_unload()
    else:
        names = [name for name, parameter in student.named_parameters() if parameter.requires_grad]
    student.requires_grad_(False)
    on_disk = disk_names(folder, student, names)
    replacements = {}
    parameters = dict(student.named_parameters())
    with torch.no_grad():
        for name in names:
            disk_name, disk_dtype = on_disk[name]
            value = parameters[name].detach()
            replacements[disk_name] = value.to("cpu", copy=True)
            parameters[name].copy_(value.to(disk_dtype).to(parameters[name].dtype))  # what a reload will hold
    return student, adapters, replacements


def run_heal(request: HealRequest, console: Console) -> dict:
    """Check, load, cut text, train, write, verify, record; returns what the CLI prints.

    Longer than 60 lines on purpose: one straight sequence of stages whose dozen shared values (windows,
    held-out text, setting, fingerprint, the record) would otherwise be passed between helpers; the stages
    that stand alone (student_folder, training_windows, prepare_student, trained_tensors) are functions.
    """
    from prunetool.repair.train import TrainConfig, load_checkpoint, train
    from prunetool.checkpoint.surgery import write_replaced_checkpoint
    from prunetool.checkpoint.surgery.output import check_output

    check_options(request)
    folder, run = student_folder(request)
    record = json.loads((folder / "prune.json").read_text())
    held = (record.get("perplexity") or {}).get("held_out")
    if held is None:
        raise OptionError(f"{folder} was pruned with --no-verify, so it records no held-out windows to keep the "
                          "training text apart from; prune again without --no-verify")
    output = Path(request.output or default_output(folder))
    check_output(folder, output, request.force)
    checkpoint_dir = Path(request.checkpoint_dir or output.with_name(output.name + ".checkpoint")).absolute()
    if request.resume and not (checkpoint_dir / "state.pt").is_file():
        raise OptionError(f"--resume: no checkpoint in {checkpoint_dir}; run without --resume")
    lr = request.lr if request.lr is not None else DEFAULT_LR[request.train]
    per_step = request.batch_size * request.grad_accum
    steps = math.ceil(request.tokens / (per_step * request.seq_len))
    count = steps * per_step

    clock = time.perf_counter()
    target = pick_device(request.device)
    if sharded_launch() and target.type == "cpu":
        raise OptionError(f"accelerate runs {sharded_launch()} only on GPUs (on CPU it would silently train "
                          "unsharded); use a DDP launch on CPU: accelerate launch --multi_gpu --num_processes N")
    world = open_world(cpu=target.type == "cpu", global_batch=per_step, batch_size=request.batch_size,
                       clip=TrainConfig.clip, report_to=request.report_to, project_dir=checkpoint_dir.parent)
    if world.distributed:  # every rank on its own device (cuda:LOCAL_RANK), and only the main rank speaks
        target = world.accelerator.device
        console = console if world.main else Console(stderr=True, quiet=True)
    setting = VerifySetting(pick_dtype(request.dtype, target), target)
    device = str(target) if world.distributed else request.device
    teacher_spec = request.teacher or record["source_path"]
    teacher_source = resolve_model(teacher_spec, trust_remote_code=request.trust_remote_code)
    student_source = resolve_model(str(folder), trust_remote_code=request.trust_remote_code)
    teacher, teacher_tokenizer = load_model(teacher_source, dtype=request.dtype, device=device,
                                            trust_remote_code=request.trust_remote_code, placement=request.placement)
    # the student trains in float32 (AdamW on bfloat16 weights loses small updates); with --dtype bfloat16 its
    # matmuls run under bf16 autocast, on GPU and CPU alike (2.5x faster on a CPU with AMX: docs/repair.md)
    student, tokenizer = load_model(student_source, dtype="float32", device=device,
                                    trust_remote_code=request.trust_remote_code, placement=request.placement)
    if offloaded_to_disk(student):  # training writes into the weights, which would sit on `meta`
        raise OptionError("heal trains the student's weights, so none may be offloaded to disk; raise --max-memory "
                          "(the teacher may still spill to disk when it is the larger model)")
    check_same_tokenizer(tokenizer, teacher_tokenizer, student, teacher, teacher_spec)
    base = dataclasses.replace(teacher_source, spec=record.get("base_model") or teacher_spec,
                               path=Path(record["source_path"]))
    key = model_key(base)  # prune's generated text is cached under its base's key
    held_out = recut_held_out(held, tokenizer, key)
    windows, data = training_windows(request, held, tokenizer, key, count)
    console.print(f"loaded student, teacher and {count} training windows in {time.perf_counter() - clock:.1f}s",
                  highlight=False)

    before = perplexity(student, held_out) if world.main else None  # the others wait in the first all-reduce
    model, trained = prepare_student(student, request, record)
    fingerprint = {"student": str(folder), "teacher": str(teacher_source.path), "train": request.train,
                   "lora_rank": request.lora_rank if request.train == "lora" else None, "tokens": request.tokens,
                   "seq_len": request.seq_len, "batch_size": request.batch_size, "grad_accum": request.grad_accum,
                   "lr": lr, "temperature": request.temperature, "ce_weight": request.ce_weight,
                   "epochs": request.epochs, "data_sha256": data["sha256"], "first_token": data["first_token"], "seed": request.seed}
    config = TrainConfig(steps=steps, batch_size=request.batch_size, grad_accum=request.grad_accum, lr=lr,
                         temperature=request.temperature, ce_weight=request.ce_weight,
                         autocast_bf16=setting.dtype == torch.bfloat16,
                         fingerprint=fingerprint)
    torch.manual_seed(request.seed)
    world.track(dataclasses.asdict(request) | {"steps": steps, "world_size": world.size})
    first_step = load_checkpoint(checkpoint_dir, config)["step"] if request.resume else 0
    with heal_progress(console) as progress:
        task = progress.add_task(f"heal ({request.train}, {world.size} rank{'s' * (world.size > 1)})", total=steps,
                                 loss="-", speed="")
        result = train(model, teacher, windows, config, checkpoint_dir=checkpoint_dir,
                       save_every=request.save_every, resume=request.resume, world=world,
                       on_step=step_reporter(progress, task, per_step * request.seq_len, first_step))
    peak = peak_memory(target)  # this rank's, before verification loads anything more: what a launch must provide
    del teacher
    world.finish()
    if not world.main:  # the main rank writes, verifies and records; a failure there fails the launch
        return {"output": None, "rank": world.rank}
    if result.full_state is not None:  # sharded training: an unsharded student on this rank takes the weights
        student, _ = load_model(student_source, dtype="float32", device=str(target),
                                trust_remote_code=request.trust_remote_code)
        model, _ = prepare_student(student, request, record)
        model.load_state_dict(result.full_state)
    student, adapters, replacements = trained_tensors(model, student, request.train, folder)
    student.to(setting.dtype)
    after = perplexity(student, held_out)
    tokens = count * request.seq_len
    heal = {"train": request.train, "parameters": trained, "teacher": str(teacher_source.path),
            "tokens": tokens, "tokens_requested": request.tokens, "steps": steps, "seq_len": request.seq_len,
            "batch_size": request.batch_size, "grad_accum": request.grad_accum, "lr": lr,
            "schedule": f"linear warmup over {config.warmup} steps, then cosine decay to 0", "optimizer": "AdamW",
            "grad_clip": config.clip, "temperature": request.temperature, "ce_weight": request.ce_weight,
            "compute": "float32 weights under bfloat16 autocast" if config.autocast_bf16 else "float32",
            "loss": "(1 - ce_weight) * T^2 * KL(teacher || student) + ce_weight * CE", "seed": request.seed,
            "data": data, "seconds": round(result.seconds, 3),
            "tokens_per_second": round((steps - (result.resumed_from or 0)) * per_step * request.seq_len
                                       / max(result.seconds, 1e-9), 2),
            "resumed_from_step": result.resumed_from, "loss_summary": loss_summary(result.losses),
            "world_size": world.size, "micro_batch": world.micro_batch, "micro_batches_per_rank": world.micro_batches,
            "training_peak": peak,
            "perplexity": {"before": before, "after": after, "held_out": held, "before_dtype": "float32",
                           "after_dtype": str(setting.dtype).removeprefix("torch.")},
            "tensors": sorted(replacements), "command": heal_command(request, folder)}
    verification: dict = {}

    def check(staging: Path) -> None:
        verification.update(verify_checkpoint(staging, expected_layers=len(decoder_of(student).layers),
                                              held_out=held_out, expected_perplexity=after, setting=setting))

    card = (folder / "README.md").read_text() if (folder / "README.md").is_file() else ""
    extra = {"prune.json": json.dumps(record | {"heal": heal}, indent=1) + "\n", "README.md": card + heal_paragraph(heal)}
    with window_progress(console) as progress:
        progress.add_task("writing shards", total=None)
        write_replaced_checkpoint(folder, output, replacements, force=request.force, extra_files=extra,
                                  before_publish=check if request.verify else None)
    remove_tree(checkpoint_dir)
    if run is not None:
        run["pruned"]["healed"] = {"path": str(output.resolve()), "train": request.train, "tokens": tokens,
                                   "perplexity": {"before": before, "after": after}}
        write_json_atomic(current_run_path(), run)
    return {"output": str(output), "heal": heal, "losses": result.losses, "verification": verification or None,
            "adapters": adapters, "replacements": replacements}


def heal_command(request: HealRequest, folder: Path) -> str:
    parts = ["prunetool heal", str(folder), "--train", request.train, "--tokens", str(request.tokens),
             *(["--epochs", str(request.epochs)] if request.epochs != 1 else []),
             "--seq-len", str(request.seq_len), "--batch-size", str(request.batch_size), "--grad-accum",
             str(request.grad_accum), "--temperature", f"{request.temperature:g}", "--ce-weight",
             f"{request.ce_weight:g}"]
    if request.train == "lora":
        parts += ["--lora-rank", str(request.lora_rank)]
    if request.lr is not None:
        parts += ["--lr", f"{request.lr:g}"]
    if request.calib is not None:
        parts += ["--calib", request.calib]
    if request.dtype != "auto":
        parts += ["--dtype", request.dtype]
    return " ".join(parts)
