"""The same cache settings under each kv_cache_dtype, side by side: what `vlm-sdk plan` and the start-up
report show so that a user short of KV capacity sees what fp8, int8 and int4 would give on this device.

Each row is the engine's own sizing (`kv.size_cache`) with the page of that dtype (`AttentionSpec.page_bytes`:
int8 / int4 count their scales and zeros) on the same budget: bytes per token, blocks, the longest
sequence they hold, and how many requests of max_model_len tokens they hold at once. A cache sized by
num_blocks keeps its block count under every dtype (only the bytes change).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vlm_sdk.config import EngineArgs
from vlm_sdk.memory.capacity import requests_at_once
from vlm_sdk.memory.kv import LOWER_KV_DTYPES, CacheConfig, DeviceBudget, size_cache
from vlm_sdk.protocol.cache_spec import AttentionSpec

KV_DTYPE_ORDER = ("auto", "fp8", "int8", "int4")


@dataclass(frozen=True)
class KvDtypeFit:
    kv_cache_dtype: str  # "auto" (the model's dtype), "fp8", "int8", "int4"
    bytes_per_token: int
    num_blocks: int
    capacity_tokens: int  # the longest sequence the blocks hold
    requests: int  # requests of max_model_len tokens held at once (`capacity.requests_at_once`)
    current: bool  # the cache these settings give

    def text(self, max_model_len: int) -> str:
        return (f"{self.bytes_per_token:,} B/token, {max(self.num_blocks, 0):,} blocks: {self.capacity_tokens:,} "
                f"tokens, {self.requests:,} requests of {max_model_len:,} at once" + (" (this cache)" if self.current
                                                                                       else ""))


def kv_dtype_fits(args: EngineArgs, cache: CacheConfig, budget: DeviceBudget | None, page: AttentionSpec,
                  model_dtype: str, max_position_embeddings: int, max_model_len: int,
                  runs: tuple[str, ...] = tuple(LOWER_KV_DTYPES)) -> tuple[KvDtypeFit, ...]:
    """One row per kv_cache_dtype that runs here (`runs`: of fp8, int8, int4; "auto" always), for a cache
    `cache` of page `page` sized on `budget` (None: not a GPU's)."""
    here = page.page_bytes(cache.block_size)
    own = {"float8_e4m3fn": "fp8", "int8": "int8", "int4": "int4"}.get(page.dtype, "auto")
    rows = []
    for name in KV_DTYPE_ORDER:
        if name != own and ((name != "auto" and name not in runs) or (name == "int4" and page.head_dim % 2)):
            continue
        dtype = model_dtype if name == "auto" else LOWER_KV_DTYPES[name]
        per_block = cache.bytes_per_block // here * dataclasses.replace(page, dtype=dtype).page_bytes(cache.block_size)
        c = cache if name == own else size_cache(args, per_block, max_position_embeddings, budget, None, cache.layout)
        sized = dataclasses.replace(c, num_blocks=max(c.num_blocks, 0))
        rows.append(KvDtypeFit(name, per_block // cache.block_size, c.num_blocks, sized.capacity_tokens,
                               requests_at_once(sized, max_model_len, args.max_num_seqs), name == own))
    return tuple(rows)


def kv_dtype_rows(fits: tuple[KvDtypeFit, ...], max_model_len: int) -> list[tuple[str, str]]:
    """The report's rows: a heading and one indented row per dtype."""
    if len(fits) < 2:
        return []
    return [("KV by kv_cache_dtype", "the same settings and device with each")] + [
        (f"  {f.kv_cache_dtype}", f.text(max_model_len)) for f in fits]
