"""The KV blocks of the cache: who holds each one, and which free ones still hold reusable content.

Every block has a reference count (the sequences holding it) and, once full and cached, a hash
(`engine.block_hash`). A block whose count drops to 0 is free but keeps its content and hash: a
later prompt that starts the same way takes it back (`touch`) instead of recomputing it. A fresh
block (`take`) comes from the front of the free queue, which is least recently used first; taking
a cached block evicts its hash.

    free queue (front = evicted first)
      [blocks without content ...] [cached blocks, least recently freed ... most recently freed]

`release` puts blocks without a hash at the front (nothing to keep) and cached ones at the back. A
sequence releases its blocks last first, so a prefix outlives the tokens that followed it.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> the block holding that content
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_cached_free = 0  # free blocks that still have a hash

    @property
    def num_free(self) -> int:
        """Blocks with no holder, cached or not: all can be taken by `take`."""
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """`n` fresh blocks (the caller checked `num_free`), each held once; cached content in them is evicted."""
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            h = self.block_hash[block]
            if h is not None:
                self.num_cached_free -= 1
                self.block_hash[block] = None
                del self.cached[h]
            self.ref_count[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """Hold cached blocks once more (a prefix hit), taking free ones out of the free queue."""
        for block in blocks:
            if self.ref_count[block] == 0:
                del self._free[block]
                self.num_cached_free -= 1
            self.ref_count[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self._free[block] = None
                if self.block_hash[block] is None:
                    self._free.move_to_end(block, last=False)
                else:
                    self.num_cached_free += 1

    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h)

    def cache(self, block: int, h: bytes) -> None:
        """Record that held `block` now holds the full content `h` (no-op if another block already does)."""
        if self.block_hash[block] is None and h not in self.cached:
            self.block_hash[block] = h
            self.cached[h] = block
