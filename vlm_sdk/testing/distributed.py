"""Run a function on N CPU ranks over gloo: the tensor-parallel tests and the CPU benchmark.

    results = run_on_ranks(fn, 2, ckpt_path, timeout_s=300)   # [rank 0's fn(tp, ckpt_path), rank 1's]

Each rank is a process of torch.multiprocessing's spawn context (a fresh interpreter: no state
inherited from the caller, as the engine's workers will be), joined into one process group through
`init_tp_group` at a free TCP port on 127.0.0.1, with `torch.set_num_threads` set so that the ranks
share the machine's cores instead of oversubscribing them. `fn(tp, *args)` must be importable by the
children: a module-level function of an importable module (a test module, `vlm_sdk.testing`, ...).
Results come back through a queue as `torch.save` bytes (tensors included: no shared-memory handles
that would outlive their sender). The first rank to fail raises here with its traceback; a rank
that dies without a result, or ranks that run past `timeout_s`, raise too; every rank still running
is then killed (no orphans, no hung collectives).
"""
from __future__ import annotations

import io
import os
import queue as queue_module
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vlm_sdk.layers.parallel_state import TPGroup, init_tp_group

__all__ = ["run_on_ranks", "free_port"]

_DEATH_GRACE_S = 2.0  # a rank that exited may still have its result in the pipe: wait this long for it


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, init_method: str, results: Any,
               args: tuple, collective_timeout_s: float, threads: int) -> None:
    try:
        torch.set_num_threads(threads)
        tp = init_tp_group(rank, world_size, init_method, collective_timeout_s, torch.device("cpu"))
        try:
            out = fn(tp, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # reported to the caller, whatever it is
        results.put((rank, False, traceback.format_exc()))


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0,
                 collective_timeout_s: float = 120.0, threads_per_rank: int | None = None,
                 spawn_one: bool = False) -> list[Any]:
    """`fn(tp: TPGroup, *args)` on `world_size` spawned CPU ranks over gloo; their results in rank order.

    `timeout_s` bounds the whole run (spawn and imports included); `collective_timeout_s` is the
    process group's timeout, after which a collective waiting on a dead peer raises in the survivor.
    `threads_per_rank` defaults to the cores divided among the ranks (at least 1). Raises
    `RuntimeError` with the failing rank's traceback, or `TimeoutError` naming the ranks still running.
    With `world_size` 1, `fn` runs here with `TPGroup()`, unless `spawn_one` (a fresh process, as a
    benchmark's baseline wants)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if world_size == 1 and not spawn_one:
        return [fn(TPGroup(), *args)]
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_main, name=f"vlm-tp-rank-{rank}", daemon=True,
                         args=(fn, rank, world_size, init_method, results, args, collective_timeout_s, threads))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    exited_at: dict[int, float] = {}
    try:
        while len(done) < world_size:
            now = time.monotonic()
            if now > deadline:
                missing = [r for r in range(world_size) if r not in done]
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout_s} s")
            try:
                rank, ok, payload = results.get(timeout=min(0.2, deadline - now))
            except queue_module.Empty:
                for r, p in enumerate(procs):
                    if r in done or p.exitcode is None:
                        continue
                    if now - exited_at.setdefault(r, now) > _DEATH_GRACE_S:
                        raise RuntimeError(f"rank {r} of {world_size} exited with code {p.exitcode} "
                                           f"without a result")
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{payload}")
            done[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5.0 if len(done) == world_size else 0.0)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    return [done[r] for r in range(world_size)]
