"""accelerate's big-model placement as the CLI takes it (--device-map, --max-memory, --offload-dir).

Torch-free, so `score --low-memory` can check its options before torch is imported; accelerate is
imported only to read a --max-memory size.
"""

from dataclasses import dataclass
from pathlib import Path

from prunetool.errors import OptionError

DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


@dataclass(frozen=True)
class Placement:
    """accelerate's big-model placement: layers spread over GPUs, then the CPU, then disk (offload_dir)."""

    device_map: str
    max_memory: dict | None = None  # {0: "20GiB", "cpu": "64GiB"}: accelerate's own form
    offload_dir: Path | None = None


def parse_max_memory(text: str) -> dict:
    """`0=20GiB,1=20GiB,cpu=64GiB` -> {0: "20GiB", 1: "20GiB", "cpu": "64GiB"}; sizes as accelerate reads them
    (a bare number is bytes)."""
    from accelerate.utils import convert_file_size_to_int

    limits: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, size = item.partition("=")
        key, size = key.strip(), size.strip()
        if not sep or not key or not size:
            raise OptionError(f"--max-memory: cannot read {item!r}; write DEVICE=SIZE, e.g. 0=20GiB,cpu=64GiB")
        device = int(key) if key.isdigit() else key
        size = int(size) if size.isdigit() else size  # a bare number is bytes
        if not isinstance(device, int) and device not in ("cpu", "mps", "disk"):
            raise OptionError(f"--max-memory: {key!r} is not a device (a GPU number, cpu or mps)")
        try:
            if convert_file_size_to_int(size) <= 0:
                raise ValueError(size)
        except (ValueError, TypeError):
            raise OptionError(f"--max-memory: cannot read the size {size!r} of {key} (e.g. 20GiB, 500MB)") from None
        limits[device] = size
    if not limits:
        raise OptionError(f"--max-memory: nothing to read in {text!r}; write DEVICE=SIZE, e.g. 0=20GiB,cpu=64GiB")
    return limits


def placement_from_options(device_map: str | None, max_memory: str | None, offload_dir: Path | None) -> Placement | None:
    """The CLI's --device-map, --max-memory and --offload-dir, checked; None keeps the one-device load."""
    if device_map is None:
        if max_memory is not None or offload_dir is not None:
            raise OptionError("--max-memory and --offload-dir need --device-map (auto, balanced, sequential)")
        return None
    if device_map not in DEVICE_MAPS:
        raise OptionError(f"--device-map must be one of {', '.join(DEVICE_MAPS)}, got {device_map!r}")
    return Placement(device_map, parse_max_memory(max_memory) if max_memory is not None else None, offload_dir)
