"""The stages wired together for the CLI: source -> model -> calibration -> scores -> current run.

torch-backed modules are imported inside run_score: `--low-memory` tokenizes the calibration text and
frees the tokenizer before torch and transformers take their share of the process.
"""

import hashlib
import re
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from prunetool.calibration import load_calibration
from prunetool.runs import record_current_run
from prunetool.sources import resolve_model
from prunetool.sources.tokenizer import FileTokenizer


def model_key(source) -> str:
    """A filesystem-safe, stable name for caches derived from a model (e.g. its generated calibration text)."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(source.spec).name or source.spec).strip("-")[:48] or "model"
    return f"{stem}-{hashlib.sha1(str(Path(source.path).resolve()).encode()).hexdigest()[:8]}"


def window_progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TimeRemainingColumn(), console=console, transient=True,
    )


def run_score(spec, *, calib, seq_len, stride, samples, dtype, device, batch_size, trust_remote_code,
              console: Console, low_memory: bool = False) -> tuple["Scores", dict]:
    """Score a model end to end and record it as the current run; returns the scores and stage timings.

    `low_memory` never loads the model: each decoder layer is read from the checkpoint when it runs
    (streaming.py), so the default calibration text must already be cached or --calib given.
    """
    timings = {}
    clock = time.perf_counter()
    source = resolve_model(spec, trust_remote_code=trust_remote_code)
    if low_memory:
        model, tokenizer = None, FileTokenizer(source.path)
    else:
        from prunetool.architecture import inspect_decoder
        from prunetool.loading import load_model

        model, tokenizer = load_model(source, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        layout = inspect_decoder(model)  # refuse unsupported models before any calibration work
        if not layout.tested:
            console.print(f"[yellow]warning:[/] model_type '{layout.model_type}' is not in prunetool's tested set; "
                          "its layout matched the generic rule", highlight=False)
    timings["load"] = time.perf_counter() - clock
    clock = time.perf_counter()
    calibration = load_calibration(calib, tokenizer, seq_len=seq_len, stride=stride, samples=samples,
                                   model=model, model_key=model_key(source),
                                   after_tokenizing=tokenizer.release if low_memory else None)
    timings["calibration"] = time.perf_counter() - clock
    clock = time.perf_counter()
    with window_progress(console) as progress:
        task = progress.add_task("scoring windows", total=calibration.windows)
        if low_memory:
            from prunetool.loading import pick_device, pick_dtype
            from prunetool.streaming import score_streamed

            target = pick_device(device)
            scores = score_streamed(source, calibration, model_name=source.spec, dtype=pick_dtype(dtype, target),
                                    device=target, batch_size=batch_size, on_batch=lambda n: progress.advance(task, n))
        else:
            from prunetool.scoring import score_model

            scores = score_model(model, calibration, model_name=source.spec, batch_size=batch_size,
                                 on_batch=lambda n: progress.advance(task, n))
    timings["score"] = time.perf_counter() - clock
    options = {"calib": calib, "seq_len": seq_len, "stride": calibration.stride, "samples": samples,
               "dtype": dtype, "device": device, "batch_size": batch_size, "low_memory": low_memory}
    record_current_run(source.spec, source.path, scores.to_json(), options)
    return scores, timings


def layer_caps(config, seq_len: int, num_layers: int) -> list[int]:
    """Tokens each layer can attend to: the window length, or less for a sliding-window layer."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
    window = getattr(config, "sliding_window", None)
    return [min(seq_len, window) if kind == "sliding_attention" and window else seq_len for kind in types]


def run_heads(spec, *, calib, seq_len, samples, layers, kv_budget, dtype, device, trust_remote_code,
              console: Console):
    """Probe every analysed layer's heads on calibration windows (eager attention) and build the report."""
    from prunetool.architecture import inspect_decoder
    from prunetool.heads.analysis import analyse
    from prunetool.heads.budget import check_kv_budget
    from prunetool.heads.probe import probe_heads
    from prunetool.loading import load_model
    from prunetool.selection import parse_layers

    if spec is None:  # the current run's model, else the default demo model
        from prunetool.errors import PrunetoolError
        from prunetool.runs import load_current_run

        try:
            spec = load_current_run()["model"]
        except PrunetoolError:
            spec = None
    source = resolve_model(spec, trust_remote_code=trust_remote_code)
    model, tokenizer = load_model(source, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                                  attn_implementation="eager")
    layout = inspect_decoder(model)
    if not layout.tested:
        console.print(f"[yellow]warning:[/] model_type '{layout.model_type}' is not in prunetool's tested set; "
                      "its layout matched the generic rule", highlight=False)
    selected = parse_layers(layers, layout.num_layers, allow_all=True) if layers else tuple(range(layout.num_layers))
    caps = layer_caps(model.config.get_text_config(decoder=True), seq_len, layout.num_layers)
    if kv_budget is not None:
        check_kv_budget(kv_budget, caps)
    calibration = load_calibration(calib, tokenizer, seq_len=seq_len, stride=seq_len, samples=samples,
                                   model=model, model_key=model_key(source))
    with window_progress(console) as progress:
        task = progress.add_task("probing heads", total=calibration.windows)
        evidence = probe_heads(model, calibration.input_ids, selected, on_window=lambda: progress.advance(task))
    return analyse(evidence, model=source.spec, calibration=calibration.describe(), kv_budget=kv_budget, caps=caps)
