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
