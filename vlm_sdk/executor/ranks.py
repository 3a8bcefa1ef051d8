"""What every tensor-parallel rank runs: joining the process groups, and the command loop of ranks > 0.

Two process groups join the ranks (both over `init_method`):

    tensor group   NCCL on CUDA (one GPU per rank), gloo on the CPU: the layers' all-reduces and the
                   logits' all-gather; a peer that does not answer within `distributed_timeout` fails
                   the collective
    control group  gloo, over the CPU: rank 0 broadcasts each command, plain data only
                   (`Command(method, args, reply)`), and gathers replies when the command wants them.
                   Same timeout: a hung rank fails rank 0's next command; an idle rank 0 sends
                   heartbeats (NOOP) so that its ranks, waiting here, do not time out.

Under pipeline parallelism the control group is a `StageControl` (executor/stage_control.py): each stage
receives its commands on a group of its own with rank 0, so a stage still computing one micro-batch never
holds up the next command to the stages before it; replies to other commands are gathered on the group
of every rank, and a micro-batch's output comes back from the last stage's rank 0 alone, point to point.

A rank > 0 runs `serve_commands`: receive a command, call `Worker.<method>(*args)`, reply if asked,
until `shutdown`. Any exception ends the rank's process (after logging it and, when rank 0 spawned
it, reporting it on the error queue): its peers' next collective then fails at once ("connection
closed") instead of waiting, and rank 0 names the rank and its error.
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vlm_sdk.config import ParallelConfig
from vlm_sdk.executor.stage_control import StageControl, stage_control
from vlm_sdk.layers.parallel_state import ParallelGroups, PPGroup, TPGroup, init_tp_group

logger = logging.getLogger("vlm_sdk")

SHUTDOWN = "shutdown"
NOOP = "noop"  # rank 0's heartbeat while idle (executor/group.py)
LOCALHOST = "127.0.0.1"


@dataclass(frozen=True)
class Command:
    method: Any  # a `Worker` method's name, a picklable fn(worker, *args), or SHUTDOWN / NOOP
    args: tuple = ()
    reply: bool = True  # gather every rank's result to rank 0
    # pipeline parallelism: a micro-batch whose output only the last stage's rank 0 sends back (on
    # `StageControl.output`); nobody gathers (executor/stage_queue.py)
    output: bool = False


def call(worker, method, args: tuple) -> Any:
    """One rank's share of a command: `Worker.<method>(*args)`, or `method(worker, *args)`."""
    return method(worker, *args) if callable(method) else getattr(worker, method)(*args)


@dataclass(frozen=True)
class RankFailure:
    """A rank's error, as reported on the error queue (the exception object may not pickle)."""
    rank: int
    error_type: str
    message: str
    traceback: str
    pid: int | None = None
    node: str | None = None
    stage: int | None = None  # its pipeline stage (None without pipeline parallelism)
    tp_rank: int | None = None

    def describe(self) -> str:
        if self.stage is None:
            return f"tensor-parallel rank {self.rank} failed: {self.error_type}: {self.message}"
        return (f"{describe_rank(self.rank, self.stage, self.tp_rank, self.pid, self.node)} failed: "
                f"{self.error_type}: {self.message}")


def describe_rank(rank: int, stage: int, tp_rank: int, pid: int | None, node: str | None) -> str:
    """A rank under pipeline parallelism, in words: its stage, its place in it, its process and node."""
    return f"pipeline stage {stage} (tensor-parallel rank {tp_rank}, rank {rank}, pid {pid} on node {node})"


