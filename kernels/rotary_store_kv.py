"""Rotary embedding and the KV-cache store in one launch: what `rotary.rotary_embedding` then
`store_kv.store_kv` do, a decoder layer's two launches between the qkv matmul and attention.

    q:            [num_tokens, num_heads, head_dim]      strided views of one packed
    k, v:         [num_tokens, num_kv_heads, head_dim]   [N, H + 2Hkv, D] qkv; last dim contiguous
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]   contiguous
    slot_mapping: [num_tokens] int64 / int32; a negative slot (CUDA-graph padding) writes no cache row
    positions, inv_freq, mrope_section, q/k norm weights: as `rotary.rotary_embedding`

Effect, exactly that of the two kernels: q and k rotated in place (after Qwen3's per-head RMSNorm when
the weights are given), then the rotated k and v written into their cache slots (cast to the cache
dtype; an FP8 cache gets the e4m3 bits of k / k_scale and v / v_scale through a uint8 view, as store_kv
writes them: kernels/fp8_bits.py). One program per token: it computes the token's cos/sin once (`rotary._token_cos_sin`), rotates
the q heads, rotates the k heads and writes each rotated head both back and into its cache row (the
value it just stored, so nothing is read twice), and copies the v heads to theirs. Per layer of a decode
step this is one launch instead of two (36 fewer per step for a 36-layer model), and k is read once.

The unfused pair stays for what this does not cover: a caller that must store K/V apart from rotating
(the piecewise CUDA graphs rotate inside a captured piece and store in the eager attention between).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlm_sdk.kernels import kv_quant, rotary, store_kv
from vlm_sdk.kernels.rotary import _rotate_heads, _token_cos_sin
from vlm_sdk.kernels.store_kv import _to_cache


# as _rotary_kernel: the positions' row stride and the positions' / slots' alignment are not specialised
@triton.jit(do_not_specialize=["stride_pos_row"], do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _rotary_store_kv_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, pos_ptr, inv_freq_ptr,
                            q_norm_ptr, k_norm_ptr, eps, k_scale_ptr, v_scale_ptr,
                            stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                            stride_pos_row, stride_pos_n,
                            num_heads, num_kv_heads, half_dim,
                            SECTION_ENDS: tl.constexpr, INTERLEAVED_ENDS: tl.constexpr, HAS_NORM: tl.constexpr,
                            BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                            BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    # the heads that go to the cache: all, or none for a padding row (a head count, not a bool: the
    # interpreter cannot AND a loaded scalar into a mask)
    cached_heads = tl.where(slot >= 0, num_kv_heads, 0)
    # cache row `slot` is contiguous [num_kv_heads, head_dim]; padding rows point at row 0, never written
    row = tl.where(slot >= 0, slot, 0) * num_kv_heads * (2 * half_dim)
    cos, sin = _token_cos_sin(pos_ptr, inv_freq_ptr, token, stride_pos_row, stride_pos_n, half_dim,
                              SECTION_ENDS, INTERLEAVED_ENDS, BLOCK_HALF)
    _rotate_heads(q_ptr + token * stride_qn, stride_qh, num_heads, half_dim, cos, sin, q_norm_ptr, eps,
                  q_ptr, 0, 0, k_scale_ptr, HAS_NORM, False, False, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + token * stride_kn, stride_kh, num_kv_heads, half_dim, cos, sin, k_norm_ptr, eps,
                  k_cache_ptr + row, 2 * half_dim, cached_heads, k_scale_ptr, HAS_NORM, True, FP8, BLOCK_HK,
                  BLOCK_HALF)
    offs_h = tl.arange(0, BLOCK_V)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < cached_heads) & (offs_d[None, :] < 2 * half_dim)  # [BLOCK_V, BLOCK_D]
    v = tl.load(v_ptr + token * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(v_cache_ptr + row + offs_h[:, None] * (2 * half_dim) + offs_d[None, :],
             _to_cache(v, v_scale_ptr, v_cache_ptr, FP8), mask=mask)


def rotary_store_kv(q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
                    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
                    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
                    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
                    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
                    slot_mapping: torch.Tensor,  # [num_tokens]
                    positions: torch.Tensor,  # [num_tokens] or [3, num_tokens]
                    inv_freq: torch.Tensor,  # [head_dim // 2] float32
                    mrope_section: tuple[int, ...] | None = None,
                    mrope_interleaved: bool = False,
                    q_norm_weight: torch.Tensor | None = None,  # [head_dim]
                    k_norm_weight: torch.Tensor | None = None,  # [head_dim]
                    norm_eps: float = 1e-6,
                    k_scale: torch.Tensor | None = None,  # [] float32: an FP8 cache's scales (else unused)
                    v_scale: torch.Tensor | None = None) -> None:
    """`rotary.rotary_embedding(q, k, ...)` then `store_kv.store_kv(k, v, k_cache, v_cache, slot_mapping,
    k_scale, v_scale)`, in one launch."""
    rotary._check(q, k, positions, inv_freq, mrope_section, mrope_interleaved, q_norm_weight, k_norm_weight)
    store_kv._check(k, v, k_cache, v_cache, slot_mapping)
    fp8 = kv_quant.check_scales(k_cache, k_scale, v_scale)
    n, h, d = q.shape
    hkv = k.shape[1]
    if n == 0:
        return
    has_norm = q_norm_weight is not None
    p = rotary.launch_params(q, k, positions, mrope_section, mrope_interleaved, has_norm)
    if fp8:  # written as bytes (kernels/fp8_bits.py)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    else:  # the scales are read only with FP8
        k_scale = v_scale = inv_freq
    _rotary_store_kv_kernel[(n,)](
        q, k, v, k_cache, v_cache, slot_mapping, positions, inv_freq,
        q_norm_weight if has_norm else inv_freq, k_norm_weight if has_norm else inv_freq, norm_eps, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        p.stride_pos_row, p.stride_pos_n, h, hkv, d // 2, **p.constexprs,
        BLOCK_V=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d), FP8=fp8, num_warps=4)


def rotary_store_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        positions: torch.Tensor, inv_freq: torch.Tensor,
                        mrope_section: tuple[int, ...] | None = None, mrope_interleaved: bool = False,
                        q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                        norm_eps: float = 1e-6, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> None:
    """Torch reference of `rotary_store_kv` (same arguments and effect): the two references in turn."""
    rotary.rotary_embedding_ref(q, k, positions, inv_freq, mrope_section, mrope_interleaved, q_norm_weight,
                                k_norm_weight, norm_eps)
    store_kv.store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
