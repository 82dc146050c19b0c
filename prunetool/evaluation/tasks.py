"""Which task names mean what: shipped local configs, hop probes, held-out perplexity, or lm-eval's Hub tasks.

Every name is resolved and checked (data files present, Hub reachable where needed) before a model
is loaded, so a typo costs milliseconds, not a model load.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from prunetool.errors import OptionError
from prunetool.evaluation import hop, long_context
from prunetool.evaluation.local_data import DATA_DIR_ENV, LOCAL_TASKS, check_local_files
from prunetool.network import hub_unavailable_reason

TASKS_DIR = Path(__file__).with_name("tasks")
HELDOUT = "heldout_ppl"  # prunetool's own: perplexity on calibration windows never used for selection
DEFAULT_LOCAL = ("wikitext", "lambada_openai", "arc_easy", "piqa", "winogrande")
DEFAULT_OFFLINE = ("hop_number", "hop_name", HELDOUT)
DEFAULT_KV = ("needle_1024", "multikey_1024", "hop_number_512", "hop_name_512")  # with --kv-budget


@dataclass(frozen=True)
class TaskPlan:
    name: str
    kind: str  # "local" (shipped config on --data-dir), "hub" (lm-eval's own), "hop", "heldout" or "long"


def data_dir_from(option: Path | None) -> Path | None:
    """--data-dir, else PRUNETOOL_DATA_DIR; a folder that does not exist is an error, not a silent fallback."""
    chosen = option if option is not None else (Path(os.environ[DATA_DIR_ENV]) if os.environ.get(DATA_DIR_ENV) else None)
    if chosen is None:
        return None
    if not chosen.is_dir():
        where = "--data-dir" if option is not None else DATA_DIR_ENV
        raise OptionError(f"{where} {chosen} is not a folder; point it at the evaluation data "
                          f"({', '.join(sorted({f for t in LOCAL_TASKS.values() for f in t.files}))})")
    return chosen.resolve()


@functools.lru_cache(maxsize=1)
def lm_eval_task_names() -> frozenset[str]:
    """Every task and group lm-eval ships (indexing its YAML files needs no network)."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(verbosity="ERROR")
    return frozenset(manager.all_tasks)


def default_task_names(data_dir: Path | None) -> list[str]:
    """Local data when given; the Hub versions when online; otherwise what needs neither."""
    if data_dir is not None or hub_unavailable_reason() is None:
        return list(DEFAULT_LOCAL)
    return list(DEFAULT_OFFLINE)


def plan_tasks(names: list[str], data_dir: Path | None) -> list[TaskPlan]:
    """Resolve each name (hop families expand to their lengths); fail on the first that cannot run."""
    plans: list[TaskPlan] = []
    for name in names:
        expanded = hop.expand(name)
        long_tasks = long_context.expand(name)
        if expanded:
            plans += [TaskPlan(probe, "hop") for probe in expanded]
        elif long_tasks:
            plans += [TaskPlan(task, "long") for task in long_tasks]
        elif name == HELDOUT:
            plans.append(TaskPlan(name, "heldout"))
        elif name in LOCAL_TASKS and data_dir is not None:
            check_local_files(name, data_dir)
            plans.append(TaskPlan(name, "local"))
        elif name in lm_eval_task_names():
            reason = hub_unavailable_reason()
            if reason is not None:
                local = (f"pass --data-dir DIR (or set {DATA_DIR_ENV}) with its files "
                         f"({', '.join(LOCAL_TASKS[name].files)})" if name in LOCAL_TASKS
                         else f"run it online, or use the local tasks ({', '.join(LOCAL_TASKS)}) with --data-dir")
                raise OptionError(f"task {name} downloads its data from the Hugging Face Hub, but {reason}; {local}")
            plans.append(TaskPlan(name, "hub"))
        else:
            raise OptionError(f"unknown task {name!r}: local tasks are {', '.join(LOCAL_TASKS)} (with --data-dir), "
                              f"probes {', '.join(hop.KINDS)} (or e.g. hop_name_512), long-context {', '.join(long_context.KINDS)} "
                              f"(or e.g. needle_2048) and {HELDOUT}; other names must "
                              "be lm-eval tasks (`lm-eval ls tasks`)")
    seen: set[str] = set()
    return [plan for plan in plans if not (plan.name in seen or seen.add(plan.name))]


def split_names(tasks: str | None) -> list[str] | None:
    if tasks is None:
        return None
    names = [name.strip() for name in tasks.split(",") if name.strip()]
    if not names:
        raise OptionError("--tasks is empty; give task names separated by commas")
    return names