def join_ranks(rank: int, parallel: ParallelConfig, init_method: str | None, timeout_s: float,
               device: torch.device, store: Any = None) -> tuple[ParallelGroups, Any]:
    """Join the groups of the layout `parallel` as global `rank` (stage-major: stage * tp + tp_rank) and
    return this rank's `ParallelGroups` and the control group, at `init_method` or through `store`.
    Under pipeline parallelism the world holds every stage's ranks; each stage's tensor group is a
    subgroup of it (every rank creates every stage's, in the same order, as torch requires), and
    cross-stage tensors go point to point on the world group."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    world = init_tp_group(rank, parallel.world_size, init_method, timeout_s, device, store)
    if pp_size == 1:
        tp, pp = world, PPGroup()
    else:
        stage, tp_rank = divmod(rank, tp_size)
        tp = TPGroup()
        backend = "nccl" if device.type == "cuda" else "gloo"
        for s in range(pp_size):
            group = dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)), backend=backend,
                                   timeout=timedelta(seconds=timeout_s)) if tp_size > 1 else None
            if s == stage and tp_size > 1:
                tp = TPGroup(tp_rank, tp_size, group)
        pp = PPGroup(stage, pp_size, world.group, parallel.pp_layer_partition,
                     prev=rank - tp_size if stage > 0 else None, next=rank + tp_size if stage < pp_size - 1 else None)
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    if pp_size > 1:
        control = stage_control(rank, parallel, control, timeout_s)
    return ParallelGroups(tp, pp, parallel.enable_expert_parallel), control


def broadcast_command(command: Command, control) -> None:
    """Rank 0: send `command` to every other rank."""
    dist.broadcast_object_list([command], src=0, group=control)


def gather_replies(result: Any, size: int, control) -> list[Any]:
    """Rank 0: every rank's reply to the last command, in rank order (rank 0's is `result`)."""
    out: list[Any] = [None] * size
    dist.gather_object(result, out, dst=0, group=control)
    return out


def serve_commands(worker, control) -> None:
    """Rank > 0: run rank 0's commands on `worker` until SHUTDOWN."""
    staged = isinstance(control, StageControl)
    source = control.commands if staged else control  # where this rank's commands arrive
    replies = control.everyone if staged else control
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=source)
        command: Command = box[0]
        if command.method == SHUTDOWN:
            return
        if command.method == NOOP:
            continue
        result = call(worker, command.method, command.args)
        if command.output:
            if control.sends_output:
                control.send_output(result)
        elif command.reply:
            dist.gather_object(result, None, dst=0, group=replies)


def run_rank(model_dir: str, config, rank: int, size: int, init_method: str | None, device: torch.device,
             errors=None, store_port: int | None = None, store_host: str = LOCALHOST) -> None:
    """A rank > 0 from start to end: join (at `init_method`, or at rank 0's store on `store_host`:
    `store_port`), load its slice, serve commands. On any error: log it, report a `RankFailure` (under
    the store key `failed/<rank>`, and on `errors` when given) and end the process at once."""
    from vlm_sdk.worker.worker import Worker  # the model stack is imported in the rank's own process
    store = None
    try:
        if store_port is not None:
            store = dist.TCPStore(store_host, store_port, size, is_master=False,
                                  timeout=timedelta(seconds=config.args.distributed_timeout))
            store.set(f"started/{rank}", "1")  # rank 0 waits for these while watching the ranks
        groups, control = join_ranks(rank, config.parallel, init_method, config.args.distributed_timeout, device, store)
        worker = Worker(model_dir, config, device, groups)
        if store is not None:
            store.set(f"loaded/{rank}", "1")
        serve_commands(worker, control)
    except BaseException as e:  # noqa: BLE001 - every failure must reach rank 0 and end this rank
        stage, tp_rank = divmod(rank, config.parallel.tensor_parallel_size)
        staged = config.parallel.pipeline_parallel_size > 1
        failure = RankFailure(rank, type(e).__name__, str(e), traceback.format_exc(), os.getpid(), socket.gethostname(),
                              stage if staged else None, tp_rank if staged else None)
        logger.error("%s\n%s", failure.describe(), failure.traceback)
        _report(failure, store, errors)
        os._exit(1)
    leave_group()


def failure_key(rank: int) -> str:
    """The store key under which rank `rank` reports its `RankFailure` (pickled) to rank 0."""
    return f"failed/{rank}"


def _report(failure: RankFailure, store, errors) -> None:
    """`failure` to rank 0: on the store (any executor that hosts one reads `failure_key(rank)`), and on
    the error queue when rank 0 spawned this process."""
    if store is not None:
        try:
            store.set(failure_key(failure.rank), pickle.dumps(failure))
        except Exception:  # noqa: BLE001 - rank 0 is gone or the store broke: the rank's end still tells
            pass
    if errors is not None:
        errors.put(failure)
        errors.close()
        errors.join_thread()  # flushed before the process ends


def leave_group() -> None:
    """Leave the process group (nothing to do when it went with a peer)."""
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the group may already be gone with a peer
        pass


def spawned_rank_main(model_dir: str, config, rank: int, size: int, store_port: int, device_index: int | None,
                      errors, parent_pid: int, cpu_threads: int) -> None:
    """Entry of a rank process spawned by rank 0 (`MultiprocExecutor`), which hosts the store.
    `cpu_threads`: this rank's share of the cores (CPU ranks split them instead of each taking all)."""
    logging.basicConfig(level=logging.INFO, format=f"[vlm-sdk rank {rank}] %(levelname)s %(message)s")
    _exit_with_parent(parent_pid)
    torch.set_num_threads(cpu_threads)
    device = torch.device("cpu") if device_index is None else torch.device("cuda", device_index)
    run_rank(model_dir, config, rank, size, None, device, errors, store_port)


def _exit_with_parent(parent_pid: int) -> None:
    """End this process when rank 0's process is gone (killed without a chance to shut us down):
    no orphaned rank keeps a GPU."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, name="vlm-parent-watch", daemon=True).start()
