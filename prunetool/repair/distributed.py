"""Where heal trains: one process, or one rank of `accelerate launch` / `torchrun` (data parallel, FSDP, DeepSpeed).

A launcher announces itself through WORLD_SIZE (torchrun and accelerate both set it); without one, heal stays a
plain process and never builds an Accelerator, so the single-process loop keeps its speed. Ranks split every
optimizer step's global batch (--batch-size x --grad-accum windows) into equal contiguous shares, so N ranks see
exactly the windows one process sees per step; accelerate averages the gradients, which makes the step the same
mean over the same tokens up to float rounding (tests/test_heal_distributed.py).
"""

import os
from dataclasses import dataclass

import torch

from prunetool.errors import OptionError

SHARDED_LAUNCHES = {"ACCELERATE_USE_FSDP": "FSDP", "ACCELERATE_USE_DEEPSPEED": "DeepSpeed"}


def launched_world_size() -> int:
    """How many ranks the launcher started (1 when there is no launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def sharded_launch() -> str | None:
    """'FSDP' or 'DeepSpeed' when the accelerate config asks for sharding, else None."""
    for variable, name in SHARDED_LAUNCHES.items():
        if os.environ.get(variable, "").lower() == "true":
            return name
    return None


def rank_share(global_batch: int, world_size: int, batch_size: int) -> tuple[int, int]:
    """(micro-batch size, micro-batches per rank and step): every rank's share of the global batch, cut into
    equal micro-batches no larger than --batch-size (equal sizes keep the mean of means the global mean)."""
    if global_batch % world_size:
        raise OptionError(f"{world_size} ranks cannot split the global batch of {global_batch} windows "
                          f"(--batch-size x --grad-accum) evenly; choose a global batch divisible by {world_size}")
    share = global_batch // world_size
    micro = max(size for size in range(1, min(batch_size, share) + 1) if share % size == 0)
    return micro, share // micro


def check_launch(*, global_batch: int, batch_size: int, placement, save_every, resume: bool) -> None:
    """The refusals a distributed launch adds, before anything slow."""
    world, sharded = launched_world_size(), sharded_launch()
    if sharded and placement is not None:
        raise OptionError(f"an {sharded} config shards the student over the ranks, so it cannot also be placed or "
                          "offloaded to disk by --device-map/--max-memory/--offload-dir; drop those options")
    if world > 1 and placement is not None:
        raise OptionError(f"--device-map spreads one copy of the model over devices, but this is a distributed "
                          f"launch of {world} ranks, each holding its own copy; drop --device-map (or launch one "
                          "process)")
    if sharded and (save_every or resume):
        raise OptionError(f"--save-every/--resume checkpoint a data-parallel run; under {sharded} the optimizer "
                          "state is sharded and heal does not checkpoint it yet; use a DDP config to checkpoint")
    if world > 1:
        rank_share(global_batch, world, batch_size)


@dataclass
class World:
    """This process's place in the run; `accelerator` is None for a plain single process."""

    accelerator: object = None
    micro_batch: int = 1
    micro_batches: int = 1  # per rank and optimizer step

    @property
    def size(self) -> int:
        return self.accelerator.num_processes if self.accelerator is not None else 1

    @property
    def rank(self) -> int:
        return self.accelerator.process_index if self.accelerator is not None else 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Launched: several ranks, or one rank under an FSDP/DeepSpeed config (which still wraps the model)."""
        return self.accelerator is not None and (self.size > 1 or self.sharded)

    @property
    def sharded(self) -> bool:
        if self.accelerator is None:
            return False
        from accelerate.utils import DistributedType

        return self.accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)

    def prepare(self, model, optimizer):
        """The student (and its optimizer) wrapped as the launch config says: DDP, FSDP or a DeepSpeed engine."""
        if not self.distributed:
            return model, optimizer
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if plugin is not None and plugin.is_auto("train_micro_batch_size_per_gpu"):  # no dataloader to read it from
            plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = self.micro_batch
        return self.accelerator.prepare(model, optimizer)

    def prepare_teacher(self, teacher):
        """Sharded like the student under FSDP; replicated (frozen, on this rank's device) otherwise."""
        if self.distributed and self.sharded and sharded_launch() == "FSDP":
            return self.accelerator.prepare_model(teacher, evaluation_mode=True)
        return teacher

    def backward(self, model, loss: torch.Tensor) -> None:
        """One micro-batch's mean loss. accelerate's accumulate() holds the gradient all-reduce (and a DeepSpeed
        engine's step) until the step's last micro-batch and divides by the micro-batch count, as the plain
        process does by hand."""
        if not self.distributed:
            (loss / self.micro_batches).backward()
            return
        with self.accelerator.accumulate(model):
            self.accelerator.backward(loss)

    def clip(self, model, parameters, max_norm: float) -> None:
        if self.distributed:
            self.accelerator.clip_grad_norm_(model.parameters(), max_norm)
        else:
            torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def mean(self, value: float) -> float:
        """The mean of a per-rank float over every rank (every rank's share has the same size)."""
        if not self.distributed:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self.accelerator.device)
        return float(self.accelerator.reduce(tensor, reduction="mean"))

    def wait(self) -> None:
        if self.distributed:
            self.accelerator.wait_for_everyone()

    def track(self, config: dict) -> None:
        """Start accelerate's trackers (--report-to); the main process logs."""
        if self.accelerator is not None and self.accelerator.log_with:
            self.accelerator.init_trackers("prunetool-heal", config={k: v for k, v in config.items()
                                                                     if isinstance(v, (int, float, str, bool))})

    def log(self, values: dict, step: int) -> None:
        if self.accelerator is not None and self.accelerator.log_with:
            self.accelerator.log(values, step=step)

    def finish(self) -> None:
        if self.accelerator is not None and self.accelerator.log_with:
            self.accelerator.end_training()

    def unwrap(self, model):
        return self.accelerator.unwrap_model(model) if self.distributed else model


def open_world(*, cpu: bool, global_batch: int, batch_size: int, clip: float = 1.0, report_to: str | None = None,
               project_dir=None) -> World:
    """The Accelerator of a launched rank (or of a tracked single process); a bare World otherwise."""
    world_size, sharding = launched_world_size(), sharded_launch()
    if world_size == 1 and report_to is None and sharding is None:
        return World(micro_batch=batch_size, micro_batches=global_batch // batch_size)
    from accelerate import Accelerator

    micro, count = rank_share(global_batch, world_size, batch_size)
    if sharding == "DeepSpeed":  # the engine accumulates and clips by itself: heal's flags set both
        os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = str(count)
        os.environ["ACCELERATE_GRADIENT_CLIPPING"] = str(clip)
    accelerator = Accelerator(cpu=cpu, gradient_accumulation_steps=count, log_with=report_to, project_dir=project_dir)
    return World(accelerator=accelerator, micro_batch=micro, micro_batches=count)
