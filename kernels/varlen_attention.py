"""Non-causal attention within packed variable-length segments (the vision tower's windows and full blocks).

q, k, v are [N, H, D] (strided views of one packed qkv tensor are fine); segment s is the rows
cu_seqlens[s]..cu_seqlens[s+1], and each of its tokens attends to every token of the same segment and no other.
k and v may have fewer heads than q (GQA, H a multiple of Hkv); the vision towers use Hkv == H.

Kernel shape (FlashAttention-2 forward): grid (S, H, cdiv(max_seqlen, BLOCK_M)); a program owns BLOCK_M queries
of one segment and one head and streams the segment's keys in BLOCK_N tiles with an fp32 online softmax, so the
[L, L] score matrix of a long segment is never materialised. Only the segment's last, partial key tile needs a
bounds mask, so the loop is split: whole tiles load unmasked, the tail tile is masked. Programs past their
segment exit at once: a batch of many short windows plus one long full-attention segment costs only empty
programs for the short ones. max_seqlen is a host int; lengths are read in the kernel (no host synchronisation).

Head dims that are not a power of two are not padded to the next one: the head is split into a power-of-two
part (BLOCK_D) and a narrow power-of-two tail (BLOCK_D2, >= 16 for tl.dot) computed by a second dot into the
same scores and a second accumulator (`head_split`). The vision towers' head_dim 80 (Qwen2.5-VL's ViT) is
64 + 16: per key tile QK^T and PV cost 2 * BLOCK_M * BLOCK_N * 80 multiply-adds, where one 128-wide block
spent 2 * BLOCK_M * BLOCK_N * 128 (1.6x the work, 37.5% of it on zero columns), and the fp32 accumulator is
80 columns instead of 128 (sm_90 registers 128 -> 110 at the 128-row tile, tests/kernels/aot_compile.py).
Power-of-two heads (64, 128) keep one block and no tail.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vlm_sdk.kernels.flash_config import flash_launch_config

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tiles(acc, acc2, l_i, m_i, q, q2,  # fp32 acc [BLOCK_M, BLOCK_D] and acc2 [BLOCK_M, BLOCK_D2], l/m [BLOCK_M]
                  k_base, v_base, offs_d, mask_d, offs_d2, mask_d2, stride_kn, stride_vn, qk_scale, lo, hi,
                  BOUNDED: tl.constexpr, BLOCK_N: tl.constexpr, HAS_TAIL: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr):
    """Online-softmax update over key tiles [lo, hi) of the segment; k_base/v_base point at its first key.
    Head columns offs_d, and with HAS_TAIL the tail columns offs_d2 (q2, acc2): a second narrow dot."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        key = start_n + offs_n  # [BLOCK_N]
        if BOUNDED:
            in_seg = (key < hi)[:, None]
            kv_mask = in_seg & mask_d[None, :]
        else:
            kv_mask = mask_d[None, :]
        k = tl.load(k_base + key[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_base + key[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=INPUT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if HAS_TAIL:
            if BOUNDED:
                tail_mask = in_seg & mask_d2[None, :]
            else:
                tail_mask = mask_d2[None, :]
            k2 = tl.load(k_base + key[:, None] * stride_kn + offs_d2[None, :], mask=tail_mask, other=0.0)
            v2 = tl.load(v_base + key[:, None] * stride_vn + offs_d2[None, :], mask=tail_mask, other=0.0)
            qk = tl.dot(q2, tl.trans(k2.to(q2.dtype)), qk, input_precision=INPUT_PRECISION)  # += tail scores
        qk = qk * qk_scale
        if BOUNDED:
            qk = tl.where((key < hi)[None, :], qk, float("-inf"))
        # a segment has >= 1 key and the first tile visited holds it, so m_new is finite
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        if HAS_TAIL:
            acc2 = acc2 * alpha[:, None] + tl.dot(p.to(v2.dtype), v2, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, acc2, l_i, m_i


# cu_seqlens may be a view of a packed buffer: not specialised on its alignment (no compile while serving)
@triton.jit(do_not_specialize_on_alignment=["cu_seqlens"])
def _varlen_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_seqlens,
                             stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                             stride_on, stride_oh, qk_scale,
                             GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
                             HAS_TAIL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    segment = tl.program_id(0)
    head = tl.program_id(1)
    tile_m = tl.program_id(2)
    start = tl.load(cu_seqlens + segment)
    seg_len = tl.load(cu_seqlens + segment + 1) - start
    if tile_m * BLOCK_M >= seg_len:
        return

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the segment
    offs_d = tl.arange(0, BLOCK_D)
    offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)  # the tail columns (unused without HAS_TAIL)
    mask_m = offs_m < seg_len
    mask_d = offs_d < HEAD_DIM
    mask_d2 = offs_d2 < HEAD_DIM
    # 64-bit scalar bases, 32-bit offsets within the segment: 64-bit index vectors cost registers (spills)
    start = start.to(tl.int64)
    q_rows = q_ptr + start * stride_qn + head * stride_qh + offs_m[:, None] * stride_qn
    q = tl.load(q_rows + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if HAS_TAIL:
        q2 = tl.load(q_rows + offs_d2[None, :], mask=mask_m[:, None] & mask_d2[None, :], other=0.0)  # [BLOCK_M, BLOCK_D2]
    else:
        q2 = q  # unused
    kv_head = head // GROUP
    k_base = k_ptr + start * stride_kn + kv_head * stride_kh
    v_base = v_ptr + start * stride_vn + kv_head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_D2], tl.float32)  # without HAS_TAIL: never updated, dropped by the compiler
    full_end = (seg_len // BLOCK_N) * BLOCK_N
    acc, acc2, l_i, m_i = _attend_tiles(acc, acc2, l_i, m_i, q, q2, k_base, v_base, offs_d, mask_d, offs_d2, mask_d2,
                                        stride_kn, stride_vn, qk_scale, 0, full_end, False, BLOCK_N, HAS_TAIL,
                                        INPUT_PRECISION)
    acc, acc2, l_i, m_i = _attend_tiles(acc, acc2, l_i, m_i, q, q2, k_base, v_base, offs_d, mask_d, offs_d2, mask_d2,
                                        stride_kn, stride_vn, qk_scale, full_end, seg_len, True, BLOCK_N, HAS_TAIL,
                                        INPUT_PRECISION)

    out_rows = out_ptr + start * stride_on + head * stride_oh + offs_m[:, None] * stride_on
    tl.store(out_rows + offs_d[None, :], (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_d[None, :])
    if HAS_TAIL:
        tl.store(out_rows + offs_d2[None, :], (acc2 / l_i[:, None]).to(out_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & mask_d2[None, :])


def head_split(head_dim: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_D2): a power-of-two head part and a power-of-two tail (0: none) that cover
    head_dim with the least padding, each at least 16 wide (tl.dot's minimum). 80 -> (64, 16): no
    padding, where one 128-wide block would waste 37.5% of the dot math; 128 -> (128, 0)."""
    whole = max(16, triton.next_power_of_2(head_dim))
    if whole == head_dim or head_dim <= 16:
        return whole, 0
    lo = whole // 2
    tail = max(16, triton.next_power_of_2(head_dim - lo))
    return (lo, tail) if lo + tail < whole else (whole, 0)


def _check_inputs(q, k, v, cu_seqlens, out):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"expected q, k, v [N, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k.shape[1]}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported dtype {q.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v need a contiguous last dim")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be [S + 1] int32/int64, got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim")


def varlen_attention(q: torch.Tensor,  # [N, H, D] (strided view ok)
                     k: torch.Tensor,  # [N, Hkv, D]
                     v: torch.Tensor,  # [N, Hkv, D]
                     cu_seqlens: torch.Tensor,  # [S + 1] int32
                     max_seqlen: int,
                     scale: float,
                     out: torch.Tensor | None = None,  # [N, H, D]
                     ) -> torch.Tensor:  # [N, H, D]
    _check_inputs(q, k, v, cu_seqlens, out)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_segments, num_heads, head_dim = cu_seqlens.shape[0] - 1, q.shape[1], q.shape[2]
    if num_segments == 0 or max_seqlen <= 0 or q.shape[0] == 0:
        return out
    block_d, block_d2 = head_split(head_dim)
    block_m, block_n, num_warps, num_stages = flash_launch_config(q, max_seqlen, block_d + block_d2)
    grid = (num_segments, num_heads, triton.cdiv(max_seqlen, block_m))
    _varlen_attention_kernel[grid](
        q, k, v, out, cu_seqlens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), scale * _LOG2E,
        GROUP=num_heads // k.shape[1], HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        BLOCK_D2=max(block_d2, 16), HAS_TAIL=block_d2 > 0, INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages)
    return out


def varlen_attention_ref(q: torch.Tensor,  # [N, H, D]
                         k: torch.Tensor,  # [N, Hkv, D]
                         v: torch.Tensor,  # [N, Hkv, D]
                         cu_seqlens: torch.Tensor,  # [S + 1]
                         max_seqlen: int,
                         scale: float,
                         out: torch.Tensor | None = None,  # [N, H, D]
                         ) -> torch.Tensor:  # [N, H, D]
    """Torch reference: one SDPA per segment in fp32. Reads cu_seqlens on the host."""
    _check_inputs(q, k, v, cu_seqlens, out)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    group = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qs = q[start:end].float().transpose(0, 1)  # [H, L, D]
        ks = k[start:end].float().transpose(0, 1).repeat_interleave(group, 0)  # [H, L, D]
        vs = v[start:end].float().transpose(0, 1).repeat_interleave(group, 0)
        out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(0, 1).to(out.dtype)
    return out
