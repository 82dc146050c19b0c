"""`prunetool score`: source -> model -> calibration -> scores -> current run.

torch-backed modules are imported inside run_score: `--low-memory` tokenizes the calibration text and
frees the tokenizer before torch and transformers take their share of the process.
"""

import time

from rich.console import Console

from prunetool.select.calibration import HOLDOUT_WINDOWS, load_calibration
from prunetool.checkpoint_io import text_num_layers
from prunetool.errors import OptionError
from prunetool.progress import window_progress
from prunetool.output.runs import record_current_run
from prunetool.sources import model_key, resolve_model
from prunetool.sources.tokenizer import FileTokenizer


def warn_if_untested(model, console: Console):
    """Refuse unsupported models before any calibration work; warn on layouts matched by the generic rule."""
    from prunetool.model.architecture import inspect_decoder

    layout = inspect_decoder(model)
    if not layout.tested:
        console.print(f"[yellow]warning:[/] model_type '{layout.model_type}' is not in prunetool's tested set; "
                      "its layout matched the generic rule", highlight=False)
    return layout


def run_score(spec, *, calib, seq_len, stride, samples, dtype, device, batch_size, trust_remote_code,
              console: Console, low_memory: bool = False, drop: int | None = None, placement=None) -> tuple:
    """Score a model end to end and record it as the current run; returns the scores and stage timings.

    `low_memory` never loads the model: each decoder layer is read from the checkpoint when it runs
    (streaming.py), so the default calibration text must already be cached or --calib given.
    Generated text is asked for with prune's held-out windows included, so `prune` later finds the
    same cached text (the same sha256) for its windows.
    """
    timings = {}
    clock = time.perf_counter()
    source = resolve_model(spec, trust_remote_code=trust_remote_code)
    num_layers = text_num_layers(source.config)
    if drop is not None and drop >= num_layers:  # before minutes of loading and scoring
        raise OptionError(f"--drop {drop} must be below the number of layers ({num_layers})")
    from prunetool.memory import use_low_memory

    low_memory = use_low_memory(low_memory, placement, source.path, console)
    if low_memory:
        model, tokenizer = None, FileTokenizer(source.path)
    else:
        from prunetool.model.loading import load_model

        model, tokenizer = load_model(source, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                                      placement=placement)
        warn_if_untested(model, console)
    timings["load"] = time.perf_counter() - clock
    clock = time.perf_counter()
    generated = calib is None or calib == "self"
    calibration = load_calibration(calib, tokenizer, seq_len=seq_len, stride=stride, samples=samples,
                                   model=model, model_key=model_key(source),
                                   after_tokenizing=tokenizer.release if low_memory else None,
                                   holdout=HOLDOUT_WINDOWS if generated else 0)
    timings["calibration"] = time.perf_counter() - clock
    clock = time.perf_counter()
    with window_progress(console) as progress:
        task = progress.add_task("scoring windows", total=calibration.windows)
        if low_memory:
            from prunetool.model.loading import pick_device, pick_dtype
            from prunetool.select.scoring import score_streamed

            target = pick_device(device)
            scores = score_streamed(source, calibration, model_name=source.spec, dtype=pick_dtype(dtype, target),
                                    device=target, batch_size=batch_size, on_batch=lambda n: progress.advance(task, n))
        else:
            from prunetool.select.scoring import score_model

            scores = score_model(model, calibration, model_name=source.spec, batch_size=batch_size,
                                 on_batch=lambda n: progress.advance(task, n))
    timings["score"] = time.perf_counter() - clock
    options = {"calib": calibration.spec, "seq_len": seq_len, "stride": calibration.stride, "samples": samples,
               "dtype": dtype, "device": device, "batch_size": batch_size, "low_memory": low_memory,
               "device_map": placement.device_map if placement else None}
    record_current_run(source.spec, source.path, scores.to_json(), options)
    return scores, timings
