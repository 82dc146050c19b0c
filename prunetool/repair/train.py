"""The heal training loop: one optimizer step at a time, checkpoints that make a resumed run exact.

Data order is fixed (window k of the training windows is used at micro-batch k), so the data position
is a count; together with the trainable tensors, AdamW's and the scheduler's state and every RNG state,
a checkpoint is enough to continue bit for bit on the CPU: the resumed run computes the same losses and
ends with the same weights as an uninterrupted one (tests/test_heal.py).

Teacher logits are computed on the fly for every micro-batch. Caching the teacher's top-k logits once
would save the teacher forward on repeated passes, but heal makes one pass over its text and we have not
measured top-k caching yet, so the simple, exact way stays until a measurement says otherwise. With
--ce-weight 1 (plain fine-tuning, the baseline) the teacher is not run at all.
"""

import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from prunetool.checkpoint_io import staged_folder
from prunetool.model.loading import input_device
from prunetool.errors import TrainingError
from prunetool.repair.distill import distill_loss, lr_factor, warmup_steps
from prunetool.repair.distributed import World

CHECKPOINT_FILE = "state.pt"


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int
    batch_size: int
    grad_accum: int
    lr: float
    temperature: float = 1.0
    ce_weight: float = 0.0
    clip: float = 1.0
    weight_decay: float = 0.0
    autocast_bf16: bool = False  # bfloat16 autocast (weights and optimizer stay float32)
    fingerprint: dict = field(default_factory=dict)  # what a checkpoint must match to be resumed

    @property
    def warmup(self) -> int:
        return warmup_steps(self.steps)


@dataclass
class TrainResult:
    losses: list[float]
    steps: int
    seconds: float  # of this process's training (a resumed run: the part after resuming)
    resumed_from: int | None
    full_state: dict | None = None  # sharded training (FSDP, ZeRO-3): the gathered state dict, on the main rank


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: parameter for name, parameter in model.named_parameters() if parameter.requires_grad}


def save_checkpoint(folder: Path, *, model, optimizer, scheduler, step: int, position: int, losses: list[float],
                    config: TrainConfig) -> None:
    """Everything a resumed run needs, written beside `folder` and renamed into place (the old one goes last)."""
    state = {"step": step, "position": position, "losses": list(losses), "fingerprint": config.fingerprint,
             "config": asdict(config), "trainable": {name: p.detach().clone() for name, p in trainable(model).items()},
             "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng_state()}
    with staged_folder(Path(folder), force=True) as staging:
        torch.save(state, staging / CHECKPOINT_FILE)


def load_checkpoint(folder: Path, config: TrainConfig) -> dict:
    path = Path(folder) / CHECKPOINT_FILE
    if not path.is_file():
        raise TrainingError(f"--resume: no checkpoint at {path}; run without --resume to start over")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("fingerprint") != config.fingerprint:
        changed = sorted(key for key in set(config.fingerprint) | set(state.get("fingerprint") or {})
                         if (state.get("fingerprint") or {}).get(key) != config.fingerprint.get(key))
        raise TrainingError(f"--resume: the checkpoint in {folder} is from a different heal run (differs in "
                            f"{', '.join(changed)}); run with the same options, or without --resume")
    return state


def train(student, teacher, windows: torch.Tensor, config: TrainConfig, *, checkpoint_dir: Path | None = None,
          save_every: int | None = None, resume: bool = False,
          on_step: Callable[[int, float], None] | None = None, world: World | None = None) -> TrainResult:
    """Distil `teacher` into the trainable parameters of `student` over `windows` (N, T), in order.

    Needs N >= steps * batch_size * grad_accum. Under a launcher each rank takes its contiguous share of every
    step's global batch (`world`); losses are the mean over all ranks. Only the main rank writes checkpoints.
    A non-finite loss stops training with a TrainingError before the step is applied; the caller then
    publishes nothing (under a launcher the failing rank's exit stops the others).
    """
    world = world or World(micro_batch=config.batch_size, micro_batches=config.grad_accum)
    device = input_device(student)  # where its embedding is: the first device of a spread (--device-map) model
    parameters = list(trainable(student).values())
    optimizer = torch.optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config.steps, config.warmup))
    start, position, losses, resumed_from = 0, 0, [], None
    if resume:
        state = load_checkpoint(checkpoint_dir, config)
        with torch.no_grad():
            for name, parameter in trainable(student).items():
                parameter.copy_(state["trainable"][name])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        start, position, losses, resumed_from = state["step"], state["position"], list(state["losses"]), state["step"]
    per_step = config.batch_size * config.grad_accum
    if windows.shape[0] < config.steps * per_step:
        raise TrainingError(f"{windows.shape[0]} training windows for {config.steps} steps of {per_step}")
    unwrapped = student
    student, optimizer = world.prepare(student, optimizer)  # after resuming: DDP broadcasts rank 0's weights
    teacher = world.prepare_teacher(teacher)
    share = world.micro_batch * world.micro_batches  # this rank's windows per step
    student.train()
    teacher.eval()
    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=config.autocast_bf16)
    clock = time.perf_counter()
    for step in range(start, config.steps):
        total = 0.0
        first = position + world.rank * share
        for micro in range(world.micro_batches):
            start_row = first + micro * world.micro_batch
            batch = windows[start_row:start_row + world.micro_batch].to(device)
            teacher_logits = None
            if config.ce_weight < 1.0:  # plain fine-tuning (a = 1) never reads the teacher
                with torch.no_grad(), autocast:
                    teacher_logits = teacher(input_ids=batch, use_cache=False).logits
            with autocast:
                student_logits = student(input_ids=batch, use_cache=False).logits
            if teacher_logits is not None:  # spread models may end on other devices
                teacher_logits = teacher_logits.to(student_logits.device)
            loss = distill_loss(student_logits, teacher_logits, batch.to(student_logits.device), temperature=config.temperature,
                                ce_weight=config.ce_weight)
            value = float(loss.detach())
            if not math.isfinite(value):
                raise TrainingError(f"the loss became {value} at step {step + 1}; nothing was written (lower "
                                    "--lr, or use --dtype float32); checkpoints written so far are kept")
            world.backward(student, loss)
            total += value / world.micro_batches
        position += per_step
        world.clip(student, parameters, config.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        total = world.mean(total)
        losses.append(total)
        done = step + 1
        if checkpoint_dir is not None and save_every and done % save_every == 0 and done < config.steps:
            if world.main:
                save_checkpoint(checkpoint_dir, model=unwrapped, optimizer=optimizer, scheduler=scheduler, step=done,
                                position=position, losses=losses, config=config)
            world.wait()  # no rank runs ahead of a checkpoint a resumed run would start from
        if on_step is not None:
            on_step(done, total)
        world.log({"loss": total, "lr": scheduler.get_last_lr()[0]}, step=done)
    student.eval()
    seconds = time.perf_counter() - clock
    full_state = world.accelerator.get_state_dict(student) if world.sharded else None  # every rank gathers
    return TrainResult(losses, config.steps, seconds, resumed_from, full_state)
