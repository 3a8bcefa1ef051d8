"""Tensor parallelism on Ray (`distributed_executor_backend="ray"`): rank 0 in this process, ranks
1..N-1 as Ray actors placed by a placement group (ray_placement.py), on one node or several; the same
rank main loop (ranks.run_rank), commands and fault handling as the spawned processes of multiproc.py.

    start-up   rank 0 opens a TCPStore on a free port, reachable at this node's IP as Ray sees it
               (ray.util.get_node_ip_address: the master address the other nodes dial); one actor per
               rank, in its bundle (on CUDA it holds one GPU, so Ray sets its CUDA_VISIBLE_DEVICES), runs
               `run_rank` as one long call that connects to the store, joins the groups, loads its
               slice and serves commands until SHUTDOWN. Rank 0 watches those calls while it waits for
               every rank to start and load (an actor that dies fails start-up at once)
    failure    a rank that raises logs its traceback, writes its `RankFailure` to the store
               (`failed/<rank>`) and ends its process; an actor killed (ray.kill, its node lost, out of
               memory) ends its call with a RayActorError. Either way rank 0's next collective fails
               ("connection closed" on gloo; NCCL after distributed_timeout) and is raised as
               EngineDeadError naming the rank; a watcher thread waiting on the calls sees the end at
               once and calls the failure callback, so an idle engine's open requests fail too
    shutdown   SHUTDOWN to every rank and a wait for their calls; then every actor is killed, the
               placement group this executor made removed, and Ray left when this executor joined it.
               Actors are owned by this process: Ray ends them when it dies (SIGKILL included)
"""
from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from vlm_sdk.executor.group import StartedRanksExecutor
from vlm_sdk.executor.ranks import failure_key, join_ranks, leave_group, run_rank
from vlm_sdk.executor.ray_placement import join_cluster, place_ranks, require_ray
from vlm_sdk.worker.worker import Worker

logger = logging.getLogger("vlm_sdk")

_JOIN_SECONDS = 10.0  # the ranks' time to return after SHUTDOWN before their actors are killed
_START_SECONDS = 300.0  # an actor's time to start (a worker process importing torch) and connect
_LOAD_SECONDS = 3600.0  # the longest a rank may take to load its slice (or distributed_timeout if longer)


class RankActor:
    """One rank > 0 in a Ray actor (`ray.remote(RankActor)`)."""

    def where(self) -> tuple[int, str]:
        """(process id, node IP): how errors and tests name this rank."""
        import ray
        return os.getpid(), ray.util.get_node_ip_address()

    def run(self, model_dir: str, config, rank: int, size: int, host: str, port: int, on_cuda: bool,
            cpu_threads: int) -> None:
        """The rank's whole life: returns after SHUTDOWN; any error ends the actor's process."""
        logging.basicConfig(level=logging.INFO, format=f"[vlm-sdk rank {rank}] %(levelname)s %(message)s")
        torch.set_num_threads(cpu_threads)
        device = torch.device("cuda", 0) if on_cuda else torch.device("cpu")  # Ray made its GPU the only one
        run_rank(model_dir, config, rank, size, None, device, store_port=port, store_host=host)


