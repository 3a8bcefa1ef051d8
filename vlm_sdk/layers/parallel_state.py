"""Tensor-parallel group info and its collectives, passed explicitly to every parallel layer (no
module-level state).

`TPGroup()` is the single-rank default: every layer then holds the whole tensor, and every collective
below returns its input untouched, so the unsharded code path runs exactly. The worker builds one per
rank with the `torch.distributed` process group its ranks share (NCCL on CUDA, gloo on the CPU).

A group of size > 1 with no process group (`group=None`) is what tests use to compose ranks by hand
(summing partial outputs themselves): its collectives are identities too.

`expert_parallel` (EngineArgs.enable_expert_parallel) changes only the sparse MoE layers
(vlm_sdk/layers/moe.py): each rank holds num_experts / size whole experts instead of a 1 / size slice
of every expert; attention and every other layer stay split as without it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False, repr=False)  # a torch.distributed ProcessGroup
    expert_parallel: bool = False  # MoE layers: whole experts per rank (module docstring)

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
