"""Attention over a paged KV cache in pure torch: what the "torch" attention backend
(`vlm_sdk.attention.torch_backend`) runs, the CPU default and the reference the Triton kernels
(`paged_attention_decode`, `paged_prefill_attention`) are checked against at engine level.

`write_kv_cache` scatters this step's K/V into their slots; `paged_attention` reads each sequence's
K/V back through its block table and attends causally, the new tokens being the last ones of the
sequence. Inputs are plain tensors and host lists (no metadata type): a batched decode step groups its
sequences by length (`decode_layout`), which the caller builds once per step and passes to every layer.

A sliding-window layer (`window` W) reads only the keys p - W < q <= p of each query p: the gathers start
at the block holding the first of them (earlier entries of its block table may be let go, -1), and the
masks drop what that block holds before the window. `key_limits` (bidirectional spans, Gemma 3's image
tokens) lets each query of a prefill chunk see keys up to key_limits[i] >= its own position (the end of
its image in the chunk), the window's lower bound kept (transformers' AND(window, OR(causal, span))).

An FP8 cache (`kv_quant.KV_FP8`) holds K / k_scale and V / v_scale (`kv_quant.quantize`); every path
reads what the cache holds (`kv_quant.dequantize`), the whole-prompt path included (its K/V round-trip
through FP8 without the gather), so the torch backend attends over exactly the values the Triton
kernels read. An int8 / int4 cache (`k_sz` / `v_sz`: each token's and head's scale and zero, beside
uint8 code pages: kernels/kv_int.py) is read the same way: gathered codes and their (scale, zero) rows,
dequantized; the whole-prompt path round-trips its K/V through the same quantization.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlm_sdk.kernels import kv_int, kv_quant


def write_kv_cache(k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
                   v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
                   k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim (int4: / 2)]
                   v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor,  # [num_tokens]
                   k_scale: torch.Tensor | None = None,  # [] float32: an FP8 cache's scales
                   v_scale: torch.Tensor | None = None,
                   k_sz: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv, 2] float32: an int cache's
                   v_sz: torch.Tensor | None = None) -> None:
    bits = kv_int.bits_of(k_cache, k_sz, k.shape[-1])
    if bits:
        kv_int.write_slots(k_cache, k_sz, slot_mapping, k, bits)
        kv_int.write_slots(v_cache, v_sz, slot_mapping, v, bits)
        return
    kv_quant.write_slots(k_cache, slot_mapping, kv_quant.quantize(k, k_scale, k_cache.dtype))
    kv_quant.write_slots(v_cache, slot_mapping, kv_quant.quantize(v, v_scale, v_cache.dtype))


def read_rows(rows: torch.Tensor,  # [..., Hkv, D or D/2]: gathered cache rows
              scale: torch.Tensor | None,  # an FP8 cache's
              sz: torch.Tensor | None,  # [..., Hkv, 2]: an int cache's (scale, zero) of the same rows
              bits: int, dtype: torch.dtype) -> torch.Tensor:  # [..., Hkv, D]
    """Gathered cache rows as `dtype` values, whatever the cache holds."""
    if bits:
        return kv_int.dequantize(rows, sz, bits, dtype)
    return kv_quant.dequantize(rows, scale, dtype)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int, scale: torch.Tensor | None,
            dtype: torch.dtype, first_block: int = 0, sz: torch.Tensor | None = None,
            bits: int = 0) -> torch.Tensor:
    """Keys (or values) first_block * block_size .. length - 1 of one sequence: [length - first, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    ids = block_table[first_block:num_blocks].long()
    keys = length - first_block * block_size
    rows = cache[ids].reshape(-1, cache.shape[2], cache.shape[3])[:keys]  # [keys, Hkv, D or D/2]
    sz_rows = None if sz is None else sz[ids].reshape(-1, sz.shape[2], 2)[:keys]  # [keys, Hkv, 2]
    return read_rows(rows, scale, sz_rows, bits, dtype)


def paged_attention(q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
                    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
                    v_cache: torch.Tensor,
                    block_tables: torch.Tensor,  # [batch, max_blocks_per_seq] int32
                    seq_lens: torch.Tensor,  # [batch] int32, tokens in the cache after this step
                    query_lens_cpu: list[int],  # [batch] new tokens per sequence (packed back to back in q)
                    seq_lens_cpu: list[int],  # [batch] the same as seq_lens, as host ints
                    scale: float,
                    k: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim]: this step's K/V,
                    v: torch.Tensor | None = None,  # read directly by sequences with no earlier context
                    layout: "tuple[DecodeGroup, ...] | None" = None,  # `decode_layout` of a batched decode step
                    k_scale: torch.Tensor | None = None,  # [] float32: an FP8 cache's scales
                    v_scale: torch.Tensor | None = None,
                    window: int | None = None,  # a sliding-window layer's: keys p - window < q <= p
                    key_limits: torch.Tensor | None = None,  # [num_tokens] int32: the last key each query sees
                    k_sz: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv, 2]: an int cache's
                    v_sz: torch.Tensor | None = None,
                    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its cached keys (the last `window` of them for
    a sliding-window layer). A decode step of several sequences (every query length 1) attends group by
    group; `layout` (None: built here) is `decode_layout(block_tables, seq_lens, seq_lens_cpu, block_size,
    window)`."""
    bits = kv_int.bits_of(k_cache, k_sz, q.shape[-1])
    scales = (k_scale, v_scale, k_sz, v_sz, bits)
    block_size = k_cache.shape[1]
    if max(query_lens_cpu) == 1 and len(seq_lens_cpu) > 1:
        if layout is None:
            layout = decode_layout(block_tables, seq_lens, seq_lens_cpu, block_size, window)
        return _decode_batched(q, k_cache, v_cache, layout, scale, scales)
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(query_lens_cpu, seq_lens_cpu)):
        qi = q[start:start + q_len].transpose(0, 1)  # [H, q_len, D]
        if q_len == seq_len and k is not None:
            # a whole prompt in one chunk: its K/V are this step's, and plain causal attention takes
            # the fast (flash) CPU path instead of the masked math path (a window wider than the prompt
            # changes nothing)
            if bits:
                ki = kv_int.round_trip(k[start:start + q_len], bits)  # [q_len, Hkv, D]
                vi = kv_int.round_trip(v[start:start + q_len], bits)
            else:
                ki = kv_quant.round_trip(k[start:start + q_len], k_scale, k_cache.dtype)  # [q_len, Hkv, D]
                vi = kv_quant.round_trip(v[start:start + q_len], v_scale, v_cache.dtype)
            mask = None
            if (window is not None and q_len > window) or (key_limits is not None and q_len > 1):
                limits = None if key_limits is None else key_limits[start:start + q_len]
                mask = _window_mask(0, q_len, 0, q_len, window, q.device, limits)  # [q_len, q_len]
            o = _sdpa(qi, ki.transpose(0, 1), vi.transpose(0, 1), mask, q_len > 1 and mask is None, scale)
            out[start:start + q_len] = o.transpose(0, 1)
            start += q_len
            continue
        # the block of the first key the step's first query reads (0 without a window)
        first = 0 if window is None else max(0, seq_len - q_len - window + 1) // block_size
        ki = _gather(k_cache, block_tables[i], seq_len, k_scale, q.dtype, first, k_sz, bits)  # [keys, Hkv, D]
        vi = _gather(v_cache, block_tables[i], seq_len, v_scale, q.dtype, first, v_sz, bits)
        mask = None
        if q_len > 1 or (window is not None and seq_len - first * block_size > window):
            # new token j sits at position seq_len - q_len + j and sees keys up to it (within the window), or
            # up to its key limit
            limits = None if key_limits is None else key_limits[start:start + q_len]
            mask = _window_mask(seq_len - q_len, seq_len, first * block_size, seq_len, window, q.device, limits)
        o = _sdpa(qi, ki.transpose(0, 1), vi.transpose(0, 1), mask, False, scale)
        out[start:start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


def _window_mask(q_lo: int, q_hi: int, k_lo: int, k_hi: int, window: int | None,
                 device, limits: torch.Tensor | None = None) -> torch.Tensor:  # [q_hi - q_lo, k_hi - k_lo] bool
    """Which keys k_lo..k_hi - 1 each query q_lo..q_hi - 1 reads: k <= q (k <= its limit, `limits`
    [q_hi - q_lo]), and q - window < k with a window."""
    q_pos = torch.arange(q_lo, q_hi, device=device)[:, None]
    k_pos = torch.arange(k_lo, k_hi, device=device)[None, :]
    mask = k_pos <= (q_pos if limits is None else limits.long()[:, None])
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def _sdpa(q: torch.Tensor,  # [H, q_len, D]
          k: torch.Tensor,  # [Hkv, kv_len, D]
          v: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float) -> torch.Tensor:
    """SDPA for one sequence. KV heads are expanded and a batch axis added: with either missing, the
    CPU falls back from the flash kernel to the (3-4x slower) math path."""
    group = q.shape[0] // k.shape[0]
    if group > 1:
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=causal,
                                          scale=scale)[0]  # [H, q_len, D]


@dataclass(frozen=True)
class DecodeGroup:
    """Sequences of a batched decode step attended together, their K/V padded to the group's longest."""
    rows: torch.Tensor | None  # [n] int64 rows of the batch, None: the whole batch in order
    blocks: torch.Tensor  # [n * max_blocks] int64 flat block ids
    mask: torch.Tensor  # [n, 1, 1, max_blocks * block_size] bool, keys each sequence has


