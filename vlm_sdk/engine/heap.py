"""Give memory the allocator holds free back to the system.

After a request has made and freed something large (a 28 MB body, a 50 MB response), glibc keeps
the freed memory for later use: the process's resident size then shows a peak that is no longer
used. `trim_heap` returns it (glibc's `malloc_trim(0)`, a ctypes call that releases the GIL while it
walks the heap); elsewhere it does nothing. Call it off the event loop, and only when nothing runs:
it holds the allocator's lock for its walk (0.1-0.4 s on a large fragmented heap).
"""
from __future__ import annotations

import ctypes


def trim_heap() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
