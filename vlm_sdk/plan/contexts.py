"""What a model with sliding-window layers saves at a few context lengths (`vlm-sdk plan`): per request of
L tokens, the KV its window layers and its global layers hold, and how many such requests the cache holds
at once, beside what the same KV memory would hold were every layer full attention (a naive engine's
allocation). The arithmetic is the engine's (`CacheLayout.blocks_for_tokens`: a sliding group holds the
blocks of its window and of one prefill chunk, a full group every token's block).
"""
from __future__ import annotations

from dataclasses import dataclass

from vlm_sdk.protocol.blocks import blocks_needed
from vlm_sdk.protocol.cache_layout import CacheLayout

CONTEXT_LENGTHS = (8192, 32768, 131072)  # 8k, 32k, 128k


@dataclass(frozen=True)
class ContextFit:
    tokens: int  # one request's length
    requests: int  # requests of that length the cache's blocks hold at once
    window_kv_bytes: int  # the KV one such request holds in the sliding-window layers
    global_kv_bytes: int  # ... in the full-attention layers
    full_attention_requests: int  # what the same KV bytes hold with every layer full attention
    full_attention_kv_bytes: int  # one such request's KV then


def context_fits(layout: CacheLayout, num_blocks: int, block_size: int, chunk_tokens: int,
                 lengths: tuple[int, ...]) -> tuple[ContextFit, ...]:
    """One `ContextFit` per length; () for a model without a sliding-window layer (nothing is saved)."""
    groups = layout.attention_groups
    if all(g.spec.window is None for g in groups):
        return ()
    page = layout.page_spec.page_bytes(block_size)  # one layer's K and V of one block
    kv_bytes = max(num_blocks, 0) * layout.block_bytes(block_size)
    layers = sum(len(g.layers) for g in groups)
    out = []
    for n in lengths:
        window = full = 0
        for g in groups:
            blocks = CacheLayout.from_specs([g.spec]).blocks_for_tokens(n, block_size, chunk_tokens)
            if g.spec.window is None:
                full += blocks * len(g.layers) * page
            else:
                window += blocks * len(g.layers) * page
        naive = blocks_needed(n, block_size) * layers * page
        out.append(ContextFit(n, max(num_blocks, 0) // layout.blocks_for_tokens(n, block_size, chunk_tokens),
                              window, full, kv_bytes // naive, naive))
    return tuple(out)


def context_rows(fits: tuple[ContextFit, ...], size) -> list[tuple[str, str]]:
    """The report rows (`size`: bytes -> text)."""
    rows = []
    for f in fits:
        saved = f.full_attention_kv_bytes / max(f.window_kv_bytes + f.global_kv_bytes, 1)
        rows.append((f"requests of {f.tokens:,} tokens",
                     f"{f.requests:,} at once: {size(f.window_kv_bytes)} of KV each in the window layers (a "
                     f"window and a prefill chunk's keys) + "
                     f"{size(f.global_kv_bytes)} in the global layers; {f.full_attention_requests:,} with every "
                     f"layer full attention ({size(f.full_attention_kv_bytes)} each, {saved:.1f}x)"))
    return rows
