"""What both tensor-parallel executors share: commands over the control group, one at a time, and a
heartbeat that keeps an idle engine's ranks from timing out.

Every control-group operation times out after `distributed_timeout` (a hung rank must fail the step,
not hang it), so ranks > 0 waiting for the next command would time out too when the engine is idle.
Rank 0 therefore sends a no-op command whenever no command went out for a quarter of the timeout.
Commands and heartbeats share one lock: the control group sees one command at a time, in order.
"""
from __future__ import annotations

import threading
import time
from typing import Any

from vlm_sdk.executor.executor import Executor, Method
from vlm_sdk.executor.ranks import NOOP, SHUTDOWN, Command, broadcast_command, call, gather_replies


class GroupExecutor(Executor):
    """Rank 0 of a process group; subclasses set `_worker` (rank 0's, in this process), `world_size`,
    `_control` and `_timeout_s`, then call
    `_start_heartbeat()`, and may refine `_explain` (the error a failed call raises)."""
    _control: Any
    _timeout_s: float

    def _init_group_state(self) -> None:
        self._rpc_lock = threading.Lock()
        self._last_command = time.monotonic()
        self._serving = False  # heartbeats start after the first command: every rank has loaded by then
        self._stopped = threading.Event()
        self._dead: BaseException | None = None
        self._broken = False  # a call failed part-way: the ranks may wait in different collectives

    def collective_rpc(self, method: Method, *args: Any) -> list[Any]:
        with self._rpc_lock:
            if self._dead is not None:
                raise self._dead
            reply = method != "execute"
            try:
                broadcast_command(Command(method, args, reply), self._control)
                result = call(self._worker, method, args)
                out = gather_replies(result, self.world_size, self._control) if reply else [result]
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
            if self._dead is not None or self._broken:
                return False
            broadcast_command(Command(SHUTDOWN), self._control)
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
                if self._dead is None and not self._stopped.is_set():
                    broadcast_command(Command(NOOP, reply=False), self._control)
                    self._last_command = time.monotonic()
            except BaseException as e:  # noqa: BLE001 - the next call reports it
                self._dead = self._explain(e)
            finally:
                self._rpc_lock.release()
