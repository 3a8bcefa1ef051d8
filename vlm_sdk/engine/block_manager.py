"""The KV block pool: which blocks each sequence holds.

A sequence with `n` tokens in the cache holds `ceil(n / block_size)` blocks. Before a step that
computes `k` more tokens, the scheduler asks for the blocks that `n + k` tokens need:

    block_size = 4, n = 6, k = 3            blocks held: [7, 2]   (slots 0..7)
    tokens  0 1 2 3 | 4 5 . . | . . . .     need ceil(9 / 4) = 3 -> allocate 1 more: [7, 2, 5]
            block 7   block 2   block 5     token 8 goes to slot 5 * 4 + 0 = 20
"""
from __future__ import annotations

from collections import deque

from vlm_sdk.engine.sequence import Sequence
from vlm_sdk.worker.block_table import blocks_needed, slot_mapping


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.hit_tokens = 0  # prompt tokens found in the prefix cache, since start-up
        self.query_tokens = 0  # prompt tokens looked up

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold reusable content (evicted when a fresh block is needed)."""
        return 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_needed(num_tokens, self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_ids))

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give `seq` the blocks its next `num_new_tokens` need; False (and nothing taken) if too few free."""
        need = self.num_new_blocks(seq, num_new_tokens)
        if need > len(self._free):
            return False
        seq.block_ids.extend(self._free.popleft() for _ in range(need))
        return True

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_ids)
        seq.block_ids = []

    def slot(self, seq: Sequence, position: int) -> int:
        return slot_mapping(seq.block_ids, self.block_size, position, position + 1)[0]
