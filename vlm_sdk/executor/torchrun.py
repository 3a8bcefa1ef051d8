"""Tensor parallelism under torchrun (one or several machines): every process runs the same entry point
(`python -m vlm_sdk.serve ...`, a script making an `LLM`, ...) and torchrun's environment says which rank
it is (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

Rank 0 becomes the engine with a `TorchrunExecutor`; every other rank serves rank 0's commands inside
the engine's constructor and leaves the process (SystemExit(0)) when rank 0 shuts down, so the rest of
the entry point (an HTTP server, a script) runs on rank 0 only. A rank's failure ends its process;
torchrun then stops the others, and rank 0's failed collective says so.
"""
from __future__ import annotations

import os
import torch

from vlm_sdk.errors import EngineDeadError, InvalidRequestError
from vlm_sdk.executor.executor import Executor
from vlm_sdk.executor.group import GroupExecutor
from vlm_sdk.executor.ranks import join_ranks, leave_group, run_rank
from vlm_sdk.worker.worker import Worker


def torchrun_rank() -> tuple[int, int, int] | None:
    """(RANK, WORLD_SIZE, LOCAL_RANK) when this process was started by torchrun, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def run_torchrun_rank(model_dir: str, config, device: torch.device) -> Executor:
    """Rank 0: its executor. Ranks > 0: serve rank 0 until it shuts down, then leave the process."""
    rank, world, local = torchrun_rank()
    size = config.parallel.world_size
    if world != size:
        raise InvalidRequestError(f"torchrun started {world} processes but tensor_parallel_size={size}: every "
                                  f"process is one rank, so start {size} (--nnodes x --nproc-per-node) or set "
                                  f"--tensor-parallel-size {world}", param="tensor_parallel_size")
    if device.type == "cuda":
        device = torch.device("cuda", local)
    if rank != 0:
        run_rank(model_dir, config, rank, size, "env://", device)
        raise SystemExit(0)
    return TorchrunExecutor(model_dir, config, device)


class TorchrunExecutor(GroupExecutor):
    def __init__(self, model_dir: str, config, device: torch.device):
        self._init_group_state()
        self._timeout_s = config.args.distributed_timeout
        groups, self._control = join_ranks(0, config.parallel, "env://", config.args.distributed_timeout, device)
        self._worker, self.world_size = Worker(model_dir, config, device, groups), config.parallel.world_size
        self._output_rank = self.world_size - config.parallel.tensor_parallel_size  # the last stage's rank 0
        self._closed = False
        self._start_heartbeat()

    def _explain(self, exc: BaseException) -> BaseException:
        if not isinstance(exc, RuntimeError) or isinstance(exc, EngineDeadError):
            return exc
        self._dead = self._dead or EngineDeadError(
            f"a tensor-parallel collective failed ({exc}); a rank has failed or hung: its log (torchrun prints "
            f"each rank's) says why. Restart the job")
        return self._dead

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._send_shutdown()
        leave_group()
