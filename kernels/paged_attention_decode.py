"""Decode attention over a paged KV cache: one query token per sequence ("flash decoding").

out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b, where K_b / V_b are the first seq_lens[b] keys of
sequence b, key p living in cache block block_tables[b, p // block_size] at offset p % block_size
(caches [num_blocks, block_size, num_kv_heads, head_dim]). Query head h reads KV head h // group
(GQA, group = H / Hkv). A row with seq_len 0 (CUDA-graph padding) gets zeros. A sliding-window layer
(`window` W) reads only the keys seq_len - W .. seq_len - 1 (HF's convention: the query at p sees keys
p - W < k <= p); the splits cut that span, and no block-table entry before it is read (the engine may
have let those blocks go: -1).

Why the kernel is shaped this way. Decode is bound by reading the KV cache, so:
- One program per (sequence, KV head, split) handles ALL `group` query heads of its KV head: each K/V
  tile is read once for the whole group, and the group (padded to >= 16 rows) makes the scores a real
  tl.dot ([G, D] x [D, BLOCK_N]) instead of a per-head reduction.
- A batch of a few sequences x few KV heads is far fewer programs than SMs, so the context is cut
  into `num_splits` pieces ("flash decoding"; the rule is `choose_num_splits`'). The split length is
  computed IN the kernel from each sequence's own length (cdiv(seq_len, num_splits) rounded up to
  SPLIT_ALIGN keys), so one host-side num_splits (fixed at CUDA-graph capture) serves every length;
  splits left empty by a short sequence write lse = -inf and weigh nothing in the merge.
- Each split runs an fp32 online softmax over tiles of BLOCK_N keys, gathering every key's page from
  the block table (page = table[p // block_size]), so any block_size works and tiles may straddle
  pages. It writes a normalised partial output and its log-sum-exp (base 2); a second small kernel
  merges the splits. With num_splits == 1 the first kernel writes the output directly.
- An FP8 cache (`kv_quant.KV_FP8`: K / k_scale, V / v_scale) is read as is: e4m3 values convert exactly
  to q's dtype for the dots (in hardware on sm_89+, else from their bits: kernels/fp8_bits.py), k_scale
  joins the softmax scale and v_scale the output (one scalar load each), which is the product of the
  dequantized K and V without a multiply per element.
- An int8 / int4 cache (`k_sz` / `v_sz` beside uint8 code pages: kernels/kv_int.py) is dequantized per
  tile in registers, (code - zero) * scale with each key's own pair (kernels/kv_int_bits.py), into q's
  dtype for the same dots.
The launcher never reads device data on the host (it runs inside CUDA-graph capture).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from vlm_sdk.kernels import fp8_bits, kv_int, kv_int_bits, kv_quant
from vlm_sdk.kernels.paged_attention import read_rows

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOG2E = 1.4426950408889634
# Split lengths are multiples of this many keys (a cache block's worth at the default block size): a
# split may end mid-tile, its last tile masked. Short, so that a few sequences split into many parts.
SPLIT_ALIGN = 16
# resident decode programs per SM that keep enough K/V loads in flight to hide DRAM latency: a program
# (4 warps, ~100 registers a thread, 2 pipelined K/V tiles of 16 KiB in shared memory) leaves room
# for 3-4 on an H100 / A100 SM
PROGRAMS_PER_SM = 4
_MAX_SPLITS = 64
_MERGE_BLOCK_S = 64  # next_power_of_2(_MAX_SPLITS)


# per-step ints are not specialised (a value of 1 or a multiple of 16 would compile a new variant
# while serving): the split count, and the block-table row stride (its width grows with the longest sequence)
# (the index tensors, views of per-step buffers, are not specialised on their alignment either)
@triton.jit(do_not_specialize=["num_splits", "stride_bt", "window"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr"])
def _decode_split_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
        out_ptr, part_out_ptr, part_lse_ptr, k_scale_ptr, v_scale_ptr, k_sz_ptr, v_sz_ptr,
        scale_log2,  # softmax scale * log2(e): the kernel works in base 2 (exp2 is the fast path)
        num_splits,
        window,  # keys seq_len - window .. seq_len - 1 when SLIDING
        stride_qb, stride_qh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh,
        stride_bt, stride_sl,
        stride_ob, stride_oh,
        stride_zb, stride_zs, stride_zh,  # the (scale, zero) tensors' (QUANT), K's and V's alike
        BLOCK_SIZE: tl.constexpr,  # cache block: constexpr so p // BLOCK_SIZE is a shift for powers of 2
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        DIRECT: tl.constexpr, IEEE: tl.constexpr, SPLIT_ALIGN: tl.constexpr, FP8: tl.constexpr,
        SOFTWARE: tl.constexpr, SLIDING: tl.constexpr, QUANT: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(seq_lens_ptr + b * stride_sl).to(tl.int32)
    first = 0  # the first key read: a window's first key, else key 0
    if SLIDING:
        first = tl.maximum(seq_len - window, 0)
    span = seq_len - first
    # plain arithmetic, not tl.cdiv: a nested jit call costs ~4 ms per program in the interpreter
    split_len = ((span + num_splits - 1) // num_splits + SPLIT_ALIGN - 1) // SPLIT_ALIGN * SPLIT_ALIGN
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)  # start >= end: nothing to do, lse = -inf

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g  # [BLOCK_G] query heads of this KV head

    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    if FP8:  # scores of the stored K / k_scale: scale them back with the softmax scale
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
        if SOFTWARE:  # e4m3 read from its bits holds the value / 256
            scale_log2 = scale_log2 * 256.0
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + b * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n  # [BLOCK_N]
        mask_n = pos < end
        # int64: page * stride overflows int32 on big caches
        page = tl.load(table + pos // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        mask_kv = mask_n[:, None] & mask_d[None, :]
        if QUANT:
            sz_row = (page * stride_zb + slot * stride_zs) + kv_head * stride_zh  # [BLOCK_N]
            k = kv_int_bits.load_tile(k_base + page * stride_kb + slot * stride_ks, k_sz_ptr + sz_row, offs_d,
                                      mask_kv, mask_n, q.dtype, QUANT, HEAD_DIM)  # [BLOCK_N, BLOCK_D]
        else:
            k = fp8_bits.load_kv(k_base + (page * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :],
                                 mask_kv, q.dtype, SOFTWARE)  # [BLOCK_N, BLOCK_D]
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))  # [BLOCK_G, BLOCK_N] fp32
        qk = tl.where(mask_n[None, :], qk * scale_log2, float("-inf"))
        # every tile holds >= 1 key (n0 < end), so m_new is finite and no row gets NaN
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANT:
            v = kv_int_bits.load_tile(v_base + page * stride_vb + slot * stride_vs, v_sz_ptr + sz_row, offs_d,
                                      mask_kv, mask_n, q.dtype, QUANT, HEAD_DIM)  # [BLOCK_N, BLOCK_D]
        else:
            v = fp8_bits.load_kv(v_base + (page * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :],
                                 mask_kv, q.dtype, SOFTWARE)  # [BLOCK_N, BLOCK_D]
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]  # no keys: acc is 0, so zeros
    if FP8:  # a sum of the stored V / v_scale
        o = o * tl.load(v_scale_ptr)
        if SOFTWARE:
            o = o * 256.0
    mask_o = mask_g[:, None] & mask_d[None, :]
    if DIRECT:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask_o)
    else:
        row = (b * num_heads + heads) * num_splits + split  # [BLOCK_G] into [B, H, S]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask_o)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=mask_g)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
        part_out_ptr, part_lse_ptr, out_ptr, num_splits,
        stride_ob, stride_oh,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    row = (b * tl.num_programs(1) + h) * num_splits + offs_s  # [BLOCK_S]
    lse = tl.load(part_lse_ptr + row, mask=offs_s < num_splits, other=float("-inf"))
    valid = lse > float("-inf")
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)  # seq_len 0: every split empty, weights all 0
    w = tl.exp2(lse - m)  # [BLOCK_S], 0 for empty splits
    # empty splits' partials are never read: they need not be finite
    part = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                   mask=valid[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    denom = tl.sum(w, 0)
    o = tl.sum(part * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)  # [BLOCK_D]
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=mask_d)


def _block_n(head_dim: int) -> int:
    return 64 if head_dim <= 128 else 32


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device) -> int:
    """Context splits of a decode step (host ints only). On CUDA, by occupancy:

        splits = cdiv(PROGRAMS_PER_SM * SM count, batch * num_kv_heads)   enough programs to fill the GPU
                 at most cdiv(max_seq_len, SPLIT_ALIGN)                     a split has keys to read
                 at most _MAX_SPLITS                                        what one merge program holds

    so a few sequences get many splits and many sequences few. Qwen2.5-VL-3B (2 KV heads) on an H100
    (132 SMs), graphs captured at max_model_len 4096: one sequence of 2k keys gets 64 splits of 32 keys,
    128 programs (a minimum split of 256 keys gave it 16 splits of 128 keys, 32 programs: 9.8 us a
    layer for 2 MB of K/V on the first H100 run); 8 sequences 32 splits; 64 sequences 5 splits of ~410
    keys, 640 programs. With CUDA graphs `max_seq_len` is
    max_model_len and the count is fixed per captured batch size; the kernel sizes each sequence's
    splits from its own length. On the CPU a few (the interpreter pays per program)."""
    device = torch.device(device)
    max_seq_len = max(int(max_seq_len), 1)
    if device.type == "cuda":
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        splits = triton.cdiv(PROGRAMS_PER_SM * sm_count, max(batch * num_kv_heads, 1))
        splits = min(splits, triton.cdiv(max_seq_len, SPLIT_ALIGN), _MAX_SPLITS)
    else:
        splits = min(8, triton.cdiv(max_seq_len, 512))
    splits = max(splits, 1)
    # as many splits as the longest sequence's aligned pieces fill: 9 requested for 64 pieces would
    # leave the ninth empty (8 pieces each), so ask for 8
    pieces = triton.cdiv(max_seq_len, SPLIT_ALIGN)
    return triton.cdiv(pieces, triton.cdiv(pieces, splits))


def reach(max_seq_len: int, window: int | None) -> int:
    """The most keys one row reads: its length, or its window."""
    return max_seq_len if window is None else min(int(max_seq_len), int(window))


def _check_window(window: int | None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive number of keys or None, got {window!r}")


def _check(q, k_cache, v_cache, block_tables, seq_lens, out, k_sz=None, v_sz=None) -> int:
    """The cache's int bits (0: float or FP8); ValueError on malformed inputs."""
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be [B, H, D] and k_cache [num_blocks, block_size, Hkv, D], "
                         f"got {tuple(q.shape)} and {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} must match k_cache "
                         f"{tuple(k_cache.shape)} {k_cache.dtype}")
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    bits = kv_int_bits.check_pair(k_cache, v_cache, k_sz, v_sz, head_dim)
    if bits and k_sz.stride() != v_sz.stride():
        raise ValueError(f"k_sz and v_sz must share strides, got {k_sz.stride()} and {v_sz.stride()}")
    width = kv_int.code_dim(head_dim, bits) if bits else head_dim
    if k_cache.shape[3] != width or num_heads % num_kv_heads:
        raise ValueError(f"q heads {num_heads} x dim {head_dim} do not fit the cache's "
                         f"{num_kv_heads} KV heads x dim {k_cache.shape[3]}")
    if q.dtype not in _DTYPES or (not bits and k_cache.dtype not in _DTYPES + (kv_quant.KV_FP8,)):
        raise ValueError(f"unsupported dtypes q {q.dtype}, cache {k_cache.dtype}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last dim")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [B={batch}, max_blocks] with contiguous rows, "
                         f"got {tuple(block_tables.shape)}")
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be [B={batch}], got {tuple(seq_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1
                            or out.device != q.device):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device} with a contiguous "
                         f"last dim, got {tuple(out.shape)} {out.dtype}")
    return bits