# A sequence joins the current group while its length is at most this times the group's shortest:
# one padded batch for similar lengths (the common case), a few when they differ widely (short and
# long image prompts), since padded keys cost gather bandwidth and attention work in every layer.
GROUP_LENGTH_RATIO = 1.5
MAX_GROUPS = 4


def _decode_batched(q, k_cache, v_cache, groups: tuple[DecodeGroup, ...], scale: float, scales) -> torch.Tensor:
    """One query per sequence: gather each group's K/V padded to its longest and attend at once."""
    if len(groups) == 1:
        return _decode_group(q, k_cache, v_cache, groups[0], scale, scales)
    out = torch.empty_like(q)
    for group in groups:
        out[group.rows] = _decode_group(q.index_select(0, group.rows), k_cache, v_cache, group, scale, scales)
    return out


def _decode_group(q, k_cache, v_cache, group: DecodeGroup, scale: float, scales) -> torch.Tensor:
    batch, length = group.mask.shape[0], group.mask.shape[-1]
    # index_select on the flat block axis is ~2.5x faster on the CPU than advanced indexing
    k_scale, v_scale, k_sz, v_sz, bits = scales
    k = k_cache.index_select(0, group.blocks).view(batch, length, *k_cache.shape[2:])  # [B, L, Hkv, D or D/2]
    v = v_cache.index_select(0, group.blocks).view(batch, length, *v_cache.shape[2:])
    if bits:  # each row's (scale, zero), gathered the same way
        k_sz = k_sz.index_select(0, group.blocks).view(batch, length, k_sz.shape[2], 2).transpose(1, 2)
        v_sz = v_sz.index_select(0, group.blocks).view(batch, length, v_sz.shape[2], 2).transpose(1, 2)
    num_kv_heads = k_cache.shape[2]
    group_size = q.shape[1] // num_kv_heads
    # GQA folded into the query axis: the `group_size` query heads sharing a KV head become queries
    # of it (one key set, no causal order among them), 5x faster on the CPU than enable_gqa
    qg = q.view(batch, num_kv_heads, group_size, q.shape[2])  # [B, Hkv, G, D]
    k = read_rows(k.transpose(1, 2), k_scale, k_sz, bits, q.dtype)  # [B, Hkv, L, D]
    v = read_rows(v.transpose(1, 2), v_scale, v_sz, bits, q.dtype)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=group.mask, scale=scale)  # [B, Hkv, G, D]
    return o.reshape(batch, q.shape[1], q.shape[2])  # [B, H, D]


