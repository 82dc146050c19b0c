"""What a user prunes for: parameters, KV-cache bytes per token, prefill and decode speed, peak memory.

Measured on the model eval already holds, in this process, one model after another on the same device,
so the rows of one eval run compare like with like. Speeds are medians over REPEATS runs after one
warm-up, at batch 1: prefill is one forward over PREFILL_TOKENS prompt tokens; decode is DECODE_TOKENS
greedy steps with the KV cache after a DECODE_PROMPT-token prompt, the prompt's prefill not counted.

KV bytes per token count the keys and values every attention sublayer stores per token: a removed
layer or a removed attention sublayer stores none. Sliding-window layers are counted like the others
(their cache stops growing at the window, which this per-token figure does not show).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from prunetool.model.architecture import decoder_of
from prunetool.model.loading import input_device

PREFILL_TOKENS = 512
DECODE_PROMPT = 128
DECODE_TOKENS = 32
REPEATS = 3


def attention_of(layer: nn.Module) -> nn.Module | None:
    """The layer's attention sublayer, or None where it was removed (a nemotron-nas no-op or skipped)."""
    from prunetool.model.sublayers import ZeroAttention

    attention = getattr(layer, "self_attn", None)
    return None if attention is None or isinstance(attention, ZeroAttention) else attention


def kv_width(attention: nn.Module, config) -> int:
    """Key (= value) features per token of one attention sublayer: its k_proj's outputs where it has one."""
    k_proj = getattr(attention, "k_proj", None)
    if isinstance(k_proj, nn.Linear):
        return k_proj.out_features
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return (getattr(config, "num_key_value_heads", None) or heads) * head_dim


def kv_bytes_per_token(model: nn.Module) -> int:
    """Bytes of KV cache one token adds, summed over the attention sublayers present, in the model's dtype."""
    config = model.config.get_text_config(decoder=True)
    size = torch.empty((), dtype=model.dtype).element_size()
    attentions = [attention_of(layer) for layer in decoder_of(model).layers]
    return sum(2 * kv_width(attention, config) * size for attention in attentions if attention is not None)


def parameter_count(model: nn.Module) -> int:
    """Parameters, tied weights counted once (nn.Module.parameters() yields each tensor once)."""
    return sum(parameter.numel() for parameter in model.parameters())


def _median_seconds(run, repeats: int) -> float:
    run()  # warm-up: kernels, allocator, caches
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        run()
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _decode(model: nn.Module, prompt: torch.Tensor, steps: int) -> float:
    """Seconds for `steps` greedy decoding steps with the KV cache, after an untimed prefill of `prompt`."""
    from transformers import DynamicCache

    from prunetool.model.architecture import cache_argument

    name = cache_argument(model)
    cache = DynamicCache(config=model.config)
    output = model(input_ids=prompt, use_cache=True, **{name: cache})
    token = output.logits[:, -1:].argmax(-1)
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        output = model(input_ids=token, use_cache=True, **{name: cache})
        token = output.logits[:, -1:].argmax(-1)
    _sync()
    return time.perf_counter() - start


