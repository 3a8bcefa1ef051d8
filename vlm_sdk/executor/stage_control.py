"""The control groups of a pipeline-parallel world: how commands reach each stage and outputs come back.

One gloo group for every rank's commands (as without stages) would make rank 0 wait for the slowest
stage before it could hand the next micro-batch to the first: a broadcast completes only when every
member has taken it, and a later stage takes it only after the micro-batch it is computing. So each
stage has its own command group, always with rank 0 in it:

    stage 0       its own ranks (none when it is rank 0 alone: rank 0 calls its worker directly)
    stage s > 0   rank 0 and stage s's ranks
    everyone      every rank: replies of the other commands (`collective_rpc`), gathered to rank 0
    output        rank 0 and the last stage's rank 0: a micro-batch's `ModelRunnerOutput`, sent point to
                  point (`send_object_list`), in the order the micro-batches ran

Every rank creates every group, in this order (torch requires it), whether it is a member or not.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from vlm_sdk.config import ParallelConfig


@dataclass(frozen=True)
class StageControl:
    everyone: Any  # the gloo group of every rank
    stages: tuple  # per stage: the group its commands go out on (None: rank 0 alone)
    output: Any  # the gloo group {0, output_rank}
    output_rank: int  # the last stage's rank 0: it samples
    rank: int  # this rank, global
    stage: int  # this rank's stage

    @property
    def commands(self) -> Any:
        """The group this rank (> 0) receives its commands on."""
        return self.stages[self.stage]

    @property
    def sends_output(self) -> bool:
        return self.rank == self.output_rank

    def send_output(self, result: Any) -> None:
        """The last stage's rank 0: a micro-batch's output to rank 0."""
        dist.send_object_list([result], dst=0, group=self.output)

    def recv_output(self) -> Any:
        """Rank 0: the next micro-batch's output from the last stage (blocking)."""
        box: list[Any] = [None]
        dist.recv_object_list(box, src=self.output_rank, group=self.output)
        return box[0]

    def broadcast(self, stage: int, command: Any) -> None:
        """Rank 0: `command` to stage `stage`'s ranks (nothing when stage 0 is rank 0 alone)."""
        group = self.stages[stage]
        if group is not None:
            dist.broadcast_object_list([command], src=0, group=group)


def stage_control(rank: int, parallel: ParallelConfig, everyone: Any, timeout_s: float) -> StageControl:
    """Create the stage command groups and the output group (every rank calls this, in the same order)."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    timeout = timedelta(seconds=timeout_s)
    stages = []
    for s in range(pp):
        members = list(range(s * tp, (s + 1) * tp)) if s == 0 else [0, *range(s * tp, (s + 1) * tp)]
        stages.append(dist.new_group(members, backend="gloo", timeout=timeout) if len(members) > 1 else None)
    output_rank = (pp - 1) * tp
    output = dist.new_group([0, output_rank], backend="gloo", timeout=timeout)
    return StageControl(everyone, tuple(stages), output, output_rank, rank, rank // tp)
