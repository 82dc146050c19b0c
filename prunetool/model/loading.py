"""A resolved model folder -> (model, tokenizer) in eval mode on the requested device and dtype."""

import contextlib
import io

import torch

from prunetool.errors import ModelSourceError, OptionError
from prunetool.model.placement import Placement
from prunetool.sources import ModelSource

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str) -> torch.device:
    """`auto` takes CUDA, then MPS, then the CPU."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        chosen = torch.device(device)
    except RuntimeError as error:
        raise OptionError(f"--device {device!r} is not a torch device (try auto, cpu, cuda, cuda:1, mps)") from error
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise OptionError(f"--device {device}: CUDA is not available on this machine")
    return chosen


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` is float32 on the CPU (bf16 matmuls there are slow and lossy) and bfloat16 on accelerators."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise OptionError(f"--dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def input_device(model) -> torch.device:
    """Where a model's inputs go: the device its first module runs on. With a device map that is the
    embedding's entry (the CPU when it was offloaded to disk, whose weights then sit on `meta`)."""
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        first = next(iter(device_map.values()))
        if isinstance(first, int):
            return torch.device("cuda", first)
        return torch.device("cpu" if first == "disk" else first)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and getattr(embeddings, "weight", None) is not None:
        # the token embedding, not the first parameter: a layer-streamed multimodal model keeps its vision
        # tower on `meta`, and ids sent there came back as uninitialised embeddings
        return embeddings.weight.device
    return next(model.parameters()).device


def offloaded_to_disk(model) -> bool:
    return "disk" in set((getattr(model, "hf_device_map", None) or {}).values())


@contextlib.contextmanager
def quiet_transformers():
    """Keep transformers' load-time chatter (progress bars, advisory warnings) off the user's terminal."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.set_verbosity(level)
        logging.enable_progress_bar()


def load_model(source: ModelSource, *, dtype: str = "auto", device: str = "auto", trust_remote_code: bool = False,
               attn_implementation: str | None = None, placement: Placement | None = None):
    """Load the causal LM and its tokenizer; any loader failure becomes a one-line ModelSourceError.

    `attn_implementation='eager'` makes attention return its weights (the heads probe reads them).
    With a `placement`, accelerate spreads the layers (GPUs, CPU, then disk) and `device` only sets the dtype.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prunetool.sources.checks import ships_our_code

    trust_remote_code = trust_remote_code or ships_our_code(source.path)
    target = pick_device(device)
    torch_dtype = pick_dtype(dtype, target)
    spread = {}
    if placement is not None:
        spread = {"device_map": placement.device_map, "max_memory": placement.max_memory,
                  "offload_folder": str(placement.offload_dir) if placement.offload_dir else None}
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(
                source.path, dtype=torch_dtype, trust_remote_code=trust_remote_code, **spread,
                **({"attn_implementation": attn_implementation} if attn_implementation else {}),
            )
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if placement is not None and "offload" in reason and placement.offload_dir is None:
            raise OptionError(f"--device-map {placement.device_map}: {source.spec} does not fit --max-memory "
                              f"{placement.max_memory or 'on this machine'} and part of it must go to disk; "
                              "give --offload-dir FOLDER") from error
        raise ModelSourceError(f"cannot load {source.spec} from {source.path}: {reason}") from error
    model.eval()
    if placement is None:
        model.to(target)
    return model, tokenizer
