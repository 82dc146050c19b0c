"""One loaded model -> lm-eval results for the planned tasks (plus held-out perplexity), quietly.

Each task gets its own `simple_evaluate` call on the same `HFLM` wrapper: local, Hub and probe tasks
need different task managers and few-shot settings, and per-task calls let the CLI show progress.
The merged dict keeps lm-eval's own layout (`results`, `versions`, `n-samples`, `configs`, ...).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from prunetool.evaluation import hop
from prunetool.evaluation.tasks import TASKS_DIR, TaskPlan

MERGED_KEYS = ("results", "versions", "n-samples", "configs", "higher_is_better", "n-shot")
BOOTSTRAP_ITERS = 1000  # stderr of perplexity-type aggregates; lm-eval's 100k costs minutes on two cores
DEFAULT_MAX_LENGTH = 2048  # lm-eval's own fallback; also bounds the logits lm-eval materialises per sequence
LOGITS_BUDGET_BYTES = 4 * 2**30  # `--batch-size auto` on the CPU: float32 logits plus their log-softmax
MAX_AUTO_BATCH = 16


@contextlib.contextmanager
def quiet_lm_eval():
    """Keep lm-eval's bars, prints, advisory warnings and its `git describe` probe off the terminal.

    lm-eval prints to stdout (which `--json` owns) and draws tqdm bars that ignore settings made after
    import, so both streams are diverted while it runs; prunetool's own progress line updates between
    tasks. Exceptions still propagate, and `--debug` leaves everything visible.
    """
    import datasets
    import lm_eval.evaluator as evaluator

    loggers = [logging.getLogger(name) for name in ("lm_eval", "lm-eval", "datasets")]
    levels = [logger.level for logger in loggers]
    git_hash = evaluator.get_git_commit_hash
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    datasets.disable_progress_bars()
    evaluator.get_git_commit_hash = lambda: None  # it shells out to git in the user's cwd and prints "fatal: ..."
    sink = io.StringIO()
    try:
        if os.environ.get("PRUNETOOL_DEBUG", "") not in ("", "0"):
            yield
        else:
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                yield
    finally:
        evaluator.get_git_commit_hash = git_hash
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        datasets.enable_progress_bars()


def model_context(model) -> int | None:
    config = model.config.get_text_config(decoder=True)
    return getattr(config, "max_position_embeddings", None)


def pick_max_length(model, requested: int | None) -> int:
    """Tokens per forward pass: --max-length, else lm-eval's 2048 fallback capped by the model's context."""
    context = model_context(model)
    if requested is not None:
        return requested
    return min(DEFAULT_MAX_LENGTH, context) if context else DEFAULT_MAX_LENGTH


def pick_batch_size(model, batch_size: str, max_length: int) -> int | str:
    """`auto` on the CPU: as many full-length sequences as fit the logits budget (lm-eval keeps B x L x V
    float32 logits and their log-softmax); on accelerators lm-eval's own search, which catches OOM there."""
    if batch_size != "auto":
        return int(batch_size)
    from prunetool.model.loading import input_device

    if input_device(model).type != "cpu":
        return "auto"
    vocab = model.config.get_text_config(decoder=True).vocab_size
    return max(1, min(MAX_AUTO_BATCH, LOGITS_BUDGET_BYTES // (max_length * vocab * 8)))


def make_lm(model, tokenizer, batch_size: str, max_length: int | None = None):
    """lm-eval's HF wrapper around the already-loaded model (no second load, same device and dtype)."""
    from lm_eval.models.huggingface import HFLM

    length = pick_max_length(model, max_length)
    with quiet_lm_eval():
        return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=pick_batch_size(model, batch_size, length),
                    max_batch_size=MAX_AUTO_BATCH, max_length=length)


BACKENDS = ("hf", "vllm")


def vllm_arguments(path: str, *, dtype: str, tensor_parallel: int, data_parallel: int, batch_size: str,
                   max_length: int | None, trust_remote_code: bool) -> dict:
    """lm-eval's VLLM keyword arguments for one written checkpoint: vLLM loads the folder itself, so only
    checkpoints on disk can be evaluated this way, and parallelism is vLLM's (tensor and data parallel)."""
    arguments = {"pretrained": path, "dtype": "auto" if dtype == "auto" else dtype,
                 "tensor_parallel_size": tensor_parallel, "data_parallel_size": data_parallel,
                 "batch_size": batch_size if batch_size == "auto" else int(batch_size),
                 "trust_remote_code": trust_remote_code}
    if max_length is not None:
        arguments["max_model_len"] = max_length
    return arguments


def make_vllm_lm(arguments: dict):
    """lm-eval's vLLM wrapper; checked for vllm before anything is loaded (commands.eval.check_backend)."""
    from lm_eval.models.vllm_causallms import VLLM

    with quiet_lm_eval():
        return VLLM(**arguments)


SERVER_BATCH = 8  # prompts per request to vLLM's server when --batch-size is auto
SERVER_CONCURRENT = 1  # one batched request at a time: lm-eval's synchronous client (its asyncio one leaves
                       # "Task exception was never retrieved" on stderr when a request fails)
SERVER_TIMEOUT = 1800  # seconds per request; a batch of long windows on two busy cores takes minutes


def server_lengths(requested: int | None, context: int | None) -> tuple[int, int]:
    """(tokens per forward as the hf backend counts them, lm-eval's max_length for the completions API).

    lm-eval's API models keep `max_length - 1` tokens per request and score them with echo, so a request
    carries one more token than HFLM feeds; with `max_length + 2` both score the same windows (same
    truncation, same rolling windows). The server's --max-model-len is the API value, capped by the model's
    context, where the last token of a full-length request would have no position left."""
    if requested is not None:
        length = requested
    else:
        length = min(DEFAULT_MAX_LENGTH, context) if context else DEFAULT_MAX_LENGTH
    api = length + 2
    return length, min(api, context) if context else api


def server_batch(batch_size: str) -> int:
    """Prompts per request to the server: --batch-size, or SERVER_BATCH for auto."""
    return SERVER_BATCH if batch_size == "auto" else int(batch_size)


def make_server_lm(completions_url: str, model: str, tokenizer: str, *, max_length: int, batch_size: str,
                   trust_remote_code: bool):
    """lm-eval's own `local-completions` model on a served model: log-likelihoods through echo + logprobs,
    requests as token ids from the folder's tokenizer (the same ids HFLM would feed)."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    with quiet_lm_eval():
        return LocalCompletionsAPI(base_url=completions_url, model=model, tokenizer=tokenizer,
                                   tokenizer_backend="huggingface", tokenized_requests=True, max_length=max_length,
                                   # HFLM leaves add_special_tokens to the tokenizer (True: a BOS where its template
                                   # adds one); the API models pass False unless add_bos_token, which passes True
                                   add_bos_token=True,
                                   batch_size=server_batch(batch_size),
                                   num_concurrent=SERVER_CONCURRENT, max_retries=1, timeout=SERVER_TIMEOUT,
                                   trust_remote_code=trust_remote_code)


class TaskManagers:
    """The shipped local configs (bound to the data folder) and lm-eval's own index, built on first use."""

    def __init__(self, data_dir: Path | None):
        self.data_dir = data_dir
        self._local = self._hub = None

    def local(self):
        from lm_eval.tasks import TaskManager

        if self._local is None:
            self._local = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, verbosity="ERROR",
                                      metadata={"data_dir": str(self.data_dir)})
        return self._local

    def hub(self):
        from lm_eval.tasks import TaskManager

        if self._hub is None:
            self._hub = TaskManager(verbosity="ERROR")
        return self._hub

    def empty(self):
        from lm_eval.tasks import TaskManager

        return TaskManager(include_defaults=False, verbosity="ERROR")


