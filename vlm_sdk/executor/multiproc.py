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
import socket
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vlm_sdk.executor.group import StartedRanksExecutor
from vlm_sdk.executor.ranks import LOCALHOST, describe_rank, join_ranks, leave_group, spawned_rank_main
from vlm_sdk.worker.worker import Worker

logger = logging.getLogger("vlm_sdk")

_JOIN_SECONDS = 10.0  # a rank's time to leave after SHUTDOWN before it is terminated
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


class MultiprocExecutor(StartedRanksExecutor):
    def __init__(self, model_dir: str, config, devices: list[torch.device]):
        """`devices[r]`: rank r's device (one GPU per rank on CUDA; the CPU for every rank otherwise)."""
        size = config.parallel.world_size
        self._output_rank = size - config.parallel.tensor_parallel_size  # the last stage's rank 0 samples
        self._tp_size, self._stages = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
        ctx = mp.get_context("spawn")
        self._init_group_state()
        self._timeout_s = config.args.distributed_timeout
        self._errors = ctx.Queue()
        self._init_failures()
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
            groups, self._control = join_ranks(0, config.parallel, None, config.args.distributed_timeout, devices[0],
                                               store)
            self._worker, self.world_size = Worker(model_dir, config, devices[0], groups), size
            # ranks finish loading at their own pace: the first command waits for the last of them
            self._wait_for(store, "loaded", size, max(config.args.distributed_timeout, _LOAD_SECONDS))
        except BaseException as e:
            self._raise_start_failure(e, self._terminate)
        threading.Thread(target=self._watch, name="vlm-tp-watch", daemon=True).start()
        self._start_heartbeat()

    def shutdown(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
        graceful = self._control is not None and all(p.is_alive() for p in self._procs) and self._send_shutdown()
        self._terminate(graceful)

    # -- failures ----------------------------------------------------------------------------------
    def _collect(self, wait_s: float) -> None:
        """Move reported failures from the queue into `_failures`, waiting up to `wait_s` for the first."""
        deadline = time.monotonic() + wait_s
        errors = self._errors
        while errors is not None:
            try:
                failure = errors.get(timeout=max(0.0, deadline - time.monotonic()))
            except (queue.Empty, OSError, ValueError):
                return
            with self._lock:
                self._failures.setdefault(failure.rank, failure)
            deadline = time.monotonic()  # take what is queued already, wait no longer

    def _ended_ranks(self) -> list[str]:
        if self._stages == 1:
            return [f"{p.name} exited with code {p.exitcode}" for p in self._procs if not p.is_alive()]
        node = socket.gethostname()
        return [f"{describe_rank(r, *divmod(r, self._tp_size), p.pid, node)} exited with code {p.exitcode}"
                for r, p in enumerate(self._procs, start=1) if not p.is_alive()]

    def _watch(self) -> None:
        multiprocessing.connection.wait([p.sentinel for p in self._procs])
        self._rank_ended()

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
        # the ranks are gone: the queue's last reference goes, and with it its semaphores, now rather than
        # by the resource tracker's "leaked semaphore objects" after `exit_now` skipped their finalisers
        self._errors = None
        torch.set_num_threads(self._threads)
        leave_group()
