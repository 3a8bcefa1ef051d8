"""Causal depthwise conv1d over packed requests with per-request states in slots, as Triton ops: the
prefill form (any number of new tokens per request) and the decode form (one token per request). The
semantics, shapes and references are kernels/causal_conv1d_torch.py's (`causal_conv1d_varlen_ref`,
`causal_conv1d_update_ref` here).

    varlen:  grid (batch, token blocks of the longest request, channel blocks). A program's tokens read
             the K - 1 inputs before each of them from x, or from the request's slot before its first
             new token (zeros without an initial state). Then a second launch, grid (batch, channel
             blocks), writes each slot's new K - 1 columns (the request's last inputs, old columns first
             when it had fewer new tokens): after every read of the old state, which a program of the
             first launch may still be doing when another writes, hence two launches (stream-ordered).
             Column j is written from old column len + j > j, so the ascending writes of one program
             never overwrite a column it has yet to read.
    update:  grid (batch, channel blocks): the window is the slot's K - 1 columns and the token; the slot
             shifts by one, in place (column j loaded before it is overwritten by column j + 1).

Taps in float32, SiLU in float32, one rounding to x's dtype. No host reads of device data: the launches
can be captured in a CUDA graph (decode) and their grids depend on host ints only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlm_sdk.kernels.causal_conv1d_torch import ACTIVATIONS, check_conv
from vlm_sdk.kernels.causal_conv1d_torch import causal_conv1d_update as causal_conv1d_update_ref
from vlm_sdk.kernels.causal_conv1d_torch import causal_conv1d_varlen as causal_conv1d_varlen_ref

__all__ = ["causal_conv1d_varlen", "causal_conv1d_update", "causal_conv1d_varlen_ref", "causal_conv1d_update_ref"]
BLOCK_T, BLOCK_C = 16, 64
_STEP_TENSORS = ["qsl_ptr", "slots_ptr", "init_ptr"]  # views into a step's packed buffers, at any offset


@triton.jit
def _silu(y, ACTIVATION: tl.constexpr):
    if ACTIVATION:
        y = y / (1.0 + tl.exp(-y))
    return y


@triton.jit(do_not_specialize_on_alignment=_STEP_TENSORS)
def _conv_varlen_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, qsl_ptr, slots_ptr, init_ptr,
                        stride_x, stride_out, stride_w, stride_ss, stride_sc, num_channels,
                        K: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    start = tl.load(qsl_ptr + b).to(tl.int64)
    length = tl.load(qsl_ptr + b + 1).to(tl.int64) - start
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] the request's token index
    if tl.program_id(1) * BLOCK_T >= length:
        return
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    cmask = c < num_channels
    tmask = t < length
    slot = tl.load(slots_ptr + b).to(tl.int64)
    has_init = tl.load(init_ptr + b).to(tl.int32) > 0
    state = state_ptr + slot * stride_ss + c[None, :] * stride_sc  # [1, BLOCK_C] this slot's columns
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(K):
        src = t - (K - 1) + j  # [BLOCK_T] the input this tap reads; < 0: from the state
        in_x = (tmask & (src >= 0))[:, None] & cmask[None, :]
        in_state = (tmask & (src < 0))[:, None] & cmask[None, :]
        xv = tl.load(x_ptr + (start + src)[:, None] * stride_x + c[None, :], mask=in_x, other=0.0).to(tl.float32)
        sv = tl.load(state + (K - 1 + src)[:, None], mask=in_state, other=0.0).to(tl.float32)
        sv = tl.where(has_init, sv, 0.0)  # a reused slot's values never leak in (not even a NaN)
        w = tl.load(w_ptr + c * stride_w + j, mask=cmask, other=0.0).to(tl.float32)
        acc += (xv + sv) * w[None, :]
    acc = _silu(acc, ACTIVATION)
    omask = tmask[:, None] & cmask[None, :]
    tl.store(out_ptr + (start + t)[:, None] * stride_out + c[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit(do_not_specialize_on_alignment=_STEP_TENSORS)
def _conv_state_kernel(x_ptr, state_ptr, qsl_ptr, slots_ptr, init_ptr, stride_x, stride_ss, stride_sc, num_channels,
                       K: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    start = tl.load(qsl_ptr + b).to(tl.int64)
    length = tl.load(qsl_ptr + b + 1).to(tl.int64) - start
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < num_channels
    slot = tl.load(slots_ptr + b).to(tl.int64)
    has_init = tl.load(init_ptr + b).to(tl.int32) > 0
    state = state_ptr + slot * stride_ss + c * stride_sc
    for j in tl.static_range(K - 1):
        # the request's input that becomes column j; < 0: old column K - 1 + src (one value per channel:
        # a vector, so that the masks are vectors, as the interpreter wants)
        src = tl.zeros([BLOCK_C], dtype=tl.int64) + (length - (K - 1) + j)
        xv = tl.load(x_ptr + (start + src) * stride_x + c, mask=cmask & (src >= 0), other=0.0)
        sv = tl.load(state + (K - 1 + src), mask=cmask & (src < 0), other=0.0)
        sv = tl.where(has_init, sv, tl.zeros_like(sv))
        tl.store(state + j, tl.where(src >= 0, xv.to(state_ptr.dtype.element_ty), sv), mask=cmask)


@triton.jit(do_not_specialize_on_alignment=["slots_ptr", "init_ptr"])
def _conv_update_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, slots_ptr, init_ptr,
                        stride_x, stride_out, stride_w, stride_ss, stride_sc, num_channels,
                        K: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < num_channels
    slot = tl.load(slots_ptr + b).to(tl.int64)
    has_init = tl.load(init_ptr + b).to(tl.int32) > 0
    state = state_ptr + slot * stride_ss + c * stride_sc
    x = tl.load(x_ptr + b * stride_x + c, mask=cmask, other=0.0)
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=cmask, other=0.0).to(tl.float32)
    # the taps in the varlen kernel's order (oldest first), so a decode row gives its result bit for bit
    col = tl.where(has_init, tl.load(state, mask=cmask, other=0.0).to(tl.float32), 0.0)
    acc += col * tl.load(w_ptr + c * stride_w, mask=cmask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, K - 1):
        col = tl.load(state + j, mask=cmask, other=0.0)
        col = tl.where(has_init, col, tl.zeros_like(col))  # zeros shift in without an initial state
        acc += col.to(tl.float32) * tl.load(w_ptr + c * stride_w + j, mask=cmask, other=0.0).to(tl.float32)
        tl.store(state + (j - 1), col, mask=cmask)  # shift left by one
    acc += x.to(tl.float32) * tl.load(w_ptr + c * stride_w + (K - 1), mask=cmask, other=0.0).to(tl.float32)
    tl.store(state + (K - 2), x.to(state_ptr.dtype.element_ty), mask=cmask)
    acc = _silu(acc, ACTIVATION)
    tl.store(out_ptr + b * stride_out + c, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def _check(x, weight, bias, conv_state, activation) -> None:
    check_conv(x, weight, conv_state)
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal conv1d activation {activation!r} is not one of {ACTIVATIONS}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError("causal conv1d needs x with a contiguous last dim")
    if conv_state.dtype != x.dtype or weight.stride(1) != 1 or conv_state.stride(2) != 1:
        raise ValueError(f"causal conv1d needs the state in x's dtype ({x.dtype}, got {conv_state.dtype}) and "
                         f"contiguous weight and state columns")
    if bias is not None and bias.shape != (x.shape[1],):
        raise ValueError(f"causal conv1d bias must be [{x.shape[1]}], got {list(bias.shape)}")


def causal_conv1d_varlen(x: torch.Tensor,  # [T, C]
                         weight: torch.Tensor,  # [C, K]
                         bias: torch.Tensor | None,  # [C]
                         conv_state: torch.Tensor,  # [slots, C, K - 1], updated in place
                         query_start_loc: torch.Tensor,  # [batch + 1] int32
                         state_slots: torch.Tensor,  # [batch] int64
                         has_initial_state: torch.Tensor,  # [batch] bool
                         activation: str | None = "silu",
                         max_query_len: int | None = None) -> torch.Tensor:  # [T, C] x.dtype
    """The conv over every request's new tokens; `max_query_len` (the step's, a host int) sizes the grid,
    default T."""
    _check(x, weight, bias, conv_state, activation)
    t, c = x.shape
    out = torch.empty((t, c), dtype=x.dtype, device=x.device)
    batch = state_slots.shape[0]
    if t == 0 or batch == 0:
        return out
    k = weight.shape[1]
    longest = t if max_query_len is None else max_query_len
    common = dict(K=k)
    _conv_varlen_kernel[(batch, triton.cdiv(longest, BLOCK_T), triton.cdiv(c, BLOCK_C))](
        x, weight, bias if bias is not None else weight, conv_state, out, query_start_loc, state_slots,
        has_initial_state, x.stride(0), out.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1),
        c, HAS_BIAS=bias is not None, ACTIVATION=activation == "silu", BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C,
        num_warps=4, **common)
    _conv_state_kernel[(batch, triton.cdiv(c, BLOCK_C))](
        x, conv_state, query_start_loc, state_slots, has_initial_state, x.stride(0), conv_state.stride(0),
        conv_state.stride(1), c, BLOCK_C=BLOCK_C, num_warps=4, **common)
    return out


def causal_conv1d_update(x: torch.Tensor,  # [batch, C]
                         weight: torch.Tensor,  # [C, K]
                         bias: torch.Tensor | None,  # [C]
                         conv_state: torch.Tensor,  # [slots, C, K - 1], updated in place
                         state_slots: torch.Tensor,  # [batch] int64
                         has_initial_state: torch.Tensor,  # [batch] bool
                         activation: str | None = "silu") -> torch.Tensor:  # [batch, C] x.dtype
    _check(x, weight, bias, conv_state, activation)
    batch, c = x.shape
    out = torch.empty((batch, c), dtype=x.dtype, device=x.device)
    if batch:
        _conv_update_kernel[(batch, triton.cdiv(c, BLOCK_C))](
            x, weight, bias if bias is not None else weight, conv_state, out, state_slots, has_initial_state,
            x.stride(0), out.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1), c,
            K=weight.shape[1], HAS_BIAS=bias is not None, ACTIVATION=activation == "silu", BLOCK_C=BLOCK_C,
            num_warps=4)
    return out
