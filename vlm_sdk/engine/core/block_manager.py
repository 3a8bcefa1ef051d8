"""Which KV blocks each sequence holds, with prefix caching.

A sequence with `n` tokens in the cache holds `ceil(n / block_size)` blocks. Before a step that
computes `k` more tokens, the scheduler asks for the blocks that `n + k` tokens need:

    block_size = 4, n = 6, k = 3            blocks held: [7, 2]   (slots 0..7)
    tokens  0 1 2 3 | 4 5 . . | . . . .     need ceil(9 / 4) = 3 -> allocate 1 more: [7, 2, 5]
            block 7   block 2   block 5     token 8 goes to slot 5 * 4 + 0 = 20

A sequence that starts (or restarts after a preemption) first looks its full blocks up by hash
(`engine.block_hash`): the longest run of leading blocks already in the cache is shared, and its
`num_computed_tokens` starts after them. At least one token is always left to compute, since the
step that computes a sequence's last token is the one that samples:

    prompt of 11 tokens, block_size 4: blocks 0, 1 full (hashes h0, h1), block 2 partial
    cache holds h0 -> block 9, h1 -> block 3       start: block_ids [9, 3], computed = 8, compute 3
    prompt of 8 tokens, same two blocks cached     only block 0 is reused: the last token is computed

Blocks are offered to the cache as soon as a step is scheduled to fill them (`_commit`): a
sequence admitted later in the same step may share them, since every layer stores the whole step's
K/V before any attention reads it. Free blocks keep their content until a fresh block is needed
(`engine.block_pool`), so `num_free_blocks` counts them: cached or not, they are free.
"""
from __future__ import annotations

from vlm_sdk.engine.core.block_hash import extend_block_hashes
from vlm_sdk.engine.core.block_pool import BlockPool
from vlm_sdk.engine.core.sequence import Sequence
from vlm_sdk.protocol.blocks import blocks_needed, slot_mapping


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.hit_tokens = 0  # prompt tokens found in the prefix cache, since start-up
        self.query_tokens = 0  # tokens looked up (each start and restart of a sequence)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold reusable content (evicted when a fresh block is needed)."""
        return self.pool.num_cached_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_needed(num_tokens, self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_ids))

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give `seq` the blocks its next `num_new_tokens` need; False (and nothing taken) if too few free."""
        total, size = seq.num_computed_tokens + num_new_tokens, self.block_size
        need = -(-total // size) - len(seq.block_ids)
        if need > 0:
            if need > self.pool.num_free:
                return False
            seq.block_ids.extend(self.pool.take(need))
        if self.enable_prefix_caching and total // size > seq.num_cached_blocks:  # a block filled up
            self._commit(seq, total)
        return True

    def start(self, seq: Sequence, budget: int) -> int | None:
        """Start (or restart) `seq`, which holds no blocks: share its cached prefix, then allocate for
        up to `budget` more tokens. The number of tokens to compute this step; None (nothing taken)
        when the free blocks are too few."""
        hits = self._cached_prefix(seq)
        computed = len(hits) * self.block_size
        n = min(seq.num_tokens - computed, budget)
        need = self.blocks_for(computed + n) - len(hits)
        revived = sum(1 for b in hits if self.pool.ref_count[b] == 0)  # free now: taking them uses free room
        if need + revived > self.pool.num_free:
            return None
        self.pool.touch(hits)
        seq.block_ids = hits + self.pool.take(need)
        seq.num_computed_tokens = computed
        seq.num_cached_blocks = len(hits)
        if self.enable_prefix_caching:
            self.query_tokens += seq.num_tokens
            self.hit_tokens += computed
        if seq.num_preemptions == 0:
            seq.metrics.cached_tokens = computed
        self._commit(seq, computed + n)
        return n

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The blocks holding `seq`'s longest cached run of leading full blocks, leaving its last token; none
        for a request that asks for its prompt's logprobs (every prompt position must be computed)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        extend_block_hashes(seq.block_hashes, seq.token_ids, seq.image_spans, self.block_size,
                            limit * self.block_size, seq.hash_seed)
        hits = []
        for h in seq.block_hashes[:limit]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def _commit(self, seq: Sequence, num_tokens: int) -> None:
        """Offer the blocks that the first `num_tokens` tokens fill to the cache."""
        if not self.enable_prefix_caching:
            return
        # a token still on the device (asynchronous scheduling) cannot be hashed yet: its block is
        # offered by a later step, once the token has arrived
        full = min(num_tokens, seq.num_tokens) // self.block_size
        if full <= seq.num_cached_blocks:
            return
        extend_block_hashes(seq.block_hashes, seq.token_ids, seq.image_spans, self.block_size, full * self.block_size,
                            seq.hash_seed)
        hashed = min(full, len(seq.block_hashes))  # fewer when an image without a key stops the chain
        for i in range(seq.num_cached_blocks, hashed):
            self.pool.cache(seq.block_ids[i], seq.block_hashes[i])
        seq.num_cached_blocks = max(seq.num_cached_blocks, hashed)

    def free(self, seq: Sequence) -> None:
        self.pool.release(reversed(seq.block_ids))  # the prefix stays cached longest
        seq.block_ids = []
        seq.num_cached_blocks = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return slot_mapping(seq.block_ids, self.block_size, position, position + 1)[0]
