"""The executor: runs each worker method on every rank, in the same order, and returns rank 0's result.

The engine talks to ranks only through this interface (after vLLM's executors):

    collective_rpc(method, *args)   call `Worker.method(*args)` on every rank; results in rank order
    execute(sched)                  one step on every rank; rank 0's `ModelRunnerOutput`
    execute_async(sched)            the same, returned once queued: `PendingOutput.result()` waits for it
    driver                          rank 0's `Worker`, in this process (the engine reads its model's sizes)
    shutdown()                      end every rank (idempotent)
    set_failure_callback(fn)        fn(EngineDeadError) once, from another thread, when a rank dies

`InProcessExecutor` is one rank (no process group, no collectives). The tensor-parallel executors are
in `multiproc.py` (one spawned process per rank) and `torchrun.py` (ranks started by torchrun).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

from vlm_sdk.errors import EngineDeadError
from vlm_sdk.worker.io import ModelRunnerOutput, SchedulerOutput
from vlm_sdk.worker.pending_output import PendingOutput
from vlm_sdk.worker.worker import Worker

FailureCallback = Callable[[EngineDeadError], None]


class Executor(ABC):
    driver: Worker

    @property
    def world_size(self) -> int:
        return self.driver.tp.size

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """`Worker.<method>(*args)` on every rank; the results in rank order."""

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute", sched)[0]

    def execute_async(self, sched: SchedulerOutput) -> PendingOutput:
        """Ranks in other processes run each step to its end (asynchronous scheduling needs one rank:
        `EngineArgs.resolve_async_scheduling`)."""
        return PendingOutput.done(self.execute(sched))

    def set_failure_callback(self, callback: FailureCallback) -> None:
        """Only executors with other processes can learn of a failure outside a call."""

    def shutdown(self) -> None:
        """Nothing to end for one in-process rank."""


class InProcessExecutor(Executor):
    def __init__(self, model_dir: str, args, device):
        self.driver = Worker(model_dir, args, device)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.driver, method)(*args)]

    def execute_async(self, sched: SchedulerOutput) -> PendingOutput:
        return self.driver.execute_async(sched)
