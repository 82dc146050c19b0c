"""Byte-level safetensors copy: rename and drop tensors without ever decoding them.

A safetensors file is `u64 header length | JSON header | raw tensor bytes`, and each header entry
says where its bytes lie (`data_offsets`, relative to the end of the header). Pruning only renames
and drops entries, so the writer copies each kept tensor's byte range into the new file and writes a
header with the new names and offsets. Why not `safe_open(...).get_tensor` + `save_file`:
* memory is one copy buffer, not one shard (transformers 5 writes shards of up to 50 GB by default,
  so "one shard" can be the whole model);
* bytes are identical by construction: no dtype round trip through torch, any dtype string passes;
* the kernel can copy the ranges (`os.copy_file_range`) without them entering the process.
The result is checked by `safe_open` itself after writing (see `verify_shard`).

`prune --patch` changes a few kept tensors: those are passed as new torch tensors, cast to the source
tensor's dtype and written in its place (same shape, same byte count, so every offset is unchanged);
every other tensor is still copied byte for byte.
"""

import json
import os
import struct
from pathlib import Path

from safetensors import safe_open

from prunetool.checkpoint_io import ShardHeader, TensorEntry
from prunetool.errors import ModelSourceError

COPY_CHUNK = 64 << 20  # bytes per copy call; bounds user-space memory when the kernel copy is unavailable
HEADER_ALIGN = 8  # safetensors pads the header with spaces so tensor data starts 8-byte aligned
# safetensors dtype strings -> torch dtype names (those a replaced tensor may have); torch is imported
# only when a tensor is replaced, so a plain prune never loads it here
TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def torch_dtype_of(entry: TensorEntry):
    """The torch dtype of a header entry; only floating tensors can be replaced."""
    import torch

    dtype = getattr(torch, TORCH_DTYPES.get(entry.info["dtype"], ""), None)
    if dtype is None:
        raise ModelSourceError(f"tensor {entry.name} has dtype {entry.info['dtype']}, which prunetool cannot rewrite")
    return dtype


def tensor_bytes(entry: TensorEntry, tensor) -> bytes:
    """`tensor` cast to `entry`'s dtype, as the raw little-endian bytes that replace the entry's data."""
    shape = [int(dim) for dim in entry.info["shape"]]
    if list(tensor.shape) != shape:
        raise ModelSourceError(f"replacement for {entry.name} has shape {list(tensor.shape)}, the source {shape}")
    import torch

    data = tensor.detach().to("cpu", torch_dtype_of(entry)).contiguous().reshape(-1).view(torch.uint8)
    raw = data.numpy().tobytes()
    if len(raw) != entry.nbytes:
        raise ModelSourceError(f"replacement for {entry.name} is {len(raw)} bytes, the source {entry.nbytes}")
    return raw


def encode_header(entries: list[tuple[str, dict]], metadata: dict | None) -> bytes:
    """The `u64 length + JSON` prefix for `entries` laid out back to back, in the given order."""
    header: dict = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for name, info in entries:
        size = info["data_offsets"][1] - info["data_offsets"][0]
        header[name] = {**info, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % HEADER_ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def write_shard(source: ShardHeader, renamed: list[tuple[TensorEntry, str]], target: Path,
                replacements: dict | None = None) -> int:
    """Write the (entry, new name) pairs of `source` into `target`; return the tensor bytes written.

    Entries are written in source order, so the reads walk the source file forwards. An entry whose
    source name is in `replacements` ({source name: torch tensor}) gets that tensor's bytes instead,
    cast to the entry's dtype; its shape must be the entry's.
    """
    replacements = replacements or {}
    pairs = sorted(renamed, key=lambda pair: pair[0].start)
    prefix = encode_header([(new, entry.info) for entry, new in pairs], source.metadata)
    written = 0
    with open(source.path, "rb") as src, open(target, "wb") as dst:
        dst.write(prefix)
        dst.flush()
        for entry, _ in pairs:
            if entry.name in replacements:
                dst.write(tensor_bytes(entry, replacements[entry.name]))
            else:
                copy_range(src, dst, source.data_start + entry.start, entry.nbytes)
            written += entry.nbytes
    return written


def copy_range(src, dst, offset: int, length: int) -> None:
    """Append `length` bytes of `src` starting at `offset` to `dst` (kernel copy when possible)."""
    dst.flush()  # the kernel copy writes to the descriptor, behind Python's buffer
    start = dst.tell()
    done = _kernel_copy(src, dst, offset, start, length)
    dst.seek(start + done)
    src.seek(offset + done)
    while done < length:  # what the kernel copy did not do (unsupported file system, old kernel)
        chunk = src.read(min(COPY_CHUNK, length - done))
        if not chunk:
            raise ModelSourceError(f"{src.name} ended early while copying tensor data; re-download it")
        dst.write(chunk)
        done += len(chunk)


def _kernel_copy(src, dst, offset: int, dst_offset: int, length: int) -> int:
    """Copy with `os.copy_file_range` as far as it goes; return the bytes copied (0 if unavailable)."""
    done = 0
    if not hasattr(os, "copy_file_range"):
        return 0
    try:
        while done < length:
            n = os.copy_file_range(src.fileno(), dst.fileno(), min(COPY_CHUNK, length - done),
                                   offset + done, dst_offset + done)
            if n == 0:
                break
            done += n
    except OSError:  # EXDEV, ENOSYS, EINVAL on some file systems: the caller falls back to read/write
        pass
    return done


def verify_shard(path: Path, expected: list[str]) -> None:
    """Open the written file with safetensors' own reader: header and tensor list must be exact."""
    with safe_open(path, framework="pt") as f:
        found = sorted(f.keys())
    if found != sorted(expected):
        raise ModelSourceError(f"written shard {path.name} does not list the expected tensors; this is a bug")
