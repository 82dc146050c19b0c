"""Measured speed of a model and of a cut of it, on the device in use: what `--target decode=…,prefill=…` needs.

Two measurements, both from the loaded model in its own dtype:
- per-sublayer seconds (`sublayer_timing`): one run with a clock around every attention and MLP module, so a
  cut's time can be predicted as the sum of what it keeps plus the rest (embedding, norms, head, the loop);
- whole-model seconds (`cut_seconds`): the cut made in memory and timed without hooks, interleaved with the
  base and repeated, so the final cut is judged on what was measured, not on the sum.

Decode is one new token per sequence with a KV cache already `context` tokens deep; prefill is a forward of
`context` tokens. Timings are cached per model, device, dtype and workload (SPEED_CACHE), since a
search asks for them once per model and a re-run of prune should not wait for them again.
"""

from __future__ import annotations

import json
import statistics
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from prunetool.model.architecture import cache_argument, decoder_of
from prunetool.model.runner import removed_units
from prunetool.select.budget import Timing

PHASES = ("decode", "prefill")
DEFAULT_CONTEXT = {"decode": 512, "prefill": 512}
DECODE_STEPS = 16


@dataclass(frozen=True)
class Workload:
    phase: str  # decode or prefill
    context: int  # tokens already in the cache (decode) or in the prompt (prefill)
    batch: int = 1

    def key(self) -> str:
        return f"{self.phase}-ctx{self.context}-b{self.batch}"

    def describe(self) -> str:
        what = (f"one new token per sequence after {self.context} cached" if self.phase == "decode" else
                f"a {self.context}-token prompt")
        return f"{what}, batch {self.batch}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inputs(model, workload: Workload, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    return torch.randint(vocab, (workload.batch, workload.context + DECODE_STEPS), generator=generator)


def _run(model, ids: torch.Tensor, workload: Workload, device: torch.device) -> float:
    """Seconds of the timed part: a prefill forward, or DECODE_STEPS cached decode steps (mean per step)."""
    ids = ids.to(device)
    context = workload.context
    with torch.inference_mode():
        if workload.phase == "prefill":
            _sync(device)
            start = time.perf_counter()
            model(input_ids=ids[:, :context], use_cache=False)
            _sync(device)
            return time.perf_counter() - start
        output = model(input_ids=ids[:, :context], use_cache=True)
        cache, name = output.past_key_values, cache_argument(model)
        _sync(device)
        start = time.perf_counter()
        for step in range(DECODE_STEPS):
            output = model(input_ids=ids[:, context + step:context + step + 1], use_cache=True, **{name: cache})
            cache = output.past_key_values
        _sync(device)
        return (time.perf_counter() - start) / DECODE_STEPS


@contextmanager
def _clocked(model, device: torch.device, totals: dict[tuple[int, str], float]):
    """Add the seconds spent in every layer's attention and MLP module to totals[(layer, unit)]."""
    started: dict[int, float] = {}

    def before(key):
        def hook(module, args):
            _sync(device)
            started[id(module)] = time.perf_counter()
        return hook

    def after(key):
        def hook(module, args, output):
            _sync(device)
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - started.pop(id(module))
        return hook

    with ExitStack() as stack:
        for index, layer in enumerate(decoder_of(model).layers):
            for unit, name in (("attention", "self_attn"), ("mlp", "mlp")):
                module = getattr(layer, name)
                for handle in (module.register_forward_pre_hook(before((index, unit))),
                               module.register_forward_hook(after((index, unit)))):
                    stack.callback(handle.remove)
        yield


def sublayer_timing(model, workload: Workload, device: torch.device, repeats: int = 3) -> Timing:
    """Per-layer attention and MLP seconds (medians over `repeats`) and the rest, for one timed unit of work."""
    ids = _inputs(model, workload)
    _run(model, ids, workload, device)  # warm-up
    per_repeat = []
    for _ in range(repeats):
        totals: dict[tuple[int, str], float] = {}
        with _clocked(model, device, totals):
            total = _run(model, ids, workload, device)
        divisor = DECODE_STEPS if workload.phase == "decode" else 1
        per_repeat.append((total, {key: value / divisor for key, value in totals.items()}))
    layers = len(decoder_of(model).layers)
    attention = tuple(statistics.median(r[1].get((i, "attention"), 0.0) for r in per_repeat) for i in range(layers))
    mlp = tuple(statistics.median(r[1].get((i, "mlp"), 0.0) for r in per_repeat) for i in range(layers))
    total = statistics.median(r[0] for r in per_repeat)
    return Timing(attention, mlp, max(0.0, total - sum(attention) - sum(mlp)))


def cut_seconds(model, cuts: list, workload: Workload, device: torch.device, repeats: int = 5) -> list[dict]:
    """Whole-model seconds of each cut (None: the base), interleaved within every repeat: median and range."""
    ids = _inputs(model, workload)
    found: list[list[float]] = [[] for _ in cuts]
    for repeat in range(repeats + 1):  # the first round warms up
        order = list(range(len(cuts)))
        order = order[repeat % len(order):] + order[:repeat % len(order)]
        for position in order:
            cut = cuts[position]
            with ExitStack() as stack:
                if cut is not None and not cut.empty:
                    stack.enter_context(removed_units(model, cut))
                seconds = _run(model, ids, workload, device)
            if repeat:
                found[position].append(seconds)
    return [{"median": statistics.median(v), "min": min(v), "max": max(v)} for v in found]


def cached_timing(model, workload: Workload, device: torch.device, cache: Path | None, identity: str) -> Timing:
    """sublayer_timing, read from / written to `cache` (a JSON file per model identity, device and dtype)."""
    key = f"{identity}|{device}|{next(model.parameters()).dtype}|{workload.key()}"
    stored = json.loads(cache.read_text()) if cache is not None and cache.is_file() else {}
    if key in stored:
        entry = stored[key]
        return Timing(tuple(entry["attention"]), tuple(entry["mlp"]), entry["rest"])
    timing = sublayer_timing(model, workload, device)
    if cache is not None:
        from prunetool.checkpoint_io import write_json_atomic

        cache.parent.mkdir(parents=True, exist_ok=True)
        stored[key] = {"attention": list(timing.attention), "mlp": list(timing.mlp), "rest": timing.rest}
        write_json_atomic(cache, stored)
    return timing
