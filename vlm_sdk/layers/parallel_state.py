"""This rank's parallel groups and their collectives, passed explicitly (no module-level state).

`ParallelGroups` is one rank's place in every dimension, the one value the executor hands the worker and
the worker hands the model's constructor: `tp` (a `TPGroup`, which every parallel layer takes), `pp`
(a `PPGroup`: this rank's pipeline stage, its layer range and its peers before and after) and expert parallelism (`ep`:
the group MoE layers spread whole experts over). The sizes come from `vlm_sdk.config.ParallelConfig`.

`TPGroup()` is the single-rank default: every layer then holds the whole tensor, and every collective
below returns its input untouched, so the unsharded code path runs exactly. The executor's ranks build
one per rank with the `torch.distributed` process group they share (NCCL on CUDA, gloo on the CPU).

A group of size > 1 with no process group (`group=None`) is what tests and the meta-device builds
(`ParallelGroups.first_rank`) use: its collectives are identities too.

Expert parallelism (EngineArgs.enable_expert_parallel) changes only the sparse MoE layers
(vlm_sdk/layers/moe.py): each rank of `ep` (the tensor-parallel ranks themselves) holds num_experts / size
whole experts instead of a 1 / size slice of every expert; attention and every other layer stay split as
without it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from vlm_sdk.config import ParallelConfig


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False, repr=False)  # a torch.distributed ProcessGroup

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of size {self.size}: need 0 <= rank < size")

    @property
    def communicates(self) -> bool:
        return self.size > 1 and self.group is not None

    def split(self, n: int, what: str) -> int:
        """`n / size`, the part of one rank; `ValueError` naming `what` when `n` does not divide."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {self.size}")
        return n // self.size

    def range(self, n: int) -> tuple[int, int]:
        """This rank's [start, stop) of `n` rows split in contiguous parts of ceil(n / size) (the last
        rank may get fewer): the vocab split, which need not divide."""
        per = -(-n // self.size)
        start = min(self.rank * per, n)
        return start, min(start + per, n)

    # -- collectives (identities without a process group) ------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place (every rank gets the sum); returns `x`."""
        if self.communicates:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' `x` (equal shapes) concatenated along `dim`, in rank order, on every rank."""
        if not self.communicates:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


@dataclass(frozen=True)
class PPGroup:
    """This rank's pipeline stage: `rank` of `size` stages. `partition`: each stage's decoder layer count
    (None: the even split, vlm_sdk/layers/pp_partition.py). `prev` / `next`: the global ranks this rank
    receives its stage's input from / sends its output to (the same tensor-parallel rank of the stage
    before / after; None at the ends or without a process group). Cross-stage tensors go point to point
    on the world group (vlm_sdk/worker/pp_transfer.py)."""
    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False, repr=False)
    partition: tuple[int, ...] | None = None
    prev: int | None = None
    next: int | None = None

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """This stage's [start, stop) of `num_layers` decoder layers (all of them with one stage)."""
        if self.size == 1:
            return 0, num_layers
        from vlm_sdk.pp_partition import layer_range
        return layer_range(num_layers, self.rank, self.size, self.partition)

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"pipeline stage {self.rank} of {self.size}: need 0 <= stage < size")

    @property
    def is_first(self) -> bool:  # holds the embeddings and the vision tower
        return self.rank == 0

    @property
    def is_last(self) -> bool:  # holds the LM head and samples
        return self.rank == self.size - 1


@dataclass(frozen=True)
class ParallelGroups:
    """One rank's groups in every parallel dimension (module docstring)."""
    tp: TPGroup = TPGroup()
    pp: PPGroup = PPGroup()
    expert_parallel: bool = False  # MoE layers spread whole experts over `ep`

    @property
    def ep(self) -> TPGroup:
        """The ranks MoE experts are spread over, whole experts each: the tensor-parallel group under
        expert parallelism, else one rank (every expert then split over `tp` by its width)."""
        return self.tp if self.expert_parallel and self.tp.size > 1 else TPGroup()

    @property
    def rank(self) -> int:
        """This rank's number among all ranks (stage-major)."""
        return self.pp.rank * self.tp.size + self.tp.rank

    @property
    def world_size(self) -> int:
        return self.tp.size * self.pp.size

    @classmethod
    def first_rank(cls, parallel: ParallelConfig) -> "ParallelGroups":
        """Rank 0's groups under `parallel`, with no process group: what the planner and the split check
        build the model as, on the meta device."""
        return cls.of_stage(parallel, 0)

    @classmethod
    def of_stage(cls, parallel: ParallelConfig, stage: int) -> "ParallelGroups":
        """The groups of tensor-parallel rank 0 of pipeline stage `stage`, with no process group: what the
        planner builds each stage's model as, on the meta device."""
        return cls(TPGroup(0, parallel.tensor_parallel_size),
                   PPGroup(stage, parallel.pipeline_parallel_size, partition=parallel.pp_layer_partition),
                   parallel.enable_expert_parallel)


def init_tp_group(rank: int, size: int, init_method: str | None, timeout_s: float, device: torch.device,
                  store: Any = None) -> TPGroup:
    """Join the `size`-rank process group as `rank` (at `init_method`: "tcp://host:port", or "env://"
    under torchrun; or through an already connected `store`), and return its `TPGroup`. NCCL on CUDA,
    gloo on the CPU. A collective that waits longer than `timeout_s` for a peer raises (a dead or hung
    rank turns into an error)."""
    from datetime import timedelta
    if size == 1:
        return TPGroup()
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    where = {"store": store} if store is not None else {"init_method": init_method}
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s),
                            **where, **kwargs)
    return TPGroup(rank, size, dist.group.WORLD)
