"""Giving freed host memory back to the operating system.

glibc's allocator keeps freed blocks in its heap for reuse and gives pages back on its own only at the
heap's top, so after an engine frees its CPU weights and cache most of the process's resident memory can
stay (it does once any block allocated earlier was freed below them). ``malloc_trim(0)`` returns the
free pages at any place in the heap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None


def return_freed_host_memory() -> bool:
    """Ask the C allocator to return its free pages to the system; whether it could be asked."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
