"""The paged KV cache's size: bytes per block, the state slots, and the block count the settings give.

    bytes_per_block = group_size * 2 (K, V) * block_size * num_kv_heads * head_dim * KV dtype bytes

(`CacheLayout.block_bytes`: one block of the pool every attention group shares is a page in each of the
group_size KV tensors; a model of one attention kind has group_size = num_layers, today's formula.) A
model with state layers also keeps `num_state_slots` slots of `state_slot_bytes` (every state layer's
tensors for one request), carved out before the blocks: the rules below size the blocks from what the
slots leave. One sequence of L tokens holds `CacheLayout.blocks_for_tokens(L)` blocks (one per
block_size tokens in each full group, a window's in each sliding group), so the capacity in tokens of
a cache of several groups is what that allows (`CacheConfig.capacity_tokens`).

(the KV dtype: the model's, or 1 byte with kv_cache_dtype="fp8"; its per-layer scales are two float32
buffers of each attention layer, counted nowhere: 8 bytes a layer. kv_cache_dtype "int8" / "int4": a
token's head is D or D/2 code bytes plus a float32 scale and zero, for K and for V: `AttentionSpec.page_bytes`.)

Beside the cache the settings give, the same rule's block count for each lower-precision KV cache that
would run and take fewer bytes (`lower_bytes_per_block`, `CacheConfig.lower_blocks`): the plan and the
start-up report show the tokens each would hold, and a too-small cache's fixes name the first that fits.

The block count comes from the first of: `num_blocks`; `kv_cache_memory` // bytes_per_block; on a GPU,
(memory_utilization * total device memory - memory in use after loading - the other consumers' bytes
(activation peak, sampler, graph pools: vlm_sdk/memory/consumers/) - encoder_cache_memory)
// bytes_per_block (`DeviceBudget`: the encoder cache fills while serving, after the KV cache is
allocated, so its bound is set aside first); on the CPU, enough for max_num_seqs sequences of
max_model_len tokens, at most 1 GiB. `vlm-sdk plan` and engine start-up both size the cache here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from vlm_sdk.config import EngineArgs
from vlm_sdk.errors import InvalidRequestError, format_size
from vlm_sdk.protocol.blocks import blocks_needed
from vlm_sdk.protocol.cache_layout import CacheLayout
from vlm_sdk.protocol.cache_spec import AttentionSpec

# the lower-precision KV caches, in the order a fix names them (fp8 holds a few more tokens than int8, int4
# the most): kv_cache_dtype value -> the page dtype it gives
LOWER_KV_DTYPES = {"fp8": "float8_e4m3fn", "int8": "int8", "int4": "int4"}
# kv_cache_dtype values from the most precise: a cache offers those after its own (int8's per-token
# scales keep more than fp8's per-layer one: |error| <= range / 510 against up to 1/16 of the value)
KV_PRECISION = ("auto", "int8", "fp8", "int4")

CPU_DEFAULT_CACHE_BYTES = 1 << 30
# which setting decided a cache's block count; the fixes offered for a too-small cache follow it
CACHE_RULES = ("num_blocks", "kv_cache_memory", "memory_utilization", "cpu_default")


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                    dtype: torch.dtype) -> int:
    """`dtype`: the cache's (the model's, or float8 e4m3 with kv_cache_dtype="fp8")."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


