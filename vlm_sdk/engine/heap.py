"""The C allocator's memory in a serving process: how it is arranged, and giving back what it keeps free.

`bound_server_heap` (at `vlm-sdk serve`'s start and in each Ray Serve replica) limits glibc to two
arenas. After a request has made and freed something large (a 28 MB body, a 50 MB response), glibc keeps
the freed memory for later use: the process's resident size then shows a peak that is no longer
used. `trim_heap` returns it (glibc's `malloc_trim(0)`, a ctypes call that releases the GIL while it
walks the heap); elsewhere it does nothing. Call it off the event loop, and only when nothing runs:
it holds the allocator's lock for its walk (0.1-0.4 s on a large fragmented heap).
"""
from __future__ import annotations

import ctypes
import os

M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)
SERVER_ARENAS = 2  # bound_server_heap's
# glibc's own settings: where the user set any, their choice stands
USER_ALLOCATOR_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


def trim_heap() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def bound_server_heap() -> bool:
    """Two malloc arenas for a long-running server process (glibc; elsewhere, or where the user set
    MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_ or GLIBC_TUNABLES, nothing: False). Call it before the
    engine starts its threads: an arena is kept once made.

    glibc gives each thread that allocates an arena of its own, up to 8 per core, and memory freed in
    an arena is reused only by the threads attached to it: a server's threads (event loop, engine, body
    writer, tokenizer and grammar workers) each kept the high-water mark of what passed through them.
    With two, `bench-serve --red-team`'s RSS growth on the tiny model went from +190 to +147 MiB, and
    the HTTP server's decode speed on the ~100M bench model did not change (BENCHMARKS.md). A fixed
    1 MiB mmap threshold besides (every larger block mapped on its own) took the growth to +129 MiB
    but made each CPU decode step page-fault its multi-megabyte temporaries: 0.68x the speed."""
    if any(name in os.environ for name in USER_ALLOCATOR_SETTINGS):
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(M_ARENA_MAX, SERVER_ARENAS))
    except (OSError, AttributeError):  # not glibc
        return False
