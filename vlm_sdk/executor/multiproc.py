"""Tensor parallelism on one machine: rank 0 in this process, one spawned process per other rank.

    start-up   rank 0 opens a TCPStore on a free local port and spawns ranks 1..N-1 (torch.multiprocessing,
               "spawn"); each connects and marks itself started, while rank 0 watches their processes
               (a rank that dies before joining fails start-up at once, not after a rendezvous timeout);
               then every rank joins the groups (ranks.join_ranks), loads its slice and marks itself
               loaded; the first command waits for the slowest load (up to an hour, or
               distributed_timeout if longer), so ranks loading at different speeds never meet the
               collective timeout
    steps      collective_rpc (group.py): broadcast the command, run it here, gather replies (not for
               `execute`); heartbeats while idle
    failure    a rank that raises logs its traceback, reports a `RankFailure` on the error queue and
               exits; rank 0's next collective fails ("connection closed" on gloo; NCCL after
               distributed_timeout), and is raised as EngineDeadError naming the rank and its error. A
               watcher thread sees a rank's process end at once and calls the failure callback, so an
               idle engine and its open requests learn of it too.
    shutdown   SHUTDOWN to every rank and a join; ranks still alive after that are terminated, then
               killed. Rank processes also end themselves when this process disappears.
"""
from __future__ import annotations

import logging
import multiprocessing.connection
import os
import queue
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vlm_sdk.errors import EngineDeadError
from vlm_sdk.executor.executor import FailureCallback
from vlm_sdk.executor.group import GroupExecutor
from vlm_sdk.executor.ranks import LOCALHOST, RankFailure, join_ranks, spawned_rank_main
from vlm_sdk.worker.worker import Worker

logger = logging.getLogger("vlm_sdk")

_JOIN_SECONDS = 10.0  # a rank's time to leave after SHUTDOWN before it is terminated
_REPORT_SECONDS = 3.0  # how long a failed collective waits for the failed rank's report
_LOAD_SECONDS = 3600.0  # the longest a rank may take to load its slice (or distributed_timeout if longer)
# the longest a spawned rank may take to start (a fresh interpreter importing torch: seconds, more on a busy
# machine; distributed_timeout if longer). A rank that dies meanwhile is seen at once by its process.
_START_SECONDS = 120.0


