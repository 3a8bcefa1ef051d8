"""The KV blocks of the cache (and the state slots, `StatePool`): who holds each one, and which free
ones still hold reusable content.

Every block has a reference count (the sequences holding it) and, once full and cached, a hash
(`engine.block_hash`) in one cache group's namespace: all attention groups share one pool of blocks,
and the same tokens hash to a different block in each group (a block belongs to one group at a time).
A block whose count drops to 0 is free but keeps its content and hash: a later prompt that starts the
same way takes it back (`touch`) instead of recomputing it. A fresh block (`take`) comes from the front
of the free queue, which is least recently used first; taking a cached block evicts its hash.

    free queue (front = evicted first)
      [blocks without content ...] [cached blocks, least recently freed ... most recently freed]

`release` puts blocks without a hash at the front (nothing to keep) and cached ones at the back. A
sequence releases its blocks last first, so a prefix outlives the tokens that followed it.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable


class BlockPool:
    def __init__(self, num_blocks: int, num_groups: int = 1):
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_group = [0] * num_blocks  # the group a block was last taken for (and caches its hash in)
        self.cached: list[dict[bytes, int]] = [{} for _ in range(num_groups)]  # per group: hash -> its block
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_cached_free = 0  # free blocks that still have a hash
        self.used = [0] * num_groups  # per group: blocks held by at least one sequence

    @property
    def num_free(self) -> int:
        """Blocks with no holder, cached or not: all can be taken by `take`."""
        return len(self._free)

    def take(self, n: int, group: int = 0) -> list[int]:
        """`n` fresh blocks for `group` (the caller checked `num_free`), each held once; cached content in
        them is evicted."""
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            h = self.block_hash[block]
            if h is not None:
                self.num_cached_free -= 1
                self.block_hash[block] = None
                del self.cached[self.block_group[block]][h]
            self.ref_count[block] = 1
            self.block_group[block] = group
            out.append(block)
        self.used[group] += n
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """Hold cached blocks once more (a prefix hit), taking free ones out of the free queue."""
        for block in blocks:
            if self.ref_count[block] == 0:
                del self._free[block]
                self.num_cached_free -= 1
                self.used[self.block_group[block]] += 1
            self.ref_count[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self._free[block] = None
                self.used[self.block_group[block]] -= 1
                if self.block_hash[block] is None:
                    self._free.move_to_end(block, last=False)
                else:
                    self.num_cached_free += 1

    def lookup(self, h: bytes, group: int = 0) -> int | None:
        return self.cached[group].get(h)

    def cache(self, block: int, h: bytes, group: int = 0) -> None:
        """Record that held `block` (taken for `group`) now holds the full content `h` (no-op if another
        block of the group already does)."""
        cached = self.cached[group]
        if self.block_hash[block] is None and h not in cached:
            self.block_hash[block] = h
            cached[h] = block

    def uncache(self, block: int) -> None:
        """Forget a free block's content (it moves to the front: the next `take` reuses it first)."""
        h = self.block_hash[block]
        if h is None or self.ref_count[block]:
            return
        del self.cached[self.block_group[block]][h]
        self.block_hash[block] = None
        self.num_cached_free -= 1
        self._free.move_to_end(block, last=False)


class StatePool(BlockPool):
    """The state slots of a model's state layers (`StateSpec`): slot s is row s of every state tensor.
    A running request holds one live slot; a checkpoint is a slot holding the state at a block boundary,
    released at once cached-free under that boundary's block hash (held by nobody, evicted least
    recently used first when a live slot is needed, like a cached-free block: checkpoints never cost
    admission). One namespace: the same checkpoint serves every state group."""

    def __init__(self, num_slots: int):
        super().__init__(num_slots, 1)
