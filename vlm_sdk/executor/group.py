"""What both tensor-parallel executors share: commands over the control group, one at a time, and a
heartbeat that keeps an idle engine's ranks from timing out.

Every control-group operation times out after `distributed_timeout` (a hung rank must fail the step,
not hang it), so ranks > 0 waiting for the next command would time out too when the engine is idle.
Rank 0 therefore sends a no-op command whenever no command went out for a quarter of the timeout.
Commands and heartbeats share one lock: the control group sees one command at a time, in order.

Under pipeline parallelism (`StageControl`) `execute_async` submits a micro-batch and returns once stage 0
has run it (executor/stage_queue.py): several may be in flight, and their outputs come back in order.
Every other command first waits until none is (the stage groups carry one command stream each).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable, NoReturn

import torch.distributed as dist

from vlm_sdk.errors import EngineDeadError
from vlm_sdk.executor.executor import Executor, FailureCallback, Method
from vlm_sdk.executor.ranks import NOOP, SHUTDOWN, Command, RankFailure, broadcast_command, call, gather_replies
from vlm_sdk.executor.stage_control import StageControl
from vlm_sdk.executor.stage_queue import StageQueue
from vlm_sdk.protocol.runner_output import PendingOutput

logger = logging.getLogger("vlm_sdk")

REPORT_SECONDS = 3.0  # how long a failed collective waits for the failed rank's report


class GroupExecutor(Executor):
    """Rank 0 of a process group; subclasses set `_worker` (rank 0's, in this process), `world_size`,
    `_control` and `_timeout_s`, then call
    `_start_heartbeat()`, and may refine `_explain` (the error a failed call raises)."""
    _control: Any
    _timeout_s: float
    # the rank whose `execute` output the engine takes: 0, or under pipeline parallelism rank 0 of the last
    # stage (it samples); every rank then replies to `execute` and rank 0 adds its encoder-cache counters
    _output_rank: int = 0

    def _init_group_state(self) -> None:
        self._rpc_lock = threading.Lock()
        self._last_command = time.monotonic()
        self._serving = False  # heartbeats start after the first command: every rank has loaded by then
        self._stopped = threading.Event()
        self._dead: BaseException | None = None
        self._broken = False  # a call failed part-way: the ranks may wait in different collectives
        self._stage_queue: StageQueue | None = None  # pipeline parallelism: micro-batches in flight (made on first use)

    def collective_rpc(self, method: Method, *args: Any) -> list[Any]:
        return self._call(method, args, method != "execute" or self._output_rank != 0)

    def execute(self, sched):
        if isinstance(self._control, StageControl):
            return self.execute_async(sched).result()
        if self._output_rank == 0:
            return super().execute(sched)
        outs = self._call("execute", (sched,), True)
        return dataclasses.replace(outs[self._output_rank], encoder_cache=outs[0].encoder_cache)

    @property
    def max_concurrent_batches(self) -> int:
        """Micro-batches that may be in flight at once: the pipeline's stages (1 without stages)."""
        return len(self._control.stages) if isinstance(self._control, StageControl) else 1

    def execute_async(self, sched) -> PendingOutput:
        """Under pipeline parallelism: the step submitted as a micro-batch (returns once stage 0 ran it);
        otherwise the step run to its end."""
        if not isinstance(self._control, StageControl):
            return super().execute_async(sched)
        with self._rpc_lock:
            if self._dead is not None:
                raise self._dead
            if self._stage_queue is None:
                self._stage_queue = StageQueue(self._control, self._worker, self._explain)
            try:
                return self._stage_queue.submit(Command("execute", (sched,), reply=False, output=True))
            except BaseException as e:
                self._broken = True
                err = self._explain(e)
                self._stage_queue.fail(err)
                if err is e:
                    raise
                raise err from e
            finally:
                self._last_command = time.monotonic()
                self._serving = True

    def _broadcast(self, command: Command) -> None:
        """`command` to every other rank: on the control group, or stage by stage (`StageControl`)."""
        if isinstance(self._control, StageControl):
            for stage in range(len(self._control.stages)):
                self._control.broadcast(stage, command)
        else:
            broadcast_command(command, self._control)

    def _pipeline_idle(self) -> bool:
        return self._stage_queue is None or self._stage_queue.idle()

    def _call(self, method: Method, args: tuple, reply: bool) -> list[Any]:
        if self._stage_queue is not None:
            self._stage_queue.drain()  # the micro-batches in flight first: the stage groups carry one stream each
        with self._rpc_lock:
            if self._dead is not None:
                raise self._dead
            try:
                self._broadcast(Command(method, args, reply))
                result = call(self._worker, method, args)
                replies = self._control.everyone if isinstance(self._control, StageControl) else self._control
                out = gather_replies(result, self.world_size, replies) if reply else [result]
            except BaseException as e:
                self._broken = True
                err = self._explain(e)
                if err is e:
                    raise
                raise err from e
            finally:
                self._last_command = time.monotonic()
            self._serving = True
            return out

    def _explain(self, exc: BaseException) -> BaseException:
        return exc

    def _send_shutdown(self) -> bool:
        """SHUTDOWN to every rank; False when the group is already broken."""
        self._stopped.set()
        if not self._rpc_lock.acquire(timeout=5.0):  # a call is stuck in a collective: do not wait for it
            return False
        try:
            if self._dead is not None or self._broken or not self._pipeline_idle():
                return False
            self._broadcast(Command(SHUTDOWN))
        except Exception:  # noqa: BLE001 - a rank is gone
            return False
        finally:
            self._rpc_lock.release()
        return True

    def _start_heartbeat(self) -> None:
        threading.Thread(target=self._heartbeat, name="vlm-tp-heartbeat", daemon=True).start()

    def _heartbeat(self) -> None:
        interval = min(max(self._timeout_s / 4, 0.2), 60.0)
        while not self._stopped.wait(interval / 2):
            if not self._serving or time.monotonic() - self._last_command < interval:
                continue
            if not self._rpc_lock.acquire(blocking=False):
                continue  # a command is going out: that is a heartbeat too
            try:
                if self._dead is None and not self._stopped.is_set() and self._pipeline_idle():
                    self._broadcast(Command(NOOP, reply=False))
                    self._last_command = time.monotonic()
            except BaseException as e:  # noqa: BLE001 - the next call reports it
                self._dead = self._explain(e)
            finally:
                self._rpc_lock.release()


class StartedRanksExecutor(GroupExecutor):
    """A group executor that started ranks 1..N-1 itself (spawned processes, Ray actors) and watches
    them: a rank's reported error (`RankFailure`, gathered by `_collect`) or its end (`_ended_ranks`)
    becomes one `EngineDeadError` naming it, raised by the failed call and given to the failure
    callback. Subclasses call `_init_failures()`, implement `_collect` and `_ended_ranks`, and run
    `_rank_ended()` from a thread that wakes when a rank ends."""

    def _init_failures(self) -> None:
        self._failures: dict[int, RankFailure] = {}
        self._lock = threading.Lock()  # guards _failures and _closing
        self._callback: FailureCallback | None = None
        self._closing = False

    def _collect(self, wait_s: float) -> None:
        """Move reported failures into `_failures`, waiting up to `wait_s` for the first."""
        raise NotImplementedError

    def _ended_ranks(self) -> list[str]:
        """How each rank that has ended did ("vlm-tp-rank-1 exited with code -9"); empty while all live."""
        raise NotImplementedError

    def _wait_for(self, store, stage: str, size: int, timeout_s: float) -> None:
        """Until every rank > 0 set the store key `stage/r` ("started", "loaded"), watching that none ended."""
        keys = [f"{stage}/{r}" for r in range(1, size)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            dead = self._ended_ranks()
            if dead:
                raise EngineDeadError(f"{dead[0]} before it {stage}")
            if time.monotonic() > deadline:
                late = [k.split("/")[1] for k in keys if not store.check([k])]
                raise EngineDeadError(f"tensor-parallel rank(s) {', '.join(late)} not {stage} after {timeout_s:g} s")
            time.sleep(0.05)

    def _raise_start_failure(self, exc: BaseException, end_ranks: Callable[[], None]) -> NoReturn:
        """Start-up failed: end the ranks started so far (`end_ranks`) and raise the failure, as
        `_explain` names it."""
        err = self._explain(exc)
        end_ranks()
        if err is exc:
            raise exc
        raise err from exc

    def set_failure_callback(self, callback: FailureCallback) -> None:
        self._callback = callback
        if self._dead is not None:
            callback(self._dead)

    def _explain(self, exc: BaseException) -> BaseException:
        """A failed call: an EngineDeadError naming the failed rank when one did (`exc` as its cause),
        else `exc` itself (rank 0's own error)."""
        if isinstance(exc, EngineDeadError) and ("tensor-parallel rank" in str(exc) or "pipeline stage" in str(exc)):
            return exc
        ranks_dead = bool(self._ended_ranks())
        peer_error = isinstance(exc, (RuntimeError, dist.DistBackendError)) and not isinstance(exc, EngineDeadError)
        if not (ranks_dead or peer_error or self._failures):
            return exc
        self._collect(0.0 if self._failures else REPORT_SECONDS if ranks_dead else 1.0)
        # a killed rank's sockets close while its process is still being torn down: on a busy machine its end
        # shows a moment after the peer's error, so look again for a while before calling every rank alive
        deadline = time.monotonic() + REPORT_SECONDS
        while not (self._failures or self._ended_ranks()) and time.monotonic() < deadline:
            time.sleep(0.05)
        err = self._death_error(exc)
        self._dead = self._dead or err
        return self._dead

    def _death_error(self, exc: BaseException | None) -> EngineDeadError:
        with self._lock:
            failures = sorted(self._failures.values(), key=lambda f: f.rank)
        if failures:
            what = "; ".join(f.describe() for f in failures) + " (its traceback is in the log)"
        else:
            gone = self._ended_ranks()
            what = "; ".join(gone) if gone else (
                f"a tensor-parallel collective failed while every rank process is alive: a rank is hung or the "
                f"link between ranks broke (distributed_timeout={self._timeout_s:g} s): {exc!r}")
        return EngineDeadError(f"{what}; every rank is needed for each step, so the engine stopped. "
                               f"Restart it (and see that rank's log for why it failed)")

    def _rank_ended(self) -> None:
        """A rank ended while nobody was shutting down: the engine is dead; say so at once."""
        if self._closing:
            return
        self._collect(REPORT_SECONDS)
        err = self._death_error(None)
        with self._lock:
            if self._closing:
                return
        self._dead = self._dead or err
        if self._stage_queue is not None:
            self._stage_queue.fail(self._dead)  # the micro-batches in flight fail now, whatever their rank waits on
        logger.error("%s", self._dead)
        if self._callback is not None:
            self._callback(self._dead)
