"""Block arithmetic the engine's block manager and the workers' slot mapping share.

    block_size = 4, block ids [7, 2, 5]: token 8 goes to slot 5 * 4 + 0 = 20
"""
from __future__ import annotations


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


def slot_mapping(block_ids: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Flat cache slots of token positions start..end of a sequence holding `block_ids`."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
