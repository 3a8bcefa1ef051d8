"""Rank 0's micro-batches in flight under pipeline parallelism (vLLM's batch queue, executor side).

`submit(command)` hands one micro-batch to every stage and returns once stage 0 has computed its share and
sent it on, without waiting for the later stages:

    caller's thread   command to stage 0's other ranks -> queue it for the sender -> rank 0's own share of
                      stage 0 (its worker's `execute`: compute, then a blocking send to stage 1)
    vlm-pp-send       the queued commands to stages 1.., one after another, in order (each stage's group
                      takes a command only once that stage has finished the micro-batch before it)
    vlm-pp-recv       the last stage's outputs, in submission order, each into its micro-batch's future

So while stage 1 computes micro-batch k, rank 0 is free to schedule micro-batch k + 1 and compute stage 0's
share of it. Each stage runs its micro-batches in the order submitted (one thread per rank runs the model),
which is what keeps a request's later chunk after its earlier one and a reused block's new content after
its old reader on every stage. A failure (a dead stage: its peer's send, recv or broadcast fails) fails
every micro-batch in flight with the error `explain` makes of it, and every later `submit`.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

from vlm_sdk.executor.ranks import Command, call
from vlm_sdk.executor.stage_control import StageControl
from vlm_sdk.protocol.runner_output import ModelRunnerOutput, PendingOutput


class StagedOutput(PendingOutput):
    """A micro-batch in the pipeline: the last stage's output, with rank 0's encoder-cache counters (stage 0
    encodes the images)."""

    def __init__(self, future: Future, local: ModelRunnerOutput):
        self._future, self._local = future, local

    def result(self) -> ModelRunnerOutput:
        return dataclasses.replace(self._future.result(), encoder_cache=self._local.encoder_cache)


class StageQueue:
    def __init__(self, control: StageControl, worker: Any, explain: Callable[[BaseException], BaseException]):
        self._control, self._worker, self._explain = control, worker, explain
        self._sends: queue.SimpleQueue = queue.SimpleQueue()  # commands for stages 1.., oldest first
        self._expected: queue.SimpleQueue = queue.SimpleQueue()  # futures awaiting their output, oldest first
        self._lock = threading.Condition()
        self._inflight = 0  # submitted, output not yet in
        self.peak = 0  # the most micro-batches that were in flight at once
        self._dead: BaseException | None = None
        self._current: Future | None = None  # the one the receiver waits for
        for name, target in (("vlm-pp-send", self._send_loop), ("vlm-pp-recv", self._recv_loop)):
            threading.Thread(target=target, name=name, daemon=True).start()

    def submit(self, command: Command) -> StagedOutput:
        """One micro-batch to every stage (module docstring); returns after stage 0's share."""
        future: Future = Future()
        with self._lock:  # registered with the lock held: `fail` either sees it or this raises
            if self._dead is not None:
                raise self._dead
            self._inflight += 1
            self.peak = max(self.peak, self._inflight)
            self._expected.put(future)
        self._control.broadcast(0, command)  # stage 0's other tensor-parallel ranks compute beside us
        self._sends.put(command)
        local = call(self._worker, command.method, command.args)
        return StagedOutput(future, local)

    def idle(self) -> bool:
        """No micro-batch in flight: the stage groups are free for other commands."""
        with self._lock:
            return self._inflight == 0

    def drain(self) -> None:
        """Wait until every micro-batch submitted has its output (or the pipeline failed: raised)."""
        with self._lock:
            self._lock.wait_for(lambda: self._inflight == 0 or self._dead is not None)
            if self._dead is not None:
                raise self._dead

    def fail(self, error: BaseException) -> None:
        """The engine is dead (a rank ended): every micro-batch in flight, and every later one, fails with `error`."""
        with self._lock:
            if self._dead is None:
                self._dead = error
            if self._current is not None and not self._current.done():
                self._current.set_exception(self._dead)
            while True:  # the futures not yet taken by the receiver
                try:
                    future = self._expected.get_nowait()
                except queue.Empty:
                    break
                if future is not None and not future.done():
                    future.set_exception(self._dead)
            self._expected.put(None)  # the receiver, waiting for a future, ends
            self._lock.notify_all()
        self._sends.put(None)

    # -- the threads ------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        stages = range(1, len(self._control.stages))
        while (command := self._sends.get()) is not None:
            try:
                for s in stages:
                    self._control.broadcast(s, command)
            except BaseException as e:  # noqa: BLE001 - a stage is gone: every micro-batch in flight fails
                self.fail(self._explain(e))
                return

    def _recv_loop(self) -> None:
        while (future := self._expected.get()) is not None:
            with self._lock:
                if future.done():  # failed meanwhile
                    return
                self._current = future
            try:
                output = self._control.recv_output()
            except BaseException as e:  # noqa: BLE001 - a stage is gone: `fail` fails this future too
                self.fail(self._explain(e))
                return
            with self._lock:
                self._current = None
                if future.done():
                    return
                future.set_result(output)
                self._inflight -= 1
                self._lock.notify_all()