@contextmanager
def _caller_script_hidden():
    """Spawned processes re-run the caller's `__main__` script unless it hides behind `if __name__ ==
    "__main__":`; a rank needs nothing from it (its target and arguments are vlm_sdk's), so while the
    ranks start, `__main__` does not say where it came from and a plain script works too."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__spec__ = None
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


class MultiprocExecutor(GroupExecutor):
    def __init__(self, model_dir: str, config, devices: list[torch.device]):
        """`devices[r]`: rank r's device (one GPU per rank on CUDA; the CPU for every rank otherwise)."""
        size = config.args.tensor_parallel_size
        ctx = mp.get_context("spawn")
        self._init_group_state()
        self._timeout_s = config.args.distributed_timeout
        self._errors = ctx.Queue()
        self._failures: dict[int, RankFailure] = {}
        self._lock = threading.Lock()  # guards _failures and _closing
        self._callback: FailureCallback | None = None
        self._closing = False
        self._control = None
        timeout = timedelta(seconds=config.args.distributed_timeout)
        store = dist.TCPStore(LOCALHOST, 0, size, is_master=True, wait_for_workers=False, timeout=timeout)
        # CPU ranks share this machine's cores: each takes its share (rank 0's is restored at shutdown)
        self._threads = torch.get_num_threads()
        threads = max(1, self._threads // size) if devices[0].type == "cpu" else self._threads
        torch.set_num_threads(threads)
        self._procs = []
        with _caller_script_hidden():
            for rank in range(1, size):
                index = devices[rank].index if devices[rank].type == "cuda" else None
                proc = ctx.Process(target=spawned_rank_main, name=f"vlm-tp-rank-{rank}", daemon=True,
                                   args=(model_dir, config, rank, size, store.port, index, self._errors, os.getpid(),
                                         threads))
                proc.start()
                self._procs.append(proc)
        try:
            self._wait_for(store, "started", size, max(config.args.distributed_timeout, _START_SECONDS))
            tp, self._control = join_ranks(0, size, None, config.args.distributed_timeout, devices[0], store)
            self._worker, self.world_size = Worker(model_dir, config, devices[0], tp), size
            # ranks finish loading at their own pace: the first command waits for the last of them
            self._wait_for(store, "loaded", size, max(config.args.distributed_timeout, _LOAD_SECONDS))
        except BaseException as e:
            err = self._explain(e)
            self._terminate()
            if err is e:
                raise
            raise err from e
        threading.Thread(target=self._watch, name="vlm-tp-watch", daemon=True).start()
        self._start_heartbeat()

    def set_failure_callback(self, callback: FailureCallback) -> None:
        self._callback = callback
        if self._dead is not None:
            callback(self._dead)

    def shutdown(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
        graceful = self._control is not None and all(p.is_alive() for p in self._procs) and self._send_shutdown()
        self._terminate(graceful)

    # -- failures ----------------------------------------------------------------------------------
    def _wait_for(self, store, stage: str, size: int, timeout_s: float) -> None:
        """Until every rank > 0 set the store key `stage/r` ("started", "loaded"), watching their processes."""
        keys = [f"{stage}/{r}" for r in range(1, size)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            dead = [p for p in self._procs if not p.is_alive()]
            if dead:
                raise EngineDeadError(f"{dead[0].name} exited with code {dead[0].exitcode} before it {stage}")
            if time.monotonic() > deadline:
                late = [k.split("/")[1] for k in keys if not store.check([k])]
                raise EngineDeadError(f"tensor-parallel rank(s) {', '.join(late)} not {stage} after {timeout_s:g} s")
            time.sleep(0.05)

    def _collect(self, wait_s: float) -> None:
        """Move reported failures from the queue into `_failures`, waiting up to `wait_s` for the first."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                failure = self._errors.get(timeout=max(0.0, deadline - time.monotonic()))
            except (queue.Empty, OSError, ValueError):
                return
            with self._lock:
                self._failures.setdefault(failure.rank, failure)
            deadline = time.monotonic()  # take what is queued already, wait no longer

    def _explain(self, exc: BaseException) -> BaseException:
        """A failed call: an EngineDeadError naming the failed rank when one did (`exc` as its cause),
        else `exc` itself (rank 0's own error)."""
        if isinstance(exc, EngineDeadError) and "tensor-parallel rank" in str(exc):
            return exc
        ranks_dead = any(not p.is_alive() for p in self._procs)
        peer_error = isinstance(exc, (RuntimeError, dist.DistBackendError)) and not isinstance(exc, EngineDeadError)
        if not (ranks_dead or peer_error or self._failures):
            return exc
        self._collect(0.0 if self._failures else _REPORT_SECONDS if ranks_dead else 1.0)
        err = self._death_error(exc)
        self._dead = self._dead or err
        return self._dead

    def _death_error(self, exc: BaseException | None) -> EngineDeadError:
        with self._lock:
            failures = sorted(self._failures.values(), key=lambda f: f.rank)
        if failures:
            what = "; ".join(f.describe() for f in failures) + " (its traceback is in the log)"
        else:
            gone = [f"{p.name} exited with code {p.exitcode}" for p in self._procs if not p.is_alive()]
            what = "; ".join(gone) if gone else (
                f"a tensor-parallel collective failed while every rank process is alive: a rank is hung or the "
                f"link between ranks broke (distributed_timeout={self._timeout_s:g} s): {exc!r}")
        return EngineDeadError(f"{what}; every rank is needed for each step, so the engine stopped. "
                               f"Restart it (and see that rank's log for why it failed)")

    def _watch(self) -> None:
        """A rank process ended while nobody was shutting down: the engine is dead; say so at once."""
        multiprocessing.connection.wait([p.sentinel for p in self._procs])
        if self._closing:
            return
        self._collect(_REPORT_SECONDS)
        err = self._death_error(None)
        with self._lock:
            if self._closing:
                return
        self._dead = self._dead or err
        logger.error("%s", self._dead)
        if self._callback is not None:
            self._callback(self._dead)

    def _terminate(self, graceful: bool = False) -> None:
        """End every rank process: after SHUTDOWN (`graceful`) a join first, then terminate, then kill;
        and leave the process group."""
        deadline = time.monotonic() + (_JOIN_SECONDS if graceful else 0.0)
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        self._closing = True
        torch.set_num_threads(self._threads)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a failed group may refuse a clean exit
                pass