class RayExecutor(StartedRanksExecutor):
    def __init__(self, model_dir: str, config, device: torch.device):
        require_ray()
        import ray
        size = config.parallel.world_size
        on_cuda = device.type == "cuda"
        self._init_group_state()
        self._init_failures()
        self._timeout_s, self.world_size = config.args.distributed_timeout, size
        self._control, self._store, self._actors, self._runs, self._where = None, None, [], [], {}
        self._joined = join_cluster()
        self._placement = None
        self._threads = torch.get_num_threads()
        try:
            self._placement = place_ranks(size, on_cuda, config.args.ray_placement_strategy)
            if on_cuda and self._placement.owned:
                device = torch.device("cuda", self._placement.rank0_gpu())
                logger.info("tensor parallel on Ray: rank 0 on %s, the GPU Ray gave it", device)
            host = ray.util.get_node_ip_address()
            self._store = dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=config.args.distributed_timeout))
            threads = 1 if on_cuda else max(1, int(self._placement.resources[0].get("CPU", 1)))
            if not on_cuda:
                torch.set_num_threads(threads)  # rank 0 takes a rank's share of the cores as the actors do
            self._start_actors(model_dir, config, host, threads, on_cuda)
            self._wait_for(self._store, "started", size, max(config.args.distributed_timeout, _START_SECONDS))
            groups, self._control = join_ranks(0, config.parallel, None, config.args.distributed_timeout, device,
                                               self._store)
            self._worker = Worker(model_dir, config, device, groups)
            self._wait_for(self._store, "loaded", size, max(config.args.distributed_timeout, _LOAD_SECONDS))
        except BaseException as e:
            self._raise_start_failure(e, self._release)
        threading.Thread(target=self._watch, name="vlm-tp-ray-watch", daemon=True).start()
        self._start_heartbeat()

    def _start_actors(self, model_dir: str, config, host: str, threads: int, on_cuda: bool) -> None:
        import ray
        remote = ray.remote(RankActor)
        for rank in range(1, self.world_size):
            actor = remote.options(**self._placement.rank_options(rank, on_cuda)).remote()
            self._actors.append(actor)
            self._where[rank] = actor.where.remote()  # an actor runs its calls in order: this one first
            self._runs.append(actor.run.remote(model_dir, config, rank, self.world_size, host, self._store.port,
                                               on_cuda, threads))

    def rank_processes(self) -> dict[int, tuple[int, str]]:
        """Rank r > 0's (process id, node IP), once its actor has started."""
        import ray
        return {rank: ray.get(ref) for rank, ref in self._where.items()}

    def shutdown(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if self._control is not None and not self._ended_ranks() and self._send_shutdown():
            import ray
            ray.wait(self._runs, num_returns=len(self._runs), timeout=_JOIN_SECONDS)
        self._release()

    # -- failures ----------------------------------------------------------------------------------
    def _collect(self, wait_s: float) -> None:
        """Move the failures ranks wrote to the store into `_failures`, waiting up to `wait_s` for the first."""
        if self._store is None:  # no rank was started
            return
        deadline = time.monotonic() + wait_s
        while True:
            for rank in range(1, self.world_size):
                key = failure_key(rank)
                try:
                    if rank in self._failures or not self._store.check([key]):
                        continue
                    failure = pickle.loads(self._store.get(key))
                except Exception:  # noqa: BLE001 - the store itself failed: the ranks' ends say the rest
                    return
                with self._lock:
                    self._failures.setdefault(rank, failure)
            if self._failures or time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _ended_ranks(self) -> list[str]:
        import ray
        if not self._runs:
            return []
        ready, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        ended = []
        for rank, run in enumerate(self._runs, start=1):
            if run in ready:
                ended.append(f"tensor-parallel rank {rank} ({self._describe(rank)}) {self._how_it_ended(run)}")
        return ended

    def _describe(self, rank: int) -> str:
        import ray
        ready, _ = ray.wait([self._where[rank]], timeout=0)
        pid = node = None
        try:
            if ready:
                pid, node = ray.get(ready[0])
        except Exception:  # noqa: BLE001 - the actor died before it said where it runs
            pass
        return f"Ray actor, pid {pid} on node {node}" if pid is not None else "Ray actor, not started"

    @staticmethod
    def _how_it_ended(run) -> str:
        import ray
        try:
            ray.get(run, timeout=0)
        except ray.exceptions.RayActorError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return f"died: {first[:300]}"
        except Exception as e:  # noqa: BLE001 - any other end of its call
            return f"ended: {type(e).__name__}: {str(e)[:300]}"
        return "left"

    def _watch(self) -> None:
        import ray
        try:
            ray.wait(self._runs, num_returns=1, timeout=None)
        except Exception:  # noqa: BLE001 - Ray was shut down under this thread
            return
        self._rank_ended()

    def _release(self) -> None:
        """Kill every actor, remove the placement group made here, leave the process group and Ray."""
        import ray
        self._closing = True  # the actors' ends are ours
        self._stopped.set()  # no more heartbeats
        for actor in self._actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self._placement is not None:
            self._placement.remove()
        torch.set_num_threads(self._threads)
        leave_group()
        if self._joined:
            ray.shutdown()
