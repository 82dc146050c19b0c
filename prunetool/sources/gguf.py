"""GGUF file -> safetensors folder, so the rest of prunetool only ever sees Hugging Face folders.

transformers dequantizes GGUF weights at load time; we save them as float32 so the converted folder
holds exactly the dequantized values, and later loads skip the slow GGUF path.
"""

import contextlib
import hashlib
import io
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

from prunetool.errors import ModelSourceError, UnsupportedModelError
from prunetool.paths import models_dir
from prunetool.sources.cache import building, is_complete, sha256_file, transformers_version, write_record
from prunetool.sources.checks import check_causal_lm
from prunetool.sources.progress import step

GGUF_MAGIC = b"GGUF"


def gguf_cache_folder(path: Path) -> Path:
    """Keyed by absolute path, size and mtime: a changed file gets a new folder without hashing GBs."""
    path = path.resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem).strip("-.")[:60] or "model"
    return models_dir() / f"gguf-{stem}-{key}"


def check_gguf_magic(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelSourceError(f"cannot read {path}: {e.strerror or e}") from e
    if magic != GGUF_MAGIC:
        raise ModelSourceError(f"{path} is not a GGUF file (it does not start with 'GGUF'); re-download it")


def ensure_gguf_folder(path: Path, spec: str) -> Path:
    """The cached conversion of a user's .gguf file, converting it on first use."""
    path = path.resolve()
    check_gguf_magic(path)
    final = gguf_cache_folder(path)
    if is_complete(final):
        return final
    with building(final) as scratch:
        with step(f"hashing {path.name} (sha256)"):
            digest = sha256_file(path)
        convert_gguf(path, scratch / "model")
        st = path.stat()
        record = {"kind": "gguf", "spec": spec, "gguf_file": str(path), "gguf_size": st.st_size,
                  "gguf_mtime_ns": st.st_mtime_ns, "gguf_sha256": digest}  # fmt: skip
        write_record(scratch / "model", {**record, "converted_with": transformers_version()})
    return final


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Load the GGUF with transformers (dequantized, float32) and save a plain safetensors folder."""
    with step(f"converting GGUF -> safetensors ({gguf_path.name})"), _quiet_transformers() as log:
        try:
            model, tokenizer = _load(gguf_path)
        except (UnsupportedModelError, ModelSourceError):
            raise
        except Exception as e:
            raise _conversion_error(gguf_path, e, log.getvalue()) from e
        _check_tokenizer(tokenizer, gguf_path)
        try:
            _save(model, tokenizer, out)
        except OSError as e:
            raise ModelSourceError(f"cannot write the converted model to {out.parent}: {e.strerror or e}") from e
        del model
        _check_saved(out, gguf_path)


def _save(model, tokenizer, out: Path) -> None:
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # the weights are dense, but the GGUF quantizer refuses to serialize
        quantizer.remove_quantization_config(model)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None and not (out / "generation_config.json").exists():
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _load(gguf_path: Path):
    """Config first (cheap), so unsupported and non-causal files fail before weights are read."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), str(gguf_path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    check_causal_lm(config.to_dict(), str(gguf_path))
    extra = {}
    if hasattr(transformers, "GgufConfig"):  # ask for dense weights even where packed kernels exist
        extra["quantization_config"] = transformers.GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, **extra)
    packed = sorted({type(m).__name__ for m in model.modules() if "Gguf" in type(m).__name__})
    if packed:
        raise UnsupportedModelError(
            f"{gguf_path} loaded with packed GGUF modules ({', '.join(packed)}) that cannot be saved as "
            "safetensors; convert it with llama.cpp's tools or use the original Hugging Face folder"
        )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer


def _conversion_error(gguf_path: Path, error: Exception, log: str) -> Exception:
    text = " ".join(str(error).split())
    arch = re.search(r"architecture '?([\w.-]+)'? is not supported", text)
    if arch:
        return UnsupportedModelError(
            f"{gguf_path} has GGUF architecture {arch.group(1)!r}, which transformers {transformers_version()} "
            "cannot load; use the original Hugging Face folder or a supported model (prunetool models)"
        )
    lines = [line.strip() for line in log.replace("\r", "\n").splitlines() if line.strip() and "%|" not in line]
    last = lines[-1] if lines else ""
    hint = f" ({last[:200]})" if last and last not in text else ""
    return ModelSourceError(f"cannot convert {gguf_path}: {type(error).__name__}: {text[:300]}{hint}")


def _check_tokenizer(tokenizer, gguf_path: Path) -> None:
    """prunetool relies on eos for calibration windows; a GGUF without one is not usable."""
    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    if eos is None or eos_id is None or not 0 <= eos_id < len(tokenizer):
        raise ModelSourceError(f"{gguf_path} has no usable eos token in its tokenizer metadata")
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    if not ids or "Hello" not in tokenizer.decode(ids):
        raise ModelSourceError(f"{gguf_path} has a tokenizer that does not round-trip plain text")


def _check_saved(out: Path, gguf_path: Path) -> None:
    """The saved folder must load back as a plain (unquantized) config with a tokenizer."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(out)
    if getattr(config, "quantization_config", None) is not None:
        raise ModelSourceError(f"converting {gguf_path} left a quantization_config in config.json")
    tokenizer = AutoTokenizer.from_pretrained(out)
    if tokenizer.eos_token_id is None:
        raise ModelSourceError(f"converting {gguf_path} lost the eos token of its tokenizer")


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[io.StringIO]:
    """GGUF loading logs warnings and tqdm bars on stderr; keep them (for error hints) but do not show them."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    captured = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(captured):
            warnings.simplefilter("ignore")
            yield captured
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
