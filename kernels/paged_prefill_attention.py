"""Causal attention of packed, variable-length query chunks over a paged KV cache (prefill / chunked prefill).

Sequence b contributes the query rows cu_seqlens_q[b]..cu_seqlens_q[b+1] of q ([N, H, D]); its keys and values
are the seq_lens[b] tokens already in the paged cache ([num_blocks, block_size, Hkv, D]; token p lives in block
block_tables[b, p // block_size] at offset p % block_size), the chunk's own K/V included (store_kv ran first).
The chunk is the tail of the sequence: query j sits at position seq_len - q_len + j and sees keys 0..that position.
One op thus serves whole prompts (seq_len == q_len), chunked prefill and prefix-cache hits (seq_len > q_len) and
decode rows (q_len 1) of a mixed batch; q_len 0 rows write nothing.

Kernel shape (FlashAttention-2 forward): grid (T, Hkv) over a list of T (sequence, first query) tiles
(`prefill_tiles`: only the real tiles of a step, built from host lengths; without one, `dense_tiles` covers
every (sequence, tile) pair up to max_query_len and the tiles past a chunk exit at once). A program owns
QUERY_TILE queries of one sequence with all GROUP query heads of one KV head, stacked as the rows of its
M tile (row r: query r // GROUP, head r % GROUP; GQA packing), so each K/V tile is read once per KV head,
not once per query head, and a short chunk still fills the tile (a decode row alone: GROUP rows, not 1 of
64). It streams the sequence's keys in BLOCK_N tiles with an fp32 online softmax, so nothing of size
seq_len is materialised. Tiles past the tile's last query position are never visited (causal), and the
loop is split in two: tiles entirely at or before the tile's first query position need no causal mask,
only the few tiles on the diagonal pay for it. Keys are gathered per key position through the block
table, so any block_size works (not only multiples of BLOCK_N); it is a compile-time constant (one per
cache layout), which turns the page arithmetic into shifts for powers of two. For 63 decode rows beside
one 8k chunk (16q/2kv) the old grid (B, H, cdiv(max_q, BLOCK_M)) launched 64 x 16 x 64 = 65,536 programs;
the backend now sends the decode rows to the decode kernel and launches 512 x 2 = 1,024 here. No host
synchronisation: lengths are read in the kernel. An FP8 cache (K / k_scale, V / v_scale: kernels/kv_quant.py)
is read as the decode kernel reads it: e4m3 tiles converted exactly to q's dtype for the dots (in hardware
on sm_89+, else from their bits: kernels/fp8_bits.py), k_scale folded into the softmax scale and v_scale
into the output. An int8 / int4 cache (`k_sz` / `v_sz`: kernels/kv_int.py) is read as codes in q's dtype
(exact) with each key's scale and zero folded in, s (q . c - z sum(q)) for the scores and (p s) . c - sum(p s z)
for the values (kernels/kv_int_bits.py): no float32 tile of dequantized values, which spilled on sm_80.

Two variants for models that ask for them (constexprs, so every other model's kernel is unchanged):
- `window` W (a sliding-window layer): query p sees keys p - W < k <= p; the tiles before the tile's first
  query's window are never visited (nor their block-table entries, which the engine may have let go: -1),
  and tiles the window cuts are masked like the diagonal.
- `key_limits` [N] (bidirectional spans: Gemma 3's image tokens see every token of their image in the
  chunk): query row i sees keys up to key_limits[i] >= its own position instead of up to itself; with a
  window the lower bound stays p - W < k (transformers' AND(window, OR(causal, block))).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vlm_sdk.kernels import fp8_bits, kv_int, kv_int_bits, kv_quant
from vlm_sdk.kernels.paged_attention import read_rows
from vlm_sdk.kernels.flash_config import flash_launch_config

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tiles(acc, l_i, m_i, q,  # [BLOCK_M, BLOCK_D] fp32 acc, [BLOCK_M] l/m, [BLOCK_M, BLOCK_D] q
                  k_cache, v_cache, table_row, q_hi, q_lo, offs_d, mask_d,
                  stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                  k_sz, v_sz, stride_zb, stride_zs, q_sum,  # QUANT: the (scale, zero) tensors at this KV head,
                  # and each row's sum of q (fp32 [BLOCK_M])
                  lo, hi, first_key,
                  BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                  SOFTWARE: tl.constexpr, SLIDING: tl.constexpr, QUANT: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Online-softmax update over key tiles [lo, hi); k_cache/v_cache already point at this KV head. With
    CAUSAL (a masked tile) row r sees keys q_lo[r] < k <= q_hi[r] (q_lo used when SLIDING), and no key
    before `first_key` or from `hi` on is read. SLIDING rows may see no key of a whole tile: their max
    stays -inf and the update is made safe for it."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        key_pos = start_n + offs_n  # [BLOCK_N]
        if CAUSAL:  # the diagonal's last tile may run past the last query's position
            in_range = (key_pos < hi) & (key_pos >= first_key)
            page = tl.load(table_row + key_pos // BLOCK_SIZE, mask=in_range, other=0)
            kv_mask = in_range[:, None] & mask_d[None, :]
        else:
            page = tl.load(table_row + key_pos // BLOCK_SIZE)
            kv_mask = mask_d[None, :]
        # the page offset is 64-bit: one layer's cache can exceed 2**31 elements
        page = page.to(tl.int64)
        slot_k = page * stride_kb + (key_pos % BLOCK_SIZE) * stride_ks  # [BLOCK_N]
        slot_v = page * stride_vb + (key_pos % BLOCK_SIZE) * stride_vs
        if QUANT:  # codes in q's dtype; each key's scale and zero folded into its scores (no fp32 tile):
            # q . (c - z) s = s (q . c - z sum(q))
            sz_row = page * stride_zb + (key_pos % BLOCK_SIZE) * stride_zs  # [BLOCK_N]
            if not CAUSAL:
                in_range = key_pos >= 0  # every key of the tile
            kv_mask = in_range[:, None] & mask_d[None, :]
            k = kv_int_bits.load_codes(k_cache + slot_k, offs_d, kv_mask, q.dtype, QUANT, HEAD_DIM)
            k_s = tl.load(k_sz + sz_row, mask=in_range, other=0.0)
            k_z = tl.load(k_sz + sz_row + 1, mask=in_range, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)  # [BLOCK_M, BLOCK_N]
            qk = (qk - q_sum[:, None] * k_z[None, :]) * (k_s * qk_scale)[None, :]
        else:  # [BLOCK_N, BLOCK_D] tiles in q's dtype (an FP8 cache converted here)
            k = fp8_bits.load_kv(k_cache + slot_k[:, None] + offs_d[None, :], kv_mask, q.dtype, SOFTWARE)
            v = fp8_bits.load_kv(v_cache + slot_v[:, None] + offs_d[None, :], kv_mask, q.dtype, SOFTWARE)
            qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if CAUSAL:
            seen = key_pos[None, :] <= q_hi[:, None]
            if SLIDING:
                seen = seen & (key_pos[None, :] > q_lo[:, None])
            qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if SLIDING:  # a row may have seen no key yet: subtract 0, not -inf (exp2(-inf) = 0 weighs nothing)
            m_new = tl.where(m_new > float("-inf"), m_new, 0.0)
        # without a window every row has seen key 0 by now (it is in the first tile visited): m_new is finite
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANT:  # sum_n p (c - z) s: the weights times each value's scale, its zero taken off after the dot
            v = kv_int_bits.load_codes(v_cache + slot_v, offs_d, kv_mask, q.dtype, QUANT, HEAD_DIM)
            v_s = tl.load(v_sz + sz_row, mask=in_range, other=0.0)
            v_z = tl.load(v_sz + sz_row + 1, mask=in_range, other=0.0)
            w = (p * v_s[None, :]).to(v.dtype)  # [BLOCK_M, BLOCK_N]: the correction uses these same values
            # the dot accumulates into acc (no second fp32 tile), then the zeros' share comes off
            acc = acc * alpha[:, None] + tl.dot(w, v, input_precision=INPUT_PRECISION)
            acc = acc - tl.sum(w.to(tl.float32) * v_z[None, :], 1)[:, None]
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# the block-table row stride (its width) varies per step: not specialised, or it compiles while serving
# (nor the index tensors' alignment: they may be views of a packed per-step buffer)
@triton.jit(do_not_specialize=["stride_tb", "window"],
            do_not_specialize_on_alignment=["block_tables", "cu_seqlens_q", "seq_lens", "tiles", "key_limits"])
def _paged_prefill_kernel(q_ptr, k_cache, v_cache, out_ptr, block_tables, cu_seqlens_q, seq_lens, tiles,
                          k_scale_ptr, v_scale_ptr, key_limits, k_sz_ptr, v_sz_ptr,
                          stride_qn, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                          stride_on, stride_oh, stride_tb, stride_zb, stride_zs, stride_zh, qk_scale, window,
                          BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                          QUERY_TILE: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                          FP8: tl.constexpr, SOFTWARE: tl.constexpr, SLIDING: tl.constexpr, LIMITS: tl.constexpr,
                          QUANT: tl.constexpr):
    # tiles[pid] = (sequence, first query of the tile within its chunk); rows of the M tile are
    # (query, head of this KV head's group) pairs, query-major: row r = query r // GROUP, head r % GROUP
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tiles + 2 * pid)
    q0 = tl.load(tiles + 2 * pid + 1)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    if q0 >= q_len:  # a dense tile list (no host lengths) past this chunk's end
        return
    seq_len = tl.load(seq_lens + seq)
    context_len = seq_len - q_len  # keys before the chunk

    offs_r = tl.arange(0, BLOCK_M)
    offs_m = q0 + offs_r // GROUP  # [BLOCK_M] query index within the chunk
    heads = kv_head * GROUP + offs_r % GROUP  # [BLOCK_M] query head of each row
    offs_d = tl.arange(0, BLOCK_D)
    # rows past QUERY_TILE * GROUP pad BLOCK_M to a power of two (a group of 7 fills 56 of 64)
    mask_m = (offs_r < QUERY_TILE * GROUP) & (offs_m < q_len)
    mask_d = offs_d < HEAD_DIM
    # 64-bit scalar bases, 32-bit offsets within the chunk: 64-bit index vectors cost registers (spills)
    q_base = q_ptr + q_start.to(tl.int64) * stride_qn
    q = tl.load(q_base + offs_m[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    first_pos = context_len + q0
    last_pos = context_len + tl.minimum(q0 + QUERY_TILE, q_len) - 1
    # padding rows take the first query's position, so every row sees key 0 and its max stays finite
    q_pos = tl.where(mask_m, context_len + offs_m, first_pos)  # [BLOCK_M]
    q_hi = q_pos  # the last key each row sees
    hi = last_pos + 1
    if LIMITS:  # a bidirectional span's rows see up to their span's last key in the chunk
        limit = tl.load(key_limits + q_start + offs_m, mask=mask_m, other=0)  # [BLOCK_M] positions
        q_hi = tl.maximum(q_pos, limit)
        hi = tl.max(q_hi, 0) + 1
    q_lo = q_pos  # the keys each row sees start after q_lo (SLIDING only)
    first_key = 0  # the first key any row sees
    if SLIDING:
        q_lo = q_pos - window
        first_key = tl.maximum(first_pos - window + 1, 0)

    k_base = k_cache + kv_head * stride_kh
    v_base = v_cache + kv_head * stride_vh
    k_sz_base = k_sz_ptr + kv_head * stride_zh
    v_sz_base = v_sz_ptr + kv_head * stride_zh
    q_sum = tl.zeros([BLOCK_M], tl.float32)  # read only with QUANT: each row's sum of q
    if QUANT:
        q_sum = tl.sum(q.to(tl.float32), 1)  # [BLOCK_M]
    table_row = block_tables + seq.to(tl.int64) * stride_tb
    if FP8:  # scores of the stored K / k_scale: scale them back with the softmax scale
        qk_scale = qk_scale * tl.load(k_scale_ptr)
        if SOFTWARE:  # e4m3 read from its bits holds the value / 256
            qk_scale = qk_scale * 256.0

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # whole tiles every query of this tile may see: no mask; before them (a window's first tiles, which
    # some rows see only in part) and after them (the diagonal) masked
    unmasked_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    unmasked_start = 0
    if SLIDING:  # the last query's window starts at last_pos - window + 1
        unmasked_start = tl.minimum(((tl.maximum(last_pos - window + 1, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N,
                                    unmasked_end)
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_base, v_base, table_row, q_hi, q_lo, offs_d, mask_d,
                                      stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                                      k_sz_base, v_sz_base, stride_zb, stride_zs, q_sum,
                                      (first_key // BLOCK_N) * BLOCK_N, unmasked_start, first_key, BLOCK_SIZE, True,
                                      BLOCK_N, INPUT_PRECISION, SOFTWARE, SLIDING, QUANT, HEAD_DIM)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_base, v_base, table_row, q_hi, q_lo, offs_d, mask_d,
                                  stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                                  k_sz_base, v_sz_base, stride_zb, stride_zs, q_sum,
                                  unmasked_start, unmasked_end, first_key, BLOCK_SIZE, False, BLOCK_N,
                                  INPUT_PRECISION, SOFTWARE, SLIDING, QUANT, HEAD_DIM)
    # the diagonal: tiles up to the last key a row sees, masked key_pos <= q_hi (and > q_lo)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_base, v_base, table_row, q_hi, q_lo, offs_d, mask_d,
                                  stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                                  k_sz_base, v_sz_base, stride_zb, stride_zs, q_sum,
                                  unmasked_end, hi, first_key, BLOCK_SIZE, True, BLOCK_N, INPUT_PRECISION,
                                  SOFTWARE, SLIDING, QUANT, HEAD_DIM)

    acc = acc / l_i[:, None]
    if FP8:  # a sum of the stored V / v_scale
        acc = acc * tl.load(v_scale_ptr)
        if SOFTWARE:
            acc = acc * 256.0
    out_base = out_ptr + q_start.to(tl.int64) * stride_on
    tl.store(out_base + offs_m[:, None] * stride_on + heads[:, None] * stride_oh + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def query_tile(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> int:
    """Queries per program, each with all `group` heads of one KV head: the M tile holds
    next_power_of_2(query_tile * group) rows (CUDA: a group of 8 fills a 128-row tile, of 7 112 of
    128, of 1 16 rows). One value per device and dtype, so a backend fixes it before it knows a
    layer's head count, and a model compiles one prefill variant. fp32 (exact dots on the FMA units,
    a parity path) and the interpreter: 4 queries (test-sized chunks span several tiles)."""
    # the CPU is the interpreter; any other device ("meta" included: the ahead-of-time compile check)
    # gets the GPU tile, as in flash_launch_config
    if torch.device(device).type == "cpu" or dtype == torch.float32:
        return 4
    return 16


def prefill_tiles(query_lens: list[int], query_tile_len: int, device,
                  seqs: list[int] | None = None) -> torch.Tensor:  # [T, 2] int32
    """The (sequence, first query) pairs of the real tiles of a step, from host lengths (no sync):
    cdiv(q_len, query_tile_len) per sequence, none for empty ones. `seqs` restricts it to those rows
    (e.g. a mixed step's prefill rows; indices into the step's tables)."""
    rows = np.arange(len(query_lens)) if seqs is None else np.asarray(seqs, dtype=np.int64)  # [R]
    lens = np.asarray(query_lens, dtype=np.int64)[rows] if len(rows) else np.zeros(0, np.int64)  # [R]
    per_row = -(-lens // query_tile_len)  # [R] tiles of each row
    first = np.cumsum(per_row) - per_row  # [R] index of each row's first tile
    seq = np.repeat(rows, per_row)  # [T]
    start = (np.arange(seq.shape[0]) - np.repeat(first, per_row)) * query_tile_len  # [T]
    flat = torch.from_numpy(np.stack([seq, start], axis=1).astype(np.int32))  # [T, 2]
    return flat.to(device, non_blocking=True)


def dense_tiles(batch: int, max_query_len: int, query_tile_len: int, device) -> torch.Tensor:  # [T, 2] int32
    """Every (sequence, tile) pair up to max_query_len, built on the device (no host lengths, graph-safe):
    tiles past a chunk's end exit at once."""
    per_seq = triton.cdiv(max_query_len, query_tile_len)
    seq = torch.arange(batch, dtype=torch.int32, device=device).repeat_interleave(per_seq)  # [B * per_seq]
    start = torch.arange(per_seq, dtype=torch.int32, device=device).repeat(batch) * query_tile_len
    return torch.stack([seq, start], dim=1)  # [T, 2]


