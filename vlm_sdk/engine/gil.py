"""How often the interpreter hands the GIL from a running thread to a waiting one, in a serving process.

A serving process runs the engine thread beside the event loop and worker threads (large request bodies
parsed in pieces, tokenizing, output formatting). The engine thread gives the GIL up around every torch
op and must take it back after: while another thread runs Python, each taking back waits for the
running thread's switch interval (Python's default 5 ms) to end, so a decode step of a few hundred ops
slows to the other thread's pace and every stream stalls for as long as that thread runs (the convoy
effect). Two 2 MB bodies of 10,000 tools parsed beside a stream stalled it 0.17-0.70 s at 5 ms and
0.05-0.06 s at 0.5 ms (`vlm-sdk bench-serve --red-team --red-team-rows 41.7`, BENCHMARKS.md).

`vlm-sdk serve` (`--switch-interval-ms`) and each Ray Serve replica set it at their start; a Python
program that embeds `AsyncLLM` keeps its own (`sys.setswitchinterval` is the process's setting).
"""
from __future__ import annotations

import sys

SERVER_SWITCH_INTERVAL_MS = 0.5


def set_server_switch_interval(ms: float = SERVER_SWITCH_INTERVAL_MS) -> float:
    """Set the process's switch interval to `ms` milliseconds; the previous one, in milliseconds."""
    before = sys.getswitchinterval() * 1000
    sys.setswitchinterval(ms / 1000)
    return before
