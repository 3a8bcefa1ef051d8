"""Engine start-up's memory decisions, from what the ranks report (plain data: vlm_sdk/protocol/):

    per rank:  breakdown(inputs, its profile) -> its budget (device total, in use) -> kv.size_cache
    engine:    the smallest cache any rank can hold (every rank allocates that many blocks),
               max_model_len (`capacity.resolve_max_model_len`), and the start-up report

The same consumers and rules as `vlm-sdk plan` (vlm_sdk/plan/), measured where the GPU profile measured.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from vlm_sdk.config import SchedulerConfig
from vlm_sdk.errors import InvalidRequestError, fixes_text
from vlm_sdk.memory.breakdown import Breakdown, breakdown
from vlm_sdk.memory.capacity import check_max_model_len_fits, requests_at_once, resolve_max_model_len
from vlm_sdk.memory.inputs import MemoryInputs
from vlm_sdk.memory.kv import CacheConfig, check_cache, lower_bytes_per_block, size_cache
from vlm_sdk.memory.kv_dtypes import kv_dtype_fits
from vlm_sdk.memory.report import RankMemory, StartupMemory, cache_groups
from vlm_sdk.protocol.rank import RankLoad
from vlm_sdk.sampling_params import DEFAULT_MAX_TOKENS

logger = logging.getLogger("vlm_sdk")


@dataclass(frozen=True)
class RankCache:
    """One rank's view: its consumers and the cache it could hold alone."""
    parts: Breakdown
    cache: CacheConfig


def lower_kv_runs(fp8_runs: bool, int_runs: bool) -> tuple[str, ...]:
    """The lower-precision kv_cache_dtypes that run, from whether FP8 and the int caches do."""
    return (("fp8",) if fp8_runs else ()) + (("int8", "int4") if int_runs else ())


def size_rank_caches(m: MemoryInputs, loads: list[RankLoad], profiles: list[dict[str, int] | None],
                     snapshots: list[tuple[int, int] | None], image_setting: str | None,
                     fp8_runs: bool = False, int_runs: bool = False) -> list[RankCache]:
    """Each rank's cache under the settings: on a GPU from its own device budget (its total and in-use
    bytes after loading, minus its consumers: measured where the profile measured). Raises
    `InvalidRequestError` naming the numbers and the fix when a rank cannot hold one block. `fp8_runs` /
    `int_runs`: kv_cache_dtype="fp8" / "int8" and "int4" would run on this engine (its fixes may name them)."""
    runs = lower_kv_runs(fp8_runs, int_runs)
    out = []
    for load, profile, snapshot in zip(loads, profiles, snapshots):
        parts = breakdown(m, profile)
        budget = None if snapshot is None else parts.budget(*snapshot)
        # a pipeline stage of state layers only holds no KV tensor: blocks cost it nothing, so it bounds
        # the shared block count only by its budget at one byte each (the other stages bind)
        per_block = load.bytes_per_block or 1
        lower = () if m.layout is None or not load.bytes_per_block else \
            lower_bytes_per_block(load.bytes_per_block, m.layout.page_spec, m.args.block_size, runs)
        cache = size_cache(m.args, per_block, m.max_position_embeddings, budget, lower, m.layout)
        check_cache(cache, m.args, load.weights.total, image_setting)
        out.append(RankCache(parts, cache))
    if m.args.memory_utilization_given and out[0].cache.rule != "memory_utilization":
        logger.warning("memory_utilization=%s has no effect: %s sizes the KV cache", m.args.memory_utilization,
                       "num_blocks" if out[0].cache.rule == "num_blocks" else "kv_cache_memory")
    return out


def scheduler_config(m: MemoryInputs, cache: CacheConfig) -> SchedulerConfig:
    """max_model_len (the user's, checked against the model and the cache, or the cache's capacity) and
    the step budgets."""
    args, max_pos = m.args, m.max_position_embeddings
    if args.max_model_len is not None:
        if args.max_model_len > max_pos:
            raise InvalidRequestError(
                f"max_model_len={args.max_model_len} exceeds the model's max_position_embeddings="
                f"{max_pos}; lower max_model_len", param="max_model_len")
        check_max_model_len_fits(cache, args.max_model_len)
    max_len, source = resolve_max_model_len(args.max_model_len, max_pos, cache.capacity_tokens)
    if args.max_model_len is None and max_len < max_pos:
        fixes = fixes_text(cache.fixes_for(cache.blocks_for(max_pos)))
        logger.warning("max_model_len is %d, the KV cache capacity, below the model's max_position_"
                       "embeddings %d; sequences stop there. %s", max_len, max_pos,
                       f"For the full length set any one of: {fixes}" if fixes else
                       "No cache this device holds reaches the full length.")
    if cache.num_state_slots and cache.num_state_slots < args.max_num_seqs:
        logger.warning("num_state_slots=%d is below max_num_seqs=%d: at most %d requests run at once (each "
                       "holds a state slot); raise num_state_slots or lower max_num_seqs",
                       cache.num_state_slots, args.max_num_seqs, cache.num_state_slots)
    return SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, max_len, source)