def paged_attention_decode(q: torch.Tensor,  # [B, H, D], last dim contiguous
                           k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
                           v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
                           block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
                           seq_lens: torch.Tensor,  # [B] int32/int64
                           scale: float,
                           num_splits: int | None = None,
                           max_seq_len: int | None = None,
                           out: torch.Tensor | None = None,  # [B, H, D]
                           k_scale: torch.Tensor | None = None,  # [] float32: an FP8 cache's scales
                           v_scale: torch.Tensor | None = None,
                           fp8_hardware: bool | None = None,  # e4m3 converted in hardware; None: by device
                           window: int | None = None,  # a sliding-window layer's: the last `window` keys
                           k_sz: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv, 2]: an int cache's
                           v_sz: torch.Tensor | None = None,
                           ) -> torch.Tensor:  # [B, H, D]
    """`window` (HF's `sliding_window`): each row reads only its last `window` keys; None: all of them."""
    bits = _check(q, k_cache, v_cache, block_tables, seq_lens, out, k_sz, v_sz)
    _check_window(window)
    fp8 = not bits and kv_quant.check_scales(k_cache, k_scale, v_scale)
    k_cache, software = fp8_bits.kernel_cache(k_cache, fp8_hardware)
    v_cache, _ = fp8_bits.kernel_cache(v_cache, fp8_hardware)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(batch, num_kv_heads, reach(max_seq_len, window), q.device)
    if int(num_splits) < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    num_splits = int(num_splits)

    group = num_heads // num_kv_heads
    block_d = max(triton.next_power_of_2(head_dim), 16)
    block_n = _block_n(head_dim)
    direct = num_splits == 1
    if direct:
        part_out = part_lse = out  # unused
    else:
        part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32,
                               device=q.device)  # [B, H, S, D]
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32,
                               device=q.device)  # [B, H, S], base-2 log-sum-exp
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse,
        k_scale if fp8 else k_cache, v_scale if fp8 else k_cache,  # read only with FP8
        k_sz if bits else k_cache, v_sz if bits else k_cache,  # read only with QUANT
        float(scale) * _LOG2E, num_splits, 0 if window is None else int(window),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), seq_lens.stride(0),
        out.stride(0), out.stride(1),
        *(k_sz.stride()[:3] if bits else (0, 0, 0)),
        BLOCK_SIZE=block_size, GROUP=group, BLOCK_G=max(triton.next_power_of_2(group), 16),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
        DIRECT=direct, IEEE=q.dtype == torch.float32, SPLIT_ALIGN=SPLIT_ALIGN, FP8=fp8, SOFTWARE=software,
        SLIDING=window is not None, QUANT=bits,
        # 3 stages: the pipeliner prefetches the block-table entries two tiles ahead and K/V one
        # tile ahead (cp.async); with 2 the table gather stalls every iteration
        num_warps=4, num_stages=3)
    if not direct:
        _decode_merge_kernel[(batch, num_heads)](
            part_out, part_lse, out, num_splits, out.stride(0), out.stride(1),
            # one BLOCK_S for every split count up to _MAX_SPLITS: the count varies per step, and a
            # constexpr that follows it would compile a new merge kernel while serving
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(_MERGE_BLOCK_S, triton.next_power_of_2(num_splits)),
            num_warps=4)
    return out


