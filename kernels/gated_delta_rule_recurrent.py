"""The gated delta rule for a decode step (one new token per request), as a Triton op, with each
request's float32 state read from and written back to its slot in place. Semantics, shapes and the
reference: kernels/gated_delta_rule_torch.py (`recurrent_gated_delta_rule`, imported here as
`recurrent_gated_delta_rule_ref`).

Grid (batch, Hv, Dv / BLOCK_V): a program holds its head's state columns [Dk, BLOCK_V] in registers,
decays them, reads k's memory (S^T k), writes the delta's correction and reads q, all in float32 (q and k
L2-normalised first, as transformers' `use_qk_l2norm_in_kernel`). No host reads of device data: the launch
can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlm_sdk.kernels.gated_delta_rule_torch import check_rule
from vlm_sdk.kernels.gated_delta_rule_torch import recurrent_gated_delta_rule as recurrent_gated_delta_rule_ref

__all__ = ["recurrent_gated_delta_rule", "recurrent_gated_delta_rule_ref"]
BLOCK_V = 32


@triton.jit(do_not_specialize_on_alignment=["slots_ptr", "init_ptr"])
def _gdr_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, slots_ptr, init_ptr,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                          stride_ot, stride_oh, stride_ss, stride_sh, stride_sk, head_k_dim, head_v_dim, scale,
                          GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    hk = h // GROUP  # the key head this value head reads
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask, vmask = kk < head_k_dim, vv < head_v_dim
    q = tl.load(q_ptr + b * stride_qt + hk * stride_qh + kk, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * stride_kt + hk * stride_kh + kk, mask=kmask, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    v = tl.load(v_ptr + b * stride_vt + h * stride_vh + vv, mask=vmask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * stride_gt + h).to(tl.float32)
    beta = tl.load(beta_ptr + b * stride_bt + h).to(tl.float32)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    has_init = tl.load(init_ptr + b).to(tl.int32) > 0
    ptrs = state_ptr + slot * stride_ss + h * stride_sh + kk[:, None] * stride_sk + vv[None, :]  # [BLOCK_K, BLOCK_V]
    smask = kmask[:, None] & vmask[None, :]
    s = tl.load(ptrs, mask=smask, other=0.0)
    s = tl.where(has_init, s, 0.0) * tl.exp(g)  # a reused slot's values never leak in
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta  # [BLOCK_V]
    s += k[:, None] * delta[None, :]
    tl.store(ptrs, s, mask=smask)
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + vv, o.to(out_ptr.dtype.element_ty), mask=vmask)


def _check_strides(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"the gated delta rule needs a contiguous last dim, got strides {t.stride()}")


def recurrent_gated_delta_rule(q: torch.Tensor,  # [batch, Hk, Dk]
                               k: torch.Tensor,  # [batch, Hk, Dk]
                               v: torch.Tensor,  # [batch, Hv, Dv]
                               g: torch.Tensor,  # [batch, Hv] float32
                               beta: torch.Tensor,  # [batch, Hv]
                               state: torch.Tensor,  # [slots, Hv, Dk, Dv] float32, updated in place
                               state_slots: torch.Tensor,  # [batch] int64
                               has_initial_state: torch.Tensor,  # [batch] bool
                               ) -> torch.Tensor:  # [batch, Hv, Dv] v.dtype
    check_rule(q, k, v, g, beta, state)
    _check_strides(q, k, v, g, beta, state)
    batch, hk, dk = q.shape
    hv, dv = v.shape[1:]
    out = torch.empty((batch, hv, dv), dtype=v.dtype, device=v.device)
    if batch:
        _gdr_recurrent_kernel[(batch, hv, triton.cdiv(dv, BLOCK_V))](
            q, k, v, g, beta, state, out, state_slots, has_initial_state,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
            out.stride(0), out.stride(1), state.stride(0), state.stride(1), state.stride(2), dk, dv, dk ** -0.5,
            GROUP=hv // hk, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=BLOCK_V, num_warps=4)
    return out