def decode_groups(seq_lens: list[int]) -> list[list[int]]:
    """Batch rows grouped by length (ascending): a new group starts when a length exceeds
    GROUP_LENGTH_RATIO times the current group's shortest, at most MAX_GROUPS groups."""
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    groups = [[order[0]]]
    for row in order[1:]:
        if seq_lens[row] > GROUP_LENGTH_RATIO * seq_lens[groups[-1][0]] and len(groups) < MAX_GROUPS:
            groups.append([])
        groups[-1].append(row)
    return groups


def decode_layout(block_tables: torch.Tensor,  # [batch, max_blocks_per_seq] int32
                  seq_lens: torch.Tensor,  # [batch] int32
                  seq_lens_cpu: list[int],
                  block_size: int, window: int | None = None) -> tuple[DecodeGroup, ...]:
    """The groups of a batched decode step (`decode_groups`) with their flat block ids and key masks:
    the same for every layer of a cache group, so built once per step by the caller. With a `window`
    every row reads at most its window's blocks: one group, each row's gather starting at the block of
    its first key."""
    if window is not None:
        return (_window_layout(block_tables, seq_lens, seq_lens_cpu, block_size, window),)
    rows_of = decode_groups(seq_lens_cpu)
    whole = len(rows_of) == 1
    layout = []
    for rows in rows_of:
        longest = max(seq_lens_cpu[r] for r in rows)
        max_blocks = (longest + block_size - 1) // block_size
        index = None if whole else torch.tensor(rows, dtype=torch.long, device=seq_lens.device)
        tables = block_tables if whole else block_tables.index_select(0, index)
        lens = seq_lens if whole else seq_lens.index_select(0, index)
        blocks = tables[:, :max_blocks].reshape(-1).long()  # [n * nb]
        key_pos = torch.arange(max_blocks * block_size, device=seq_lens.device)
        mask = (key_pos[None, :] < lens[:, None])[:, None, None, :]  # [n, 1, 1, L]
        layout.append(DecodeGroup(index, blocks, mask))
    return tuple(layout)