def _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, k_sz=None, v_sz=None) -> int:
    """The cache's int bits (0: float or FP8); ValueError on malformed inputs."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(f"expected q [N, H, D] and caches [num_blocks, block_size, Hkv, D], got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    bits = kv_int_bits.check_pair(k_cache, v_cache, k_sz, v_sz, q.shape[2])
    if bits and k_sz.stride() != v_sz.stride():
        raise ValueError(f"k_sz and v_sz must share strides, got {k_sz.stride()} and {v_sz.stride()}")
    width = kv_int.code_dim(q.shape[2], bits) if bits else q.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != width:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not match head_dim "
                         f"{q.shape[2]}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k_cache.shape[2]}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported dtype {q.dtype}")
    if k_cache.dtype != v_cache.dtype or (not bits and k_cache.dtype not in (torch.float32, torch.float16,
                                                                             torch.bfloat16, kv_quant.KV_FP8)):
        raise ValueError(f"unsupported cache dtypes {k_cache.dtype}, {v_cache.dtype}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous last dim")
    if block_tables.dim() != 2 or cu_seqlens_q.dim() != 1 or seq_lens.dim() != 1:
        raise ValueError("expected block_tables [B, max_blocks], cu_seqlens_q [B+1], seq_lens [B]")
    batch = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1 or block_tables.shape[0] < batch:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} / block_tables {tuple(block_tables.shape)} "
                         f"do not match batch {batch}")
    for name, t in (("block_tables", block_tables), ("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim")
    return bits


def _check_variants(q: torch.Tensor, window: int | None, key_limits: torch.Tensor | None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive number of keys or None, got {window!r}")
    if key_limits is not None and (key_limits.shape != (q.shape[0],) or key_limits.dtype != torch.int32
                                   or key_limits.device != q.device or key_limits.stride(0) != 1):
        raise ValueError(f"key_limits must be contiguous int32 [N={q.shape[0]}] on {q.device}, got "
                         f"{tuple(key_limits.shape)} {key_limits.dtype} on {key_limits.device}")


def paged_prefill_attention(q: torch.Tensor,  # [N, H, D] packed query chunks (strided view ok)
                            k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
                            v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
                            block_tables: torch.Tensor,  # [B, max_blocks] int32
                            cu_seqlens_q: torch.Tensor,  # [B + 1] int32
                            seq_lens: torch.Tensor,  # [B] int32, keys after this step incl. the chunk
                            max_query_len: int,
                            scale: float,
                            out: torch.Tensor | None = None,  # [N, H, D]
                            tiles: torch.Tensor | None = None,  # [T, 2] int32 (prefill_tiles), or None
                            query_tile_len: int | None = None,  # the tiles' step (query_tile); with `tiles`
                            k_scale: torch.Tensor | None = None,  # [] float32: an FP8 cache's scales
                            v_scale: torch.Tensor | None = None,
                            fp8_hardware: bool | None = None,  # e4m3 converted in hardware; None: by device
                            window: int | None = None,  # a sliding-window layer's: keys p - window < k <= p
                            key_limits: torch.Tensor | None = None,  # [N] int32: the last key each query sees
                            k_sz: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv, 2]: an int cache's
                            v_sz: torch.Tensor | None = None,
                            ) -> torch.Tensor:  # [N, H, D]
    """`tiles` (from `prefill_tiles` with `query_tile_len` queries each) launches only the real tiles;
    without, every (sequence, tile) pair up to max_query_len is launched (`dense_tiles`). `window`: see the
    module docstring; `key_limits`: each query row's last visible key (a position in its sequence, at least
    the row's own, within its chunk), e.g. the end of the image span it belongs to."""
    bits = _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, k_sz, v_sz)
    _check_variants(q, window, key_limits)
    fp8 = not bits and kv_quant.check_scales(k_cache, k_scale, v_scale)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    batch, num_heads, head_dim = seq_lens.shape[0], q.shape[1], q.shape[2]
    if batch == 0 or max_query_len <= 0 or q.shape[0] == 0:
        return out
    if (tiles is None) != (query_tile_len is None):
        raise ValueError("tiles and query_tile_len go together")
    if tiles is None:
        query_tile_len = query_tile(q.device, q.dtype)
        tiles = dense_tiles(batch, max_query_len, query_tile_len, q.device)
    if tiles.dim() != 2 or tiles.shape[1] != 2 or tiles.dtype != torch.int32 or not tiles.is_contiguous():
        raise ValueError(f"tiles must be contiguous int32 [T, 2], got {tuple(tiles.shape)} {tiles.dtype}")
    if tiles.shape[0] == 0:
        return out
    group = num_heads // k_cache.shape[2]
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = max(16, triton.next_power_of_2(query_tile_len * group))
    _, block_n, num_warps, num_stages = flash_launch_config(q, block_m, block_d)
    if bits and q.device.type != "cpu":  # the codes' tiles beside the score tile: half the keys, or it spills
        block_n = max(16, block_n // 2)
    grid = (tiles.shape[0], k_cache.shape[2])
    k_cache, software = fp8_bits.kernel_cache(k_cache, fp8_hardware)
    v_cache, _ = fp8_bits.kernel_cache(v_cache, fp8_hardware)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens, tiles,
        k_scale if fp8 else k_cache, v_scale if fp8 else k_cache,  # read only with FP8
        seq_lens if key_limits is None else key_limits,  # read only with LIMITS
        k_sz if bits else k_cache, v_sz if bits else k_cache,  # read only with QUANT
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        block_tables.stride(0), *(k_sz.stride()[:3] if bits else (0, 0, 0)), scale * _LOG2E, 0 if window is None else int(window), BLOCK_SIZE=k_cache.shape[1],
        GROUP=group, HEAD_DIM=head_dim, QUERY_TILE=query_tile_len, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8=fp8, SOFTWARE=software,
        SLIDING=window is not None, LIMITS=key_limits is not None, QUANT=bits, num_warps=num_warps, num_stages=num_stages)
    return out


