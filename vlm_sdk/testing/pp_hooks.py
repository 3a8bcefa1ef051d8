"""Hooks into the ranks of a pipeline-parallel engine (tests): plain data, for `collective_rpc(fn)`."""
from __future__ import annotations

import os
from typing import Any


def stage_transfers(worker: Any) -> list[tuple[int, str, int, int]]:
    """This rank's recorded cross-stage transfers (worker/pp_transfer.py: step, "send"/"recv", peer, tokens)."""
    stage = worker.runner.stage
    return [] if stage is None else list(stage.log)


def rank_process(worker: Any) -> tuple[int, int, int, tuple[int, int] | None]:
    """(global rank, pipeline stage, pid, the decoder layers it holds)."""
    return worker.parallel.rank, worker.parallel.pp.rank, os.getpid(), worker.stage_layers


def stage_busy(worker: Any) -> list[tuple[float, float]]:
    """When this rank computed each step: (start, end), monotonic seconds (worker/pp_transfer.py)."""
    stage = worker.runner.stage
    return [] if stage is None else list(stage.busy)


def overlap_seconds(first: list[tuple[float, float]], second: list[tuple[float, float]]) -> float:
    """How long two ranks computed at the same time: the total intersection of their busy intervals."""
    total, j = 0.0, 0
    for start, end in first:  # both lists ascending and each rank's intervals disjoint
        while j < len(second) and second[j][1] <= start:
            j += 1
        k = j
        while k < len(second) and second[k][0] < end:
            total += min(end, second[k][1]) - max(start, second[k][0])
            k += 1
    return total