def startup_report(m: MemoryInputs, loads: list[RankLoad], ranks: list[RankCache], cache: CacheConfig,
                   sched: SchedulerConfig, measured: bool, runs: tuple[str, ...] = ()) -> StartupMemory:
    """Rank 0's figures (every rank holds the same cache; under tensor parallelism `ranks` has each
    rank's weights and the blocks it could have held). `measured`: the GPU profile ran (else the
    activation peak is not measured: on the CPU nothing is carved out of device memory). `runs`: the
    lower-precision kv_cache_dtypes that would run on this engine, shown beside this cache (`kv_dtype_fits`)."""
    load, budget, parts = loads[0], cache.budget, ranks[0].parts
    w = load.weights
    per_rank = tuple(RankMemory(r.rank, r.device, r.weights.total,
                                rc.parts.activation_bytes if measured else None, rc.cache.num_blocks,
                                r.stage_layers, r.bytes_per_block if r.stage_layers else None)
                     for r, rc in zip(loads, ranks)) if len(loads) > 1 else ()
    return StartupMemory(
        device=load.device, dtype=load.dtype, kv_cache_dtype=str(m.kv_dtype).removeprefix("torch."),
        weights_language_model_bytes=w.language_model, weights_vision_bytes=w.vision,
        weights_projector_bytes=w.projector, weights_draft_bytes=w.draft,
        weights_allocated_bytes=load.weights_allocated_bytes,
        activation_peak_bytes=parts.activation_bytes if measured else None,
        device_memory_bytes=budget.total_bytes if budget else None,
        device_in_use_bytes=budget.in_use_bytes if budget else None,
        memory_utilization=m.args.memory_utilization, encoder_cache_bytes=m.args.encoder_cache_memory,
        num_layers=load.num_layers, num_kv_heads=load.num_kv_heads, head_dim=load.head_dim,
        block_size=cache.block_size, kv_bytes_per_token=cache.bytes_per_token, kv_bytes_per_block=cache.bytes_per_block,
        num_blocks=cache.num_blocks, cache_source=cache.source, max_model_len=sched.max_model_len,
        max_model_len_source=sched.max_model_len_source, max_position_embeddings=m.max_position_embeddings,
        image_tokens_per_image=m.image.tokens, load_seconds=max(r.load_seconds for r in loads),
        tensor_parallel_size=len(loads), ranks=per_rank, consumers=parts.consumers, weight_format=m.weight_format,
        held_vision=m.held_vision_text, at_once=at_once_shapes(m, cache, sched),
        # (none for a pipeline stage of state layers only, rank 0 here: its blocks hold no KV page to resize)
        kv_dtype_fits=() if m.layout is None or cache.bytes_per_block < m.layout.page_spec.page_bytes(
            cache.block_size) else kv_dtype_fits(
            m.args, cache, cache.budget, m.layout.page_spec, load.dtype, m.max_position_embeddings,
            sched.max_model_len, runs),
        **cache_shares(m, cache, sched.max_model_len))


def at_once_shapes(m: MemoryInputs, cache: CacheConfig, sched: SchedulerConfig) -> tuple:
    """((tokens, images, tokens per image, requests at once), ...): a request of max_model_len tokens, and
    one image at the largest allowed size with the default max_tokens of text and output (when it fits)."""
    shapes = [(sched.max_model_len, 0, 0)]
    image = m.image.tokens + DEFAULT_MAX_TOKENS
    if m.image.tokens and image <= sched.max_model_len:
        shapes.append((image, 1, m.image.tokens))
    return tuple((t, k, per, requests_at_once(cache, t, sched.max_num_seqs)) for t, k, per in shapes)


def cache_shares(m: MemoryInputs, cache: CacheConfig, max_model_len: int) -> dict:
    """The report fields of a model of several cache groups (each group's share, the state slots, the
    capacity of one sequence, prefix reuse per kind), the same in `vlm-sdk plan`."""
    layout = m.layout
    several = layout is not None and len(layout.groups) > 1
    return {"cache_groups": cache_groups(layout, cache.block_size, m.args.max_num_batched_tokens, max_model_len),
            "group_size": layout.group_size if layout is not None else m.num_layers,
            "cache_capacity_tokens": cache.capacity_tokens, "num_state_slots": cache.num_state_slots,
            "state_slot_bytes": cache.state_slot_bytes,
            "prefix_reuse": tuple(layout.prefix_reuse(m.args.enable_prefix_caching, cache.num_state_slots,
                                                      m.args.max_num_seqs).items()) if several else ()}