def paged_prefill_attention_ref(q: torch.Tensor,  # [N, H, D]
                                k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
                                v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
                                block_tables: torch.Tensor,  # [B, max_blocks]
                                cu_seqlens_q: torch.Tensor,  # [B + 1]
                                seq_lens: torch.Tensor,  # [B]
                                max_query_len: int,
                                scale: float,
                                out: torch.Tensor | None = None,  # [N, H, D]
                                k_scale: torch.Tensor | None = None,
                                v_scale: torch.Tensor | None = None,
                                window: int | None = None,
                                key_limits: torch.Tensor | None = None,
                                k_sz: torch.Tensor | None = None,
                                v_sz: torch.Tensor | None = None,
                                ) -> torch.Tensor:  # [N, H, D]
    """Torch reference: per sequence, gather its keys through the block table (an FP8 or int cache dequantized)
    and attend in fp32. Reads the lengths on the host (not for CUDA-graph capture). Table entries of
    blocks no query sees (before the window) may be anything, -1 included."""
    bits = _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, k_sz, v_sz)
    _check_variants(q, window, key_limits)
    if not bits:
        kv_quant.check_scales(k_cache, k_scale, v_scale)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_start, q_len = starts[b], starts[b + 1] - starts[b]
        if q_len == 0:
            continue
        pages = block_tables[b, :(seq_len + block_size - 1) // block_size].long().clamp(min=0)  # -1: masked below
        k = k_cache[pages].reshape(-1, num_kv_heads, k_cache.shape[3])[:seq_len]  # [seq_len, Hkv, D or D/2]
        v = v_cache[pages].reshape(-1, num_kv_heads, v_cache.shape[3])[:seq_len]
        ksz = None if k_sz is None else k_sz[pages].reshape(-1, num_kv_heads, 2)[:seq_len]  # [seq_len, Hkv, 2]
        vsz = None if v_sz is None else v_sz[pages].reshape(-1, num_kv_heads, 2)[:seq_len]
        k = read_rows(k, k_scale, ksz, bits, torch.float32).transpose(0, 1)  # [Hkv, seq_len, D]
        v = read_rows(v, v_scale, vsz, bits, torch.float32).transpose(0, 1)
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [H, seq_len, D]
        qi = q[q_start:q_start + q_len].float().transpose(0, 1)  # [H, q_len, D]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        q_hi = q_pos if key_limits is None else torch.maximum(q_pos, key_limits[q_start:q_start + q_len].long())
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        mask = key_pos <= q_hi[:, None]  # [q_len, seq_len]
        if window is not None:
            mask &= key_pos > q_pos[:, None] - window
        seen = mask.any(0)  # keys no query sees: zeroed, a freed block's garbage (or NaN) must not leak
        k, v = torch.where(seen[None, :, None], k, 0.0), torch.where(seen[None, :, None], v, 0.0)
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale)  # [H, q_len, D]
        out[q_start:q_start + q_len] = o.transpose(0, 1).to(out.dtype)
    return out
