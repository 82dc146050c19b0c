"""Writing the GGUF atomically: a hidden file beside OUT, fsynced, then renamed over OUT.

gguf's GGUFWriter writes the header, the metadata and the tensor index first; tensors then follow one at a
time, so memory holds a single tensor however large the model is. A failure or interrupt removes the
temporary file, and readers of OUT never see half a file.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np

from prunetool.checkpoint.gguf.tensors import PlannedTensor, encode
from prunetool.errors import OptionError


class KeyValue(NamedTuple):
    """The arguments of GGUFWriter's add_string/add_array, which take a key as well as a value."""

    key: str
    value: object


def check_output(output: Path, folder: Path, force: bool) -> Path:
    """Refuse, before any work, an output that is a folder, lies inside the source folder, or exists without --force."""
    output = Path(output).expanduser()
    if output.is_dir():
        raise OptionError(f"--gguf {output} is a folder; give a file name such as model.gguf")
    resolved = output.resolve()
    if resolved.is_relative_to(Path(folder).expanduser().resolve()):
        raise OptionError(f"--gguf {output} is inside the source folder, which export never modifies; write it "
                          "elsewhere")
    if output.exists() and not force:
        raise OptionError(f"--gguf {output} exists; choose another file or pass --force to replace it")
    return resolved


def temporary_beside(output: Path) -> Path:
    output.parent.mkdir(parents=True, exist_ok=True)
    return output.parent / f".{output.name}.tmp-{secrets.token_hex(4)}"


def fsync_path(path: Path, directory: bool = False) -> None:
    descriptor = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_gguf(output: Path, arch_name: str, calls: list[tuple[str, object]], special: gguf.SpecialVocab | None,
               tensors: list[PlannedTensor], on_tensor: Callable[[int, int], None] | None = None) -> int:
    """Write metadata (GGUFWriter method calls, then SpecialVocab) and tensors to `output` atomically; returns bytes."""
    temporary = temporary_beside(output)
    writer = gguf.GGUFWriter(temporary, arch_name)
    try:
        for method, value in calls:
            getattr(writer, method)(*(value if isinstance(value, KeyValue) else (value,)))
        if special is not None:
            special.add_to_gguf(writer, quiet=True)
        for tensor in tensors:
            # a logical shape: the dtype only says it is not a byte array
            writer.add_tensor_info(tensor.name, tensor.shape, np.float32, tensor.nbytes, raw_dtype=tensor.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for done, tensor in enumerate(tensors, 1):
            writer.write_tensor_data(encode(tensor.values(), tensor.qtype))
            if on_tensor is not None:
                on_tensor(done, len(tensors))
        writer.close()
        fsync_path(temporary)
        os.replace(temporary, output)
        fsync_path(output.parent, directory=True)
    except BaseException:  # an interrupt too: no half-written file stays behind
        writer.close()
        temporary.unlink(missing_ok=True)
        raise
    return output.stat().st_size