def lower_bytes_per_block(per_block: int, page: AttentionSpec, block_size: int,
                          runs: tuple[str, ...] = tuple(LOWER_KV_DTYPES)) -> tuple[tuple[str, int], ...]:
    """(kv_cache_dtype, bytes per block) of each lower-precision cache of `runs` for the same model, beside
    a cache of `per_block` bytes whose page is `page`: those that take fewer bytes a block (int4 only for an
    even head_dim)."""
    here = page.page_bytes(block_size)
    own = {"float8_e4m3fn": "fp8", "int8": "int8", "int4": "int4"}.get(page.dtype, "auto")
    below = KV_PRECISION[KV_PRECISION.index(own) + 1:]
    out = []
    for name, dtype in LOWER_KV_DTYPES.items():
        if name not in runs or name not in below or (name == "int4" and page.head_dim % 2):
            continue
        there = dataclasses.replace(page, dtype=dtype).page_bytes(block_size)
        if there < here:  # per_block is group_size pages: exact
            out.append((name, per_block // here * there))
    return tuple(out)


def fp8_bytes_per_block(per_block: int, kv_dtype: torch.dtype) -> int | None:
    """The bytes per block of an FP8 cache of the same model, beside a `kv_dtype` (float) cache of
    `per_block` bytes; None when that cache is 8 bits or fewer already."""
    if not kv_dtype.is_floating_point:
        return None
    bits = torch.finfo(kv_dtype).bits
    return None if bits <= 8 else per_block * 8 // bits


@dataclass(frozen=True)
class DeviceBudget:
    """The device memory a `memory_utilization` cache is carved from (bytes):

        kv_cache_bytes = memory_utilization * total - in_use - activation_peak - encoder_cache

    `in_use` is what is taken before the cache: weights, the CUDA context, other processes (the engine
    measures it; `plan` counts the weights, plus the device's current use with `--device cuda:N`).
    `activation_peak` is the sum of the memory consumers that come and go with each step (the activation
    peak, the sampler, the graph pools; vlm_sdk/memory/consumers/). `encoder_cache` is
    `encoder_cache_memory`: the vision embeddings kept for reuse grow into it while the engine runs,
    after the KV cache is allocated, so it is set aside before the KV cache is sized."""
    total_bytes: int
    in_use_bytes: int
    activation_peak_bytes: int
    encoder_cache_bytes: int = 0

    @property
    def reserved_bytes(self) -> int:
        """Taken before the KV cache: in use, the activation peak and the encoder cache."""
        return self.in_use_bytes + self.activation_peak_bytes + self.encoder_cache_bytes

    def blocks(self, memory_utilization: float, bytes_per_block: int, state_bytes: int = 0) -> int:
        """KV blocks that fit beside `state_bytes` of state slots; may be < 1."""
        return (int(memory_utilization * self.total_bytes) - self.reserved_bytes - state_bytes) // bytes_per_block

    def utilization_for(self, cache_bytes: int) -> float:
        """The smallest memory_utilization (2 decimals, rounded up) leaving `cache_bytes` for the cache;
        above 1 when the device cannot hold it at all."""
        need = self.reserved_bytes + cache_bytes
        hundredths = -(-need * 100 // self.total_bytes)
        if int(hundredths / 100 * self.total_bytes) < need:  # float rounding at an exact boundary
            hundredths += 1
        return hundredths / 100


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    bytes_per_block: int  # one block of the shared pool: group_size layers' pages, K and V
    source: str  # how num_blocks was decided, in words, for error messages and the start-up report
    rule: str = "num_blocks"  # one of CACHE_RULES
    budget: DeviceBudget | None = None  # CUDA (or a planned device): the memory the cache comes out of
    # (kv_cache_dtype, blocks) the same rule gives each lower-precision cache that runs on this engine's
    # device and backend and holds more blocks than this one (`lower_bytes_per_block`)
    lower_blocks: tuple[tuple[str, int], ...] = ()
    # a model with state layers: the slots (live ones and checkpoints) carved out before the blocks, and
    # one slot's bytes over every state layer; 0 for a model without state layers
    num_state_slots: int = 0
    state_slot_bytes: int = 0
    layout: CacheLayout | None = None  # the model's cache groups; None: one full-attention group
    chunk_tokens: int = 0  # max_num_batched_tokens: a sliding group holds its window and one chunk

    @property
    def state_bytes(self) -> int:
        return self.num_state_slots * self.state_slot_bytes

    @property
    def fp8_blocks(self) -> int | None:
        """The blocks of an FP8 cache under the same rule (`lower_blocks`), None when it is not one of them."""
        return dict(self.lower_blocks).get("fp8")

    def lower_capacity_tokens(self) -> dict[str, int]:
        """kv_cache_dtype -> the longest sequence each lower-precision cache of `lower_blocks` holds."""
        return {name: dataclasses.replace(self, num_blocks=max(n, 0)).capacity_tokens for name, n in self.lower_blocks}

    @property
    def capacity_tokens(self) -> int:
        """The longest sequence the blocks hold: num_blocks * block_size for one full-attention group."""
        if self.layout is None:
            return self.num_blocks * self.block_size
        return self.layout.capacity_tokens(self.num_blocks, self.block_size, self.chunk_tokens,
                                           max(self.num_blocks, 0) * self.block_size)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks one sequence of `num_tokens` tokens holds (over every attention group)."""
        if self.layout is None:
            return blocks_needed(num_tokens, self.block_size)
        return self.layout.blocks_for_tokens(num_tokens, self.block_size, self.chunk_tokens)

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    def fixes_for(self, num_blocks: int) -> dict[str, int | float | str]:
        """Settings, each of which alone gives this cache at least `num_blocks` blocks. Only settings
        that would take effect are named: num_blocks overrides kv_cache_memory, which overrides
        memory_utilization, so a cache the user sized by num_blocks is only fixed by num_blocks.
        kv_cache_dtype: the first of fp8, int8, int4 (`lower_blocks`) whose blocks in the same memory are
        that many. With a
        device budget, only that when the device cannot hold that many blocks of this dtype at all.
        num_state_slots (a model with state layers, the blocks sized from bytes) when fewer state slots
        leave room for that many blocks: the slots are what binds."""
        fixes: dict[str, int | float | str] = {}
        fits = True
        if self.budget is not None:
            u = self.budget.utilization_for(num_blocks * self.bytes_per_block + self.state_bytes)
            fits = u <= 1  # else the device cannot hold it beside the weights and activations, however set
            if fits and self.rule == "memory_utilization":
                fixes["memory_utilization"] = u
        if fits:
            if self.rule != "num_blocks":
                fixes["kv_cache_memory"] = num_blocks * self.bytes_per_block + self.state_bytes
            fixes["num_blocks"] = num_blocks
        lower = next((name for name, n in self.lower_blocks if n >= num_blocks), None)
        if lower is not None:
            fixes["kv_cache_dtype"] = lower
        if self.num_state_slots and self.rule in ("kv_cache_memory", "memory_utilization"):
            # the state slots are carved out of the same bytes first: fewer of them leave room for the blocks
            # (at most the remainder of one block short of exact, so the count named is safe)
            room = self.num_blocks * self.bytes_per_block + self.state_bytes
            slots = (room - num_blocks * self.bytes_per_block) // self.state_slot_bytes
            if 1 <= slots < self.num_state_slots:
                fixes["num_state_slots"] = slots
        return fixes


def state_slots(args: EngineArgs, layout: CacheLayout | None) -> int:
    """The state slots a model with state layers keeps (`num_state_slots`, else max_num_seqs, twice that
    with prefix caching: a live slot per running request and as many checkpoints; with speculative decoding
    max_num_seqs x k more: a slot per draft, the state after it, held for its verification step); 0 without
    state layers."""
    if layout is None or not layout.has_state:
        return 0
    spec = args.speculative_config
    drafts = spec.num_speculative_tokens if spec is not None else 0
    return args.num_state_slots or args.max_num_seqs * (1 + drafts + (1 if args.enable_prefix_caching else 0))


def size_cache(args: EngineArgs, per_block: int, max_position_embeddings: int,
               budget: DeviceBudget | None, lower_per_block: tuple[tuple[str, int], ...] | int | None = None,
               layout: CacheLayout | None = None) -> CacheConfig:
    """The cache the settings ask for, by the rules above (`budget` None: not on a GPU). The block
    count may be < 1 under memory_utilization: `check_cache` refuses it. The CPU default holds
    max_num_seqs sequences of max_model_len (else max_position_embeddings) tokens. `lower_per_block`:
    (kv_cache_dtype, bytes per block) of the lower-precision caches that would run (`lower_bytes_per_block`;
    an int: an FP8 cache's bytes), sized by the same rule into `lower_blocks`.
    `layout`: the model's cache groups (None: one full-attention group); its state slots are carved out
    of a budget or kv_cache_memory before the blocks."""
    slots = state_slots(args, layout)
    shape = dict(layout=layout, chunk_tokens=args.max_num_batched_tokens, num_state_slots=slots,
                 state_slot_bytes=layout.state_slot_bytes if slots else 0)
    cache = dataclasses.replace(_size_cache(args, per_block, max_position_embeddings, budget, layout, slots), **shape)
    if isinstance(lower_per_block, int):
        lower_per_block = (("fp8", lower_per_block),)
    if not lower_per_block or cache.rule == "num_blocks":
        return cache
    lower = []
    for name, bytes_ in lower_per_block:
        if bytes_ < per_block:
            n = _size_cache(args, bytes_, max_position_embeddings, budget, layout, slots).num_blocks
            if n > cache.num_blocks:
                lower.append((name, n))
    return dataclasses.replace(cache, lower_blocks=tuple(lower))


def _size_cache(args: EngineArgs, per_block: int, max_position_embeddings: int,
                budget: DeviceBudget | None, layout: CacheLayout | None, slots: int) -> CacheConfig:
    state = slots * layout.state_slot_bytes if slots else 0
    carved = f", after {slots} state slots of {layout.state_slot_bytes:,} bytes" if slots else ""
    if args.num_blocks is not None:
        return CacheConfig(args.block_size, args.num_blocks, per_block, f"num_blocks={args.num_blocks} set by you",
                           "num_blocks", budget)
    if args.kv_cache_memory is not None:
        return CacheConfig(args.block_size, (args.kv_cache_memory - state) // per_block, per_block,
                           f"kv_cache_memory={args.kv_cache_memory:,} bytes set by you{carved}", "kv_cache_memory",
                           budget)
    if budget is not None:
        u = args.memory_utilization
        return CacheConfig(args.block_size, budget.blocks(u, per_block, state), per_block,
                           f"memory_utilization={u} of {budget.total_bytes:,} bytes, after {budget.in_use_bytes:,} "
                           f"in use, a {budget.activation_peak_bytes:,}-byte activation peak and a "
                           f"{budget.encoder_cache_bytes:,}-byte encoder cache{carved}",
                           "memory_utilization", budget)
    length = args.max_model_len or max_position_embeddings
    per_seq = blocks_needed(length, args.block_size) if layout is None else \
        layout.blocks_for_tokens(length, args.block_size, args.max_num_batched_tokens)
    blocks = min((CPU_DEFAULT_CACHE_BYTES - state) // per_block, args.max_num_seqs * per_seq)
    return CacheConfig(args.block_size, blocks, per_block,
                       "the CPU default: max_num_seqs full-length sequences, at most 1 GiB "
                       f"(set num_blocks or kv_cache_memory to change it){carved}", "cpu_default")


def check_cache(cache: CacheConfig, args: EngineArgs, weights_bytes: int, image_setting: str | None = None) -> None:
    """Raise `InvalidRequestError`, naming the numbers and the fix, when not one block fits (beside the
    state slots of a model with state layers: the error names them when they take the room).
    `weights_bytes`: this engine's own weights on the rank (the rest of what is in use belongs to the
    CUDA context and other processes, other engines of this process included); `image_setting` (the
    model family's `plan_setting`) is the setting that sizes the profiled image."""
    if cache.num_blocks >= 1:
        return
    per_block, budget, state = cache.bytes_per_block, cache.budget, cache.state_bytes
    slots = (f" beside {cache.num_state_slots} state slots x {cache.state_slot_bytes:,} bytes = {state:,} "
             f"(num_state_slots; default max_num_seqs, twice that with prefix caching)" if state else "")
    fewer = ", or lower num_state_slots (or max_num_seqs)" if state else ""
    if cache.rule == "kv_cache_memory":
        raise InvalidRequestError(
            f"kv_cache_memory={args.kv_cache_memory:,} bytes holds no KV block{slots}: one block of "
            f"{args.block_size} tokens takes {per_block:,} bytes; set kv_cache_memory >= "
            f"{format_size(per_block + state)} (--kv-cache-memory {format_size(per_block + state)}){fewer}")
    if budget is None:  # the CPU default, with one block above its 1 GiB cap
        raise InvalidRequestError(
            f"one KV block of {args.block_size} tokens takes {per_block:,} bytes{slots}, more than the CPU default "
            f"cache of {CPU_DEFAULT_CACHE_BYTES:,} bytes: set num_blocks, kv_cache_memory >= "
            f"{format_size(per_block + state)}, or a smaller block_size{fewer}")
    need = budget.utilization_for(per_block + state)
    raise_to = (f"Raise memory_utilization to at least {need:.2f} (room for one {per_block:,}-byte block{slots})"
                if need <= 1 else
                f"Even memory_utilization=1 leaves no room for one {per_block:,}-byte block{slots} ({need:.2f} would "
                f"be needed): free device memory")
    others = budget.in_use_bytes - weights_bytes
    raise InvalidRequestError(
        f"no room for the KV cache: memory_utilization={args.memory_utilization} of {budget.total_bytes:,} bytes "
        f"leaves {int(args.memory_utilization * budget.total_bytes):,}; {budget.in_use_bytes:,} are in use "
        f"({weights_bytes:,} by this engine's weights"
        + (f", {others:,} by the CUDA context, other engines and other processes" if others > 0 else "")
        + f") and the activation peak is {budget.activation_peak_bytes:,} (a step of max_num_batched_tokens="
        f"{args.max_num_batched_tokens} tokens, logits for max_num_seqs={args.max_num_seqs} rows and one "
        f"{image_setting or 'largest allowed'} image; lowering those lowers it)"
        + (f"; encoder_cache_memory sets aside {budget.encoder_cache_bytes:,}" if budget.encoder_cache_bytes else "")
        + (f"; the state slots take {state:,}" if state else "")
        + f". {raise_to}, lower max_num_batched_tokens, max_num_seqs, {image_setting or 'the image size setting'}"
        + (" or encoder_cache_memory" if budget.encoder_cache_bytes else "") + fewer + ", or set kv_cache_memory")
