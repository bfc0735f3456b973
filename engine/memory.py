"""Giving freed memory back to the operating system (glibc's allocator on Linux).

A server's memory use peaks with its load (big prompts, many requests, tokenizer and gRPC
threads each with an allocator arena of its own); freed memory stays in those arenas, so without
help the resident size stays at its peak long after the load has gone. Fewer arenas bound the
fragmentation, and trimming when idle returns the free pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # mallopt parameter (malloc.h)
MAX_ARENAS = 4


def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "malloc_trim"):
        return None  # not glibc (musl, macOS): nothing to do
    return libc


_LIBC = _libc()


def limit_arenas(max_arenas: int = MAX_ARENAS) -> None:
    """Bound the allocator's arenas; call before threads start allocating."""
    if _LIBC is not None:
        _LIBC.mallopt(_M_ARENA_MAX, max_arenas)


def release_free_memory() -> None:
    """Return the allocator's free pages to the operating system (a few ms; call when idle)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
