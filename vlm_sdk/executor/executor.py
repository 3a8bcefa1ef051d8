"""The executor: runs each worker method on every rank, in the same order, and returns rank 0's result.

The engine talks to ranks only through this interface (after vLLM's executors):

    collective_rpc(method, *args)   call `Worker.method(*args)` on every rank; results in rank order
                                    (plain data: vlm_sdk/protocol/). `method` may be a function
                                    `fn(worker, *args)` (picklable under tensor parallelism), as in
                                    vLLM: how tests and benchmarks reach a rank's objects
    execute(sched)                  one step on every rank; rank 0's `ModelRunnerOutput`
    execute_async(sched)            the same, returned once queued: `PendingOutput.result()` waits for it
    world_size                      the number of ranks
    shutdown()                      end every rank (idempotent)
    set_failure_callback(fn)        fn(EngineDeadError) once, from another thread, when a rank dies

No rank's objects are exposed: rank 0 may live in the engine's process or not, and nothing above
this interface can tell.

`InProcessExecutor` is one rank (no process group, no collectives). The tensor-parallel executors are
in `multiproc.py` (one spawned process per rank) and `torchrun.py` (ranks started by torchrun).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

from vlm_sdk.errors import EngineDeadError
from vlm_sdk.executor.ranks import call
from vlm_sdk.protocol.runner_output import ModelRunnerOutput, PendingOutput, Ready
from vlm_sdk.protocol.scheduler_output import SchedulerOutput
from vlm_sdk.worker.worker import Worker

FailureCallback = Callable[[EngineDeadError], None]
Method = str | Callable[..., Any]  # a Worker method's name, or fn(worker, *args)


class Executor(ABC):
    world_size: int = 1

    @abstractmethod
    def collective_rpc(self, method: Method, *args: Any) -> list[Any]:
        """`Worker.<method>(*args)` (or `method(worker, *args)`) on every rank; the results in rank order."""

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute", sched)[0]

    def execute_async(self, sched: SchedulerOutput) -> PendingOutput:
        """Ranks in other processes run each step to its end (asynchronous scheduling needs one rank:
        `EngineArgs.resolve_async_scheduling`)."""
        return Ready(self.execute(sched))

    def set_failure_callback(self, callback: FailureCallback) -> None:
        """Only executors with other processes can learn of a failure outside a call."""

    def shutdown(self) -> None:
        """Nothing to end for one in-process rank."""


class InProcessExecutor(Executor):
    def __init__(self, model_dir: str, config, device):
        self._worker = Worker(model_dir, config, device)

    def collective_rpc(self, method: Method, *args: Any) -> list[Any]:
        return [call(self._worker, method, args)]

    def execute_async(self, sched: SchedulerOutput) -> PendingOutput:
        return self._worker.execute_async(sched)
