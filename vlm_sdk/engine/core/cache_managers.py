"""A manager per cache kind (vLLM v1's `single_type_kv_cache_manager.py`): what one cache group of a
sequence holds, which of it a prefix hit can serve, and what it may let go of. The coordinator
(`cache_coordinator.py`) runs them side by side over one block pool and one state pool.

Attention groups keep one list of block ids per sequence (`Sequence.block_ids[g]`), entry i holding
tokens i * block_size .. (i + 1) * block_size - 1. Every group's list has the same length (a block per
block_size tokens); a sliding-window group's entries before the window hold `NULL_BLOCK` once let go.

    full attention   every block, for the sequence's life. Prefix hit: the leading cached blocks.
    sliding window   window W: a query at position p reads keys p - W < q <= p. Before a step whose first
                     query is at c, blocks wholly before c - W + 1 are released (cached ones stay cached-
                     free: a later hit can revive them). A hit at L = k blocks needs only the
                     ceil((W - 1) / block_size) blocks before L:

        block_size 4, W 6: a hit at k = 5 blocks (L = 20) reads keys 15..19 -> blocks 3 and 4
        cached blocks      [ 9, -, 3, 7, 8 ]       (block 1 evicted)
        hit                [ NULL, NULL, NULL, 7, 8 ]   k = 5; full attention would stop at k = 1

    state            one live slot per running request (the coordinator's); a hit at L needs a checkpoint
                     exactly at L: the state after L tokens, kept cached-free under block L / bs - 1's hash.

No null block is reserved in the pool: a NULL entry is never read (the attention kernels read a sliding
layer's window only) and never sent as a page to write (slots are computed for new tokens only).
"""
from __future__ import annotations

from vlm_sdk.engine.core.block_pool import BlockPool, StatePool
from vlm_sdk.protocol.cache_spec import AttentionSpec

NULL_BLOCK = -1  # a sliding-window entry let go of (or never held: before a prefix hit's window)


class FullAttentionManager:
    kind = "full"

    def __init__(self, group: int, spec: AttentionSpec, pool: BlockPool, block_size: int):
        self.group, self.spec, self.pool, self.block_size = group, spec, pool, block_size

    def longest_hit(self, hashes: list[bytes], max_blocks: int) -> int:
        """The leading blocks this group has cached, at most `max_blocks` (any shorter hit holds too)."""
        lookup, group, n = self.pool.lookup, self.group, 0
        while n < max_blocks and lookup(hashes[n], group) is not None:
            n += 1
        return n

    def hit_blocks(self, hashes: list[bytes], num_blocks: int) -> list[int]:
        """The block ids of a hit of `num_blocks` blocks (`longest_hit` said it holds)."""
        return [self.pool.lookup(h, self.group) for h in hashes[:num_blocks]]

    def release_skipped(self, blocks: list[int], num_computed: int) -> None:
        """Full attention reads every key: nothing is ever skipped."""


class SlidingWindowManager(FullAttentionManager):
    kind = "sliding_window"

    def __init__(self, group: int, spec: AttentionSpec, pool: BlockPool, block_size: int):
        super().__init__(group, spec, pool, block_size)
        self.window = spec.window
        # blocks a query at a block boundary L reads before L: keys L - W + 1 .. L - 1
        self.window_blocks = -(-(self.window - 1) // block_size)

    def longest_hit(self, hashes: list[bytes], max_blocks: int) -> int:
        """The largest k <= max_blocks whose window_blocks blocks before it are cached (or, short of a
        window, every block from the first): scanned from the right, as vLLM's manager does."""
        lookup, group, need = self.pool.lookup, self.group, self.window_blocks
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            if lookup(hashes[i], group) is None:
                run = 0
                continue
            run += 1
            if run >= need:
                return i + run
        return run  # the blocks from the first on, fewer than a window: every key before them is cached

    def hit_blocks(self, hashes: list[bytes], num_blocks: int) -> list[int]:
        first = max(0, num_blocks - self.window_blocks)
        lookup = self.pool.lookup
        return [NULL_BLOCK] * first + [lookup(h, self.group) for h in hashes[first:num_blocks]]

    def release_skipped(self, blocks: list[int], num_computed: int) -> None:
        """Before a step whose first query is at `num_computed`: let go of the blocks wholly before its
        window (keys num_computed - W + 1 on), last first, and mark them NULL."""
        first_needed = (num_computed - self.window + 1) // self.block_size
        freed = []
        for i in range(first_needed - 1, -1, -1):
            if blocks[i] == NULL_BLOCK:  # the ones before it went in an earlier step
                break
            freed.append(blocks[i])
            blocks[i] = NULL_BLOCK
        if freed:
            self.pool.release(freed)


class StateManager:
    """Checkpoint lookups in the state pool (the coordinator takes and frees live slots)."""
    kind = "state"

    def __init__(self, pool: StatePool, block_size: int):
        self.pool, self.block_size = pool, block_size

    def longest_hit(self, hashes: list[bytes], max_blocks: int) -> int:
        """The largest k <= max_blocks with a checkpoint of the state after k blocks; 0 when none."""
        lookup = self.pool.lookup
        for k in range(max_blocks, 0, -1):
            if lookup(hashes[k - 1]) is not None:
                return k
        return 0

    def checkpoint(self, hashes: list[bytes], num_blocks: int) -> int:
        """The slot holding the state after `num_blocks` blocks (`longest_hit` said there is one)."""
        return self.pool.lookup(hashes[num_blocks - 1])


def attention_manager(group: int, spec: AttentionSpec, pool: BlockPool, block_size: int) -> FullAttentionManager:
    cls = FullAttentionManager if spec.window is None else SlidingWindowManager
    return cls(group, spec, pool, block_size)
