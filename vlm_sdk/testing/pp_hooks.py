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