OWN_KINDS = ("heldout", "long")  # prunetool's own evaluations (held-out perplexity, kv_eval), not lm-eval's


def evaluate_tasks(lm, plans: list[TaskPlan], managers: TaskManagers, *, limit: int | None,
                   num_fewshot: int | None, on_task: Callable[[str], None] = lambda name: None,
                   on_done: Callable[[str], None] = lambda name: None) -> dict:
    """lm-eval's result dicts for every non-held-out task merged under lm-eval's own keys, and seconds per task."""
    from lm_eval import simple_evaluate

    merged: dict = {key: {} for key in MERGED_KEYS}
    seconds = {}
    for plan in plans:
        if plan.kind in OWN_KINDS:
            continue
        on_task(plan.name)
        clock = time.perf_counter()
        if plan.kind == "hop":
            task, manager, shots = hop.task_config(plan.name, count=limit or hop.DOCS_PER_LENGTH), managers.empty(), None
        else:
            task, manager, shots = plan.name, managers.local() if plan.kind == "local" else managers.hub(), num_fewshot
        with quiet_lm_eval():
            result = simple_evaluate(model=lm, tasks=[task], task_manager=manager, limit=limit, num_fewshot=shots,
                                     log_samples=False, bootstrap_iters=BOOTSTRAP_ITERS)
        for key in MERGED_KEYS:
            merged[key].update(result.get(key) or {})
        seconds[plan.name] = round(time.perf_counter() - clock, 2)
        on_done(plan.name)
    return merged, seconds


def heldout_perplexity(model, windows, description: str) -> dict:
    """Perplexity on calibration windows that selection never saw: an evaluation that needs no data folder."""
    from prunetool.model.perplexity import perplexity

    started = time.perf_counter()
    value = perplexity(model, windows)
    return {"perplexity": value, "windows": int(windows.shape[0]), "seq_len": int(windows.shape[1]),
            "text": description, "seconds": time.perf_counter() - started}
