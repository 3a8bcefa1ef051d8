"""Warn when preemptions come often enough to cost real throughput.

A preempted sequence loses its KV blocks and recomputes its prompt and output later; an occasional
one is cheap, a steady stream means the cache is too small for `max_num_seqs` sequences of the
lengths being served. The engine records each step's preemptions here; once more than
`threshold_per_minute` fall within the last 60 s, one warning is logged naming the numbers and the
settings that change it, then at most one more per minute while it goes on.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

WINDOW_S = 60.0


class PreemptionWatch:
    def __init__(self, threshold_per_minute: int, clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger | None = None):
        self.threshold = threshold_per_minute
        self._clock = clock
        self._log = logger or logging.getLogger("vlm_sdk")
        self._times: deque[float] = deque()
        self._last_warning: float | None = None
        self._lock = threading.Lock()  # stats() reads from the server's thread while the engine records
        self.num_warnings = 0

    def count_last_minute(self) -> int:
        with self._lock:
            self._drop_old(self._clock())
            return len(self._times)

    def record(self, count: int, describe: Callable[[int], str]) -> str | None:
        """Note `count` preemptions now; returns (and logs) the warning when one is due.
        `describe(n)` words the warning for n preemptions in the last minute."""
        if count <= 0:
            return None
        now = self._clock()
        with self._lock:
            self._times.extend([now] * count)
            self._drop_old(now)
            n = len(self._times)
        if n <= self.threshold:
            return None
        if self._last_warning is not None and now - self._last_warning < WINDOW_S:
            return None
        self._last_warning = now
        self.num_warnings += 1
        message = describe(n)
        self._log.warning(message)
        return message

    def _drop_old(self, now: float) -> None:
        while self._times and now - self._times[0] > WINDOW_S:
            self._times.popleft()


def preemption_warning(n: int, threshold: int, num_blocks: int, block_size: int, num_running: int,
                       max_num_seqs: int, mean_tokens: int, blocks_per_sequence: int | None = None) -> str:
    """The warning's words: what happened, why, and the settings that stop it. `blocks_per_sequence`: the
    blocks one sequence of `mean_tokens` holds over every cache group (None: one block per block_size
    tokens, a model of one attention kind)."""
    if blocks_per_sequence is None:
        fit = max(1, num_blocks * block_size // max(mean_tokens, 1))
    else:
        fit = max(1, num_blocks // max(blocks_per_sequence, 1))
    return (f"{n} preemptions in the last 60 s (warning threshold {threshold} per minute, "
            f"preemption_warning_per_minute): the KV cache of {num_blocks} blocks x {block_size} tokens = "
            f"{num_blocks * block_size} tokens cannot hold the {num_running} running sequences (max_num_seqs "
            f"{max_num_seqs}) as they grow, {mean_tokens} tokens each on average, so sequences are evicted and "
            f"recomputed. Set max_num_seqs to about {min(fit, max_num_seqs)} (what the cache holds at that "
            f"length), or give the cache more memory (memory_utilization, kv_cache_memory or num_blocks)")
