"""Tensor-parallel group info, passed explicitly to every parallel layer (no module-level state).

`TPGroup()` is the single-rank default: every layer then holds the whole tensor and runs exactly the
unsharded code path. The next issue (tensor parallelism) creates one per rank with the process group.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of size {self.size}: need 0 <= rank < size")

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