def _window_layout(block_tables: torch.Tensor,  # [batch, max_blocks_per_seq] int32
                   seq_lens: torch.Tensor,  # [batch] int32
                   seq_lens_cpu: list[int], block_size: int, window: int) -> DecodeGroup:
    """A decode step of a sliding-window layer: row r's query at len_r - 1 reads keys len_r - window ..
    len_r - 1, from block first_r = max(0, len_r - window) // block_size on."""
    device = seq_lens.device
    # a window's keys span at most (window - 1) // block_size + 2 blocks: from the lengths' bound alone, so
    # that the layout does not depend on the host lengths (a graph's are max_model_len)
    num_blocks = min((max(seq_lens_cpu) + block_size - 1) // block_size, (window - 1) // block_size + 2)
    first_d = (seq_lens.long() - window).clamp(min=0) // block_size  # [batch]
    cols = first_d[:, None] + torch.arange(num_blocks, device=device)[None, :]  # [batch, nb]
    cols = cols.clamp(max=block_tables.shape[1] - 1)  # past a row's blocks: masked, any entry will do
    # entries before the window may be -1 (let go of); none is gathered, but a clamped pad could be
    blocks = block_tables.long().gather(1, cols).clamp(min=0).reshape(-1)  # [batch * nb]
    key_pos = first_d[:, None] * block_size + torch.arange(num_blocks * block_size, device=device)[None, :]
    lens = seq_lens.long()[:, None]
    mask = ((key_pos < lens) & (key_pos >= lens - window))[:, None, None, :]  # [batch, 1, 1, nb * block_size]
    return DecodeGroup(None, blocks, mask)
