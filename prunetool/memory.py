"""Handing freed memory back to the system; torch-free, so the tokenizer path can use it before torch loads."""

import ctypes
import functools


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        return None


def return_freed_memory() -> None:
    """glibc keeps freed blocks in its heap, so the resident set only grows; malloc_trim hands them back."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def status_kib(field: str) -> int | None:
    """A `VmXxx:` line of /proc/self/status in KiB (Linux only)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _cgroup_room() -> int | None:
    """Bytes left under this process's memory cgroup limit (v2 memory.max, or v1 memory.limit_in_bytes), if any."""
    from pathlib import Path

    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            folder, limit_file, usage_file = Path("/sys/fs/cgroup") / path.lstrip("/"), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            folder, limit_file, usage_file = (Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "memory.limit_in_bytes",
                                              "memory.usage_in_bytes")
        else:
            continue
        try:
            limit, usage = (folder / limit_file).read_text().strip(), int((folder / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit != "max" and int(limit) < 2**60:  # v1 writes a huge number for "no limit"
            return max(0, int(limit) - usage)
    return None


def memory_available_bytes() -> int | None:
    """What this process may still allocate: the system's available memory, lowered by a memory cgroup limit
    and by a data or address-space rlimit where one is set (minus what the process already uses of each);
    None where nothing is known."""
    import resource

    limits = [room] if (room := _cgroup_room()) is not None else []
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    for limit, field in ((resource.RLIMIT_DATA, "VmData"), (resource.RLIMIT_AS, "VmSize")):
        soft = resource.getrlimit(limit)[0]
        used = status_kib(field)
        if soft != resource.RLIM_INFINITY and used is not None:
            limits.append(max(0, soft - used * 1024))
    return min(limits) if limits else None


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def peak_memory(device) -> dict:
    """The most this process has held on `device` so far: CUDA's allocator high-water mark, else the peak RSS."""
    if device.type == "cuda":
        import torch

        return {"bytes": torch.cuda.max_memory_allocated(device), "measure": "torch.cuda.max_memory_allocated"}
    return {"bytes": peak_rss_bytes(), "measure": "peak resident set of the process"}


def checkpoint_bytes(folder) -> int:
    from pathlib import Path

    return sum(path.stat().st_size for path in Path(folder).glob("*.safetensors"))


def use_low_memory(requested: bool, placement, folder, console) -> bool:
    """--low-memory as asked, or chosen here when no --device-map was given and the checkpoint does not fit."""
    return requested or (placement is None and streams_by_itself(folder, console))


def streams_by_itself(folder, console) -> bool:
    """True (said on stderr) when the checkpoint is larger than 80% of what this process may still allocate:
    the commands then read one decoder layer at a time (--low-memory) instead of loading it."""
    need, available = checkpoint_bytes(folder), memory_available_bytes()
    if available is None or need <= 0.8 * available:
        return False
    console.print(f"the checkpoint ({need / 2**30:.2f} GiB) does not fit in the memory this process may use "
                  f"({available / 2**30:.2f} GiB): reading one decoder layer at a time (--low-memory)", highlight=False)
    return True