def paged_attention_decode_ref(q: torch.Tensor,  # [B, H, D]
                               k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
                               v_cache: torch.Tensor,
                               block_tables: torch.Tensor,  # [B, max_blocks]
                               seq_lens: torch.Tensor,  # [B]
                               scale: float,
                               num_splits: int | None = None,  # unused: same signature as the kernel
                               max_seq_len: int | None = None,
                               out: torch.Tensor | None = None,
                               k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None,
                               window: int | None = None,
                               k_sz: torch.Tensor | None = None,
                               v_sz: torch.Tensor | None = None,
                               ) -> torch.Tensor:  # [B, H, D]
    """Batched torch reference with no host sync: gathers max_seq_len (or the whole table's) keys per
    sequence, masks those past seq_len (and, with a window, before its last `window`), softmax in fp32.
    Table entries of masked-out blocks may be anything, -1 included (they are clamped to block 0 and
    masked). An FP8 or int cache is dequantized first (`paged_attention.read_rows`)."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = block_tables.shape[1]
    if max_seq_len is not None:
        num_blocks = min(num_blocks, max(1, math.ceil(max_seq_len / block_size)))
    length = num_blocks * block_size
    key_pos = torch.arange(length, device=q.device)  # [L]
    keep = key_pos[None, :] < seq_lens[:, None].long()  # [B, L]
    if window is not None:
        keep &= key_pos[None, :] >= seq_lens[:, None].long() - window
    block_used = keep.view(batch, num_blocks, block_size).any(-1)  # [B, nb]
    blocks = torch.where(block_used, block_tables[:, :num_blocks].long(), 0)  # [B, nb]
    # slots past seq_len may hold anything (NaN in a fresh cache): zero them, or 0 * NaN leaks
    kept = keep[:, :, None, None]
    bits = kv_int.bits_of(k_cache, k_sz, head_dim)
    width = k_cache.shape[3]
    k_rows = None if k_sz is None else k_sz[blocks].view(batch, length, num_kv_heads, 2)
    v_rows = None if v_sz is None else v_sz[blocks].view(batch, length, num_kv_heads, 2)
    k = read_rows(k_cache[blocks].view(batch, length, num_kv_heads, width), k_scale, k_rows, bits, torch.float32)
    v = read_rows(v_cache[blocks].view(batch, length, num_kv_heads, width), v_scale, v_rows, bits, torch.float32)
    k, v = torch.where(kept, k, 0.0), torch.where(kept, v, 0.0)
    group = num_heads // num_kv_heads
    qg = q.float().reshape(batch, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale  # [B, Hkv, G, L]
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(keep.any(-1)[:, None, None, None], probs, 0.0)  # seq_len 0: NaN -> zeros
    o = torch.einsum("bhgl,blhd->bhgd", probs, v).reshape(batch, num_heads, head_dim)
    if out is None:
        return o.to(q.dtype)
    out.copy_(o)
    return out
