"""Checkpoint I/O shared by every command: safetensors headers, atomic publishing, the text config.

One place for what several stages need to agree on:
* a safetensors header is parsed and validated once per read (`read_header`), so a truncated or
  malformed file fails with one line before any tensor byte is touched;
* everything a command writes (a checkpoint folder, a report folder, a JSON file) is built beside
  its target and renamed into place, so readers never see half of it;
* the decoder's fields in config.json are found by one rule, also for multimodal checkpoints that
  nest them under `text_config`.
"""

import json
import os
import secrets
import shutil
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prunetool.errors import ModelSourceError, OptionError, UnsupportedModelError

# ---------------------------------------------------------------------------------------------------
# safetensors headers: `u64 header length | JSON header | raw tensor bytes`

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}  # fmt: skip


@dataclass(frozen=True)
class TensorEntry:
    """One header entry: the tensor's name, its unparsed header fields and where its bytes are."""

    name: str
    info: dict  # {"dtype": ..., "shape": [...], "data_offsets": [start, end]} exactly as on disk

    @property
    def start(self) -> int:
        return self.info["data_offsets"][0]

    @property
    def nbytes(self) -> int:
        start, end = self.info["data_offsets"]
        return end - start

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.info["shape"]:
            count *= int(dim)
        return count


@dataclass(frozen=True)
class ShardHeader:
    """A parsed safetensors header: entries in on-disk order, the shard metadata, where data starts."""

    path: Path
    entries: tuple[TensorEntry, ...]
    metadata: dict | None  # the "__metadata__" map, e.g. {"format": "pt"}, or None when absent
    data_start: int  # 8 + header length


class _Corrupt(Exception):
    """Why a safetensors file cannot be used; turned into one ModelSourceError line by read_header."""


def read_header(path: Path) -> ShardHeader:
    """Parse and validate a safetensors file's header in one read; entries sorted by data offset.

    Checks that the file size is exactly 8 + header + data (catches truncation) and that every entry's
    byte span fits its dtype and shape. No tensor data is read.
    """
    try:
        header, header_len = _parse(Path(path))
    except OSError as error:
        raise ModelSourceError(f"corrupt safetensors file {path}: cannot read it ({error.strerror or error}); "
                               "re-download or re-convert it") from None
    except _Corrupt as error:
        raise ModelSourceError(f"corrupt safetensors file {path}: {error}; re-download or re-convert it") from None
    metadata = header.pop("__metadata__", None)
    entries = sorted((TensorEntry(name, info) for name, info in header.items()), key=lambda e: e.start)
    return ShardHeader(Path(path), tuple(entries), metadata, 8 + header_len)


def _parse(path: Path) -> tuple[dict, int]:
    size = path.stat().st_size
    if size < 8:
        raise _Corrupt(f"only {size} bytes, shorter than the 8-byte header length")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise _Corrupt(f"header length {header_len} does not fit in the {size}-byte file")
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _Corrupt(f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise _Corrupt("header is not a JSON object")
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        _check_entry(name, info)
        data_end = max(data_end, info["data_offsets"][1])
    expected = 8 + header_len + data_end
    if size != expected:
        kind = "truncated" if size < expected else "has trailing bytes"
        raise _Corrupt(f"{kind}: {size} bytes, header says {expected}")
    return header, header_len


def _check_entry(name: str, info) -> None:
    try:
        start, end = info["data_offsets"]
        shape, dtype = info["shape"], info["dtype"]
        numel = 1
        for dim in shape:
            numel *= int(dim)
    except (TypeError, KeyError, ValueError):
        raise _Corrupt(f"tensor {name!r} has a malformed header entry") from None
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end):
        raise _Corrupt(f"tensor {name!r} has bad data_offsets {info['data_offsets']}")
    width = DTYPE_BYTES.get(dtype)
    if width is not None and end - start != numel * width:
        raise _Corrupt(f"tensor {name!r} spans {end - start} bytes, but {dtype}{shape} needs {numel * width}")


# ---------------------------------------------------------------------------------------------------
# Atomic publishing: build beside the target (same file system), then rename.


def check_free_folder(output: Path, force: bool) -> None:
    """Refuse a file, or a non-empty folder without force: checked before any slow work starts."""
    if output.exists() and not output.is_dir():
        raise OptionError(f"output {output} exists and is not a folder; choose a folder name")
    if output.is_dir() and any(output.iterdir()) and not force:
        raise OptionError(
            f"output {output} exists and is not empty; choose another folder or pass --force to replace it"
        )


def hidden_sibling(path: Path, tag: str) -> Path:
    """Create and return a new empty folder `.{name}.{tag}-XXXXXXXX` beside `path` (honours the umask)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        candidate = path.parent / f".{path.name}.{tag}-{secrets.token_hex(4)}"
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue


def remove_tree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def staged_folder(output: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary folder beside `output`; on success rename it to `output`, on any error delete it."""
    staging = hidden_sibling(output, "tmp")
    try:
        yield staging
        publish(staging, output, force)
    except BaseException:  # includes KeyboardInterrupt: nothing half-written may remain
        remove_tree(staging)
        raise


def publish(staging: Path, output: Path, force: bool) -> None:
    """Rename the finished folder into place; an existing output is moved aside first and deleted last."""
    if output.is_symlink() or output.exists():
        if output.is_dir() and not output.is_symlink() and not any(output.iterdir()):
            output.rmdir()
        elif not force:
            raise OptionError(f"output {output} appeared while writing; choose another folder or pass --force")
        else:
            aside = output.parent / f".{output.name}.old-{secrets.token_hex(4)}"
            os.rename(output, aside)
            try:
                os.rename(staging, output)
            except BaseException:
                os.rename(aside, output)  # put the old output back
                raise
            remove_tree(aside)
            return
    os.rename(staging, output)


def write_json_atomic(path: Path, data: dict) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as stream:
            json.dump(data, stream, indent=1)
            stream.write("\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------------------
# The decoder's section of config.json

# Where a composite model nests its decoder's config (transformers' get_text_config(decoder=True)).
TEXT_CONFIG_KEYS = ("text_config", "decoder", "generator")


def text_section(config: dict) -> dict:
    """The (mutable) dict holding the decoder's fields: a nested text config, else the top level."""
    nested = [key for key in TEXT_CONFIG_KEYS if isinstance(config.get(key), dict)]
    if len(nested) > 1:
        raise UnsupportedModelError(
            f"config.json nests several decoder configs ({', '.join(nested)}); cannot tell which to prune"
        )
    return config[nested[0]] if nested else config


def text_num_layers(config: dict) -> int:
    """The decoder's layer count from a config.json dict."""
    layers = text_section(config).get("num_hidden_layers")
    if not isinstance(layers, int) or layers <= 0:
        raise UnsupportedModelError("config.json has no num_hidden_layers in its text config")
    return layers