def measure_efficiency(model: nn.Module, *, vocab_size: int | None = None, repeats: int = REPEATS) -> dict:
    """Parameters, KV bytes per token, prefill and decode tokens/s and peak memory of `model` as it runs here."""
    device = input_device(model)
    config = model.config.get_text_config(decoder=True)
    context = getattr(config, "max_position_embeddings", None) or PREFILL_TOKENS + DECODE_PROMPT + DECODE_TOKENS
    prefill = min(PREFILL_TOKENS, context)
    prompt_length = min(DECODE_PROMPT, context - DECODE_TOKENS)
    vocab = vocab_size or config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prefill_ids = torch.randint(0, vocab, (1, prefill), generator=generator).to(device)
    decode_ids = torch.randint(0, vocab, (1, prompt_length), generator=generator).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        prefill_seconds = _median_seconds(lambda: model(input_ids=prefill_ids, use_cache=False), repeats)
        decode_times = [_decode(model, decode_ids, DECODE_TOKENS) for _ in range(repeats + 1)][1:]
    kv = kv_bytes_per_token(model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    result = {
        "parameters": parameter_count(model),
        "kv_cache_bytes_per_token": kv,
        "prefill_tokens_per_second": prefill / prefill_seconds,
        "decode_tokens_per_second": DECODE_TOKENS / statistics.median(decode_times),
        "setting": {"batch": 1, "prefill_tokens": prefill, "decode_prompt_tokens": prompt_length,
                    "decode_tokens": DECODE_TOKENS, "repeats": repeats, "statistic": "median",
                    "device": str(device), "dtype": str(model.dtype).removeprefix("torch.")},
    }
    if device.type == "cuda":
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        result["peak_memory"] = "measured: torch.cuda.max_memory_allocated over these runs"
    else:  # the process's high-water mark mixes every model eval loaded; state the computed need instead
        result["peak_memory_bytes"] = weights + kv * max(prefill, prompt_length + DECODE_TOKENS)
        result["peak_memory"] = (f"computed: weights + KV cache at {max(prefill, prompt_length + DECODE_TOKENS)} "
                                 "tokens (activations not included)")
    return result


def relative_to(base: dict, other: dict) -> dict:
    """other / base for every efficiency number both have (1.0 = no change)."""
    keys = ("parameters", "kv_cache_bytes_per_token", "prefill_tokens_per_second", "decode_tokens_per_second",
            "peak_memory_bytes")
    return {key: other[key] / base[key] for key in keys if base.get(key) and other.get(key) is not None}


def folder_structure(folder, *, dtype: str, trust_remote_code: bool) -> dict:
    """Parameters, KV bytes per token and weight bytes of a checkpoint folder, from its config alone: the model
    is built on the meta device (no weights read), then counted with the same formulas as a loaded model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from prunetool.model.loading import DTYPES

    torch_dtype = DTYPES[dtype]
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, dtype=torch_dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"parameters": parameter_count(model), "kv_cache_bytes_per_token": kv_bytes_per_token(model),
            "weight_bytes": weights}


def served_efficiency(structure: dict, speeds: dict, *, engine: str, dtype: str, kv_cache_gib: float) -> dict:
    """The efficiency entry for a model measured in a serving engine: `structure` from folder_structure, `speeds`
    from prunetool.serving.load.measure; the same keys as measure_efficiency's, plus the engine's workload."""
    workload = speeds["workload"]
    tokens = workload["concurrency"] * (workload["prompt_tokens"] + workload["new_tokens"])
    kv = structure["kv_cache_bytes_per_token"]
    return {
        "parameters": structure["parameters"],
        "kv_cache_bytes_per_token": kv,
        "prefill_tokens_per_second": speeds["prefill_tokens_per_second"],
        "decode_tokens_per_second": speeds["decode_tokens_per_second"],
        "peak_memory_bytes": structure["weight_bytes"] + kv * tokens,
        "peak_memory": (f"computed: weights + KV cache at {tokens} tokens (activations not included); the engine "
                        f"reserved {kv_cache_gib:g} GiB for its KV cache"),
        "setting": {"batch": workload["concurrency"], "prefill_tokens": workload["prompt_tokens"],
                    "decode_prompt_tokens": workload["prompt_tokens"], "decode_tokens": workload["new_tokens"],
                    "repeats": workload["waves"], "statistic": "median", "device": "cpu", "dtype": dtype,
                    "engine": engine, "workload": speeds["workload_text"]},
        "engine_measurements": {key: speeds[key] for key in (
            "prefill_tokens_per_second_range", "decode_tokens_per_second_range", "ttft_seconds", "ttft_seconds_range",
            "tpot_seconds", "tpot_seconds_range", "waves")},
    }
