"""Give memory the allocator holds free back to the system.

After a request has made and freed something large (a 28 MB body, a 50 MB response), glibc keeps
the freed memory for later use: the process's resident size then shows a peak that is no longer
used. `trim_heap` returns it (glibc's `malloc_trim(0)`, a ctypes call that releases the GIL while it
walks the heap); elsewhere it does nothing. Call it off the event loop, and only when nothing runs:
it holds the allocator's lock for its walk (0.1-0.4 s on a large fragmented heap).
"""
from __future__ import annotations

import ctypes
import os

# glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
# a server's settings (bound_server_heap): two arenas; every block of 1 MiB or more mapped on its own
SERVER_ARENAS = 2
SERVER_MMAP_THRESHOLD = 1 << 20
# set by the user: their choice stands
_USER_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


def trim_heap() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def bound_server_heap() -> bool:
    """Allocator settings for a long-running server process (glibc; elsewhere, or where the user set
    any of MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_ or GLIBC_TUNABLES, nothing: False).

    glibc gives each thread that allocates an arena of its own, up to 8 per core, and memory freed in one
    is reused only there; a server's threads (event loop, engine, body writer, tokenizer and grammar
    workers) each keep the high-water mark of whatever passed through them. And after the first large
    block is freed, glibc raises its mmap threshold to that block's size (up to 32 MiB), so later
    multi-megabyte bodies and arrays come from the arenas, where a small live object above them keeps
    the freed pages resident. Two arenas and a fixed 1 MiB threshold (each larger block mapped on its
    own, returned to the system when freed) took `bench-serve --red-team`'s RSS growth on the tiny model
    from +190 to +129 MiB (BENCHMARKS.md). Call it before the engine starts its threads: arenas made
    before it are kept."""
    if any(name in os.environ for name in _USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_ARENA_MAX, SERVER_ARENAS)) and bool(libc.mallopt(M_MMAP_THRESHOLD,
                                                                                   SERVER_MMAP_THRESHOLD))
    except (OSError, AttributeError):  # not glibc
        return False
