"""The chunked gated delta rule for prefill (any number of new tokens per request, packed), as Triton
ops: each request continues from its slot's float32 state and leaves its final state there. Semantics,
the chunked form and the reference: kernels/gated_delta_rule_torch.py (`chunk_gated_delta_rule`, here
`chunk_gated_delta_rule_ref`). The kernels follow flash-linear-attention's split of the work (written
here from the equations, one file):

    chunk table  (torch, on the device: no host read) chunk c of the step -> its request and first token;
                 a request's chunks are consecutive ids from chunk_offsets[b], each CHUNK = 64 of its tokens
    1. prep      grid (chunks, Hv): within the chunk, G = cumsum(g); L = strictly-lower(beta_i exp(G_i -
                 G_j) k_i . k_j); (I + L)^-1 by forward substitution (64 row steps in registers, float32);
                 U = (I + L)^-1 beta V, W = (I + L)^-1 beta exp(G) K  -> workspaces
    2. state     grid (batch, Hv, Dv / BLOCK_V): the one sequential pass, over a request's chunks:
                 S_c saved for step 3; V' = U - W S_c -> workspace; S_{c+1} = exp(G_last) S_c +
                 (exp(G_last - G) K)^T V'; S in float32 registers, from and back to the slot
    3. output    grid (chunks, Hv, Dv / BLOCK_V): O = exp(G) Q S_c + tril(exp(G_i - G_j) q_i . k_j) V'

q and k are L2-normalised (float32) where they are loaded, q scaled by Dk^-0.5. The workspaces (W, U,
V', the per-chunk states) are in the inputs' dtype and every product's operands are cast to it (L's too,
and the inverse before it multiplies), as flash-linear-attention does: tensor cores, float32
accumulation; G, the substitution and the carried state are float32. (float32 operands in "ieee"
precision spilled ~48 KB per program in step 1 on sm_90.)
Step 1's grid and the workspaces are sized from host ints (T // 64 + batch chunks at most); a chunk id
past the step's chunks exits at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlm_sdk.kernels.gated_delta_rule_recurrent import _check_strides
from vlm_sdk.kernels.gated_delta_rule_torch import CHUNK, check_rule
from vlm_sdk.kernels.gated_delta_rule_torch import chunk_gated_delta_rule as chunk_gated_delta_rule_ref

__all__ = ["chunk_gated_delta_rule", "chunk_gated_delta_rule_ref", "chunk_table"]
BLOCK_V = 32
_STEP = ["qsl_ptr", "slots_ptr", "init_ptr"]  # views into a step's packed buffers, at any offset


@triton.jit
def _l2norm_rows(x):  # [BT, BK] float32: transformers' l2norm (eps 1e-6)
    return x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.jit(do_not_specialize_on_alignment=["qsl_ptr"])
def _gdr_chunk_prep_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, gcum_ptr, w_ptr, u_ptr, chunk_seq_ptr, chunk_tok_ptr,
                           qsl_ptr, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, stride_wt,
                           stride_wh, stride_ut, stride_uh, head_k_dim, head_v_dim,
                           GROUP: tl.constexpr, BT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr):
    cid = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(chunk_seq_ptr + cid)
    if seq < 0:
        return
    tok0 = tl.load(chunk_tok_ptr + cid).to(tl.int64)
    end = tl.load(qsl_ptr + seq + 1).to(tl.int64)
    t = tok0 + tl.arange(0, BT)
    tmask = t < end
    kk, dd = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_DV)
    k = tl.load(k_ptr + t[:, None] * stride_kt + (h // GROUP) * stride_kh + kk[None, :],
                mask=tmask[:, None] & (kk < head_k_dim)[None, :], other=0.0).to(tl.float32)
    k = _l2norm_rows(k)  # [BT, BK]
    beta = tl.load(beta_ptr + t * stride_bt + h, mask=tmask, other=0.0).to(tl.float32)
    gc = tl.cumsum(tl.load(g_ptr + t * stride_gt + h, mask=tmask, other=0.0).to(tl.float32), axis=0)  # [BT]
    tl.store(gcum_ptr + t * stride_gt + h, gc, mask=tmask)
    rows, cols = tl.arange(0, BT)[:, None], tl.arange(0, BT)[None, :]
    decay = tl.exp(tl.where(rows > cols, gc[:, None] - gc[None, :], float("-inf")))  # masked before exp
    dtype = w_ptr.dtype.element_ty  # the products' operands (flash-linear-attention's choice: tensor cores)
    a = tl.dot((k * beta[:, None]).to(dtype), tl.trans(k.to(dtype))) * decay  # [BT, BT] L, strictly lower
    # X = (I + L)^-1 by forward substitution: X[i] = e_i - sum_{j<i} L[i, j] X[j]; rows >= i are still
    # the identity's, and L[i, j] = 0 there
    x = tl.where(rows == cols, 1.0, 0.0)
    for i in range(1, BT):
        a_i = tl.sum(tl.where(rows == i, a, 0.0), axis=0)  # [BT] row i of L
        row = tl.where(tl.arange(0, BT) == i, 1.0, 0.0) - tl.sum(a_i[:, None] * x, axis=0)  # [BT]
        x = tl.where(rows == i, row[None, :], x)
    v = tl.load(v_ptr + t[:, None] * stride_vt + h * stride_vh + dd[None, :],
                mask=tmask[:, None] & (dd < head_v_dim)[None, :], other=0.0).to(tl.float32)
    x = x.to(dtype)
    u = tl.dot(x, (v * beta[:, None]).to(dtype))  # [BT, BDV]
    w = tl.dot(x, (k * (beta * tl.exp(gc))[:, None]).to(dtype))  # [BT, BK]
    tl.store(u_ptr + t[:, None] * stride_ut + h * stride_uh + dd[None, :], u.to(u_ptr.dtype.element_ty),
             mask=tmask[:, None] & (dd < head_v_dim)[None, :])
    tl.store(w_ptr + t[:, None] * stride_wt + h * stride_wh + kk[None, :], w.to(w_ptr.dtype.element_ty),
             mask=tmask[:, None] & (kk < head_k_dim)[None, :])


@triton.jit(do_not_specialize_on_alignment=_STEP + ["offsets_ptr"])
def _gdr_chunk_state_kernel(k_ptr, gcum_ptr, w_ptr, u_ptr, vnew_ptr, hbuf_ptr, state_ptr, qsl_ptr, offsets_ptr,
                            slots_ptr, init_ptr, stride_kt, stride_kh, stride_gt, stride_wt, stride_wh, stride_ut,
                            stride_uh, stride_hc, stride_hh, stride_hk, stride_ss, stride_sh, stride_sk,
                            head_k_dim, head_v_dim,
                            GROUP: tl.constexpr, BT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask, vmask = kk < head_k_dim, vv < head_v_dim
    smask = kmask[:, None] & vmask[None, :]
    dtype = w_ptr.dtype.element_ty
    start = tl.load(qsl_ptr + b).to(tl.int64)
    end = tl.load(qsl_ptr + b + 1).to(tl.int64)
    first = tl.load(offsets_ptr + b)
    num_chunks = tl.load(offsets_ptr + b + 1) - first
    slot = tl.load(slots_ptr + b).to(tl.int64)
    has_init = tl.load(init_ptr + b).to(tl.int32) > 0
    sptrs = state_ptr + slot * stride_ss + h * stride_sh + kk[:, None] * stride_sk + vv[None, :]
    s = tl.where(has_init, tl.load(sptrs, mask=smask, other=0.0), 0.0)  # [BK, BV] float32
    for c in range(0, num_chunks):
        hptrs = hbuf_ptr + (first + c).to(tl.int64) * stride_hc + h * stride_hh + kk[:, None] * stride_hk + vv[None, :]
        tl.store(hptrs, s.to(dtype), mask=smask)  # the state at the chunk's start, for the output pass
        t = start + c * BT + tl.arange(0, BT)
        tmask = t < end
        w = tl.load(w_ptr + t[:, None] * stride_wt + h * stride_wh + kk[None, :],
                    mask=tmask[:, None] & kmask[None, :], other=0.0)
        u = tl.load(u_ptr + t[:, None] * stride_ut + h * stride_uh + vv[None, :],
                    mask=tmask[:, None] & vmask[None, :], other=0.0).to(tl.float32)
        v_new = u - tl.dot(w, s.to(dtype))  # [BT, BV]
        tl.store(vnew_ptr + t[:, None] * stride_ut + h * stride_uh + vv[None, :], v_new.to(dtype),
                 mask=tmask[:, None] & vmask[None, :])
        gc = tl.load(gcum_ptr + t * stride_gt + h, mask=tmask, other=0.0)
        last = tl.minimum(start + c * BT + BT, end) - 1
        g_last = tl.load(gcum_ptr + last * stride_gt + h)
        k = tl.load(k_ptr + t[:, None] * stride_kt + (h // GROUP) * stride_kh + kk[None, :],
                    mask=tmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        k = _l2norm_rows(k) * tl.where(tmask, tl.exp(g_last - gc), 0.0)[:, None]  # decayed to the chunk's end
        s = s * tl.exp(g_last) + tl.dot(tl.trans(k.to(dtype)), v_new.to(dtype))
    tl.store(sptrs, s, mask=smask)


@triton.jit(do_not_specialize_on_alignment=["qsl_ptr"])
def _gdr_chunk_output_kernel(q_ptr, k_ptr, gcum_ptr, vnew_ptr, hbuf_ptr, out_ptr, chunk_seq_ptr, chunk_tok_ptr,
                             qsl_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, stride_ut, stride_uh,
                             stride_hc, stride_hh, stride_hk, stride_ot, stride_oh, head_k_dim, head_v_dim, scale,
                             GROUP: tl.constexpr, BT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    cid = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(chunk_seq_ptr + cid)
    if seq < 0:
        return
    tok0 = tl.load(chunk_tok_ptr + cid).to(tl.int64)
    end = tl.load(qsl_ptr + seq + 1).to(tl.int64)
    t = tok0 + tl.arange(0, BT)
    tmask = t < end
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask, vmask = kk < head_k_dim, vv < head_v_dim
    dtype = vnew_ptr.dtype.element_ty
    qk_mask = tmask[:, None] & kmask[None, :]
    hk = h // GROUP
    q = tl.load(q_ptr + t[:, None] * stride_qt + hk * stride_qh + kk[None, :], mask=qk_mask, other=0.0)
    k = tl.load(k_ptr + t[:, None] * stride_kt + hk * stride_kh + kk[None, :], mask=qk_mask, other=0.0)
    q = _l2norm_rows(q.to(tl.float32)) * scale
    k = _l2norm_rows(k.to(tl.float32))
    gc = tl.load(gcum_ptr + t * stride_gt + h, mask=tmask, other=0.0)
    s = tl.load(hbuf_ptr + cid.to(tl.int64) * stride_hc + h * stride_hh + kk[:, None] * stride_hk + vv[None, :],
                mask=kmask[:, None] & vmask[None, :], other=0.0)
    o = tl.dot((q * tl.exp(gc)[:, None]).to(dtype), s)  # [BT, BV] the state's read
    rows, cols = tl.arange(0, BT)[:, None], tl.arange(0, BT)[None, :]
    attn = tl.dot(q.to(dtype), tl.trans(k.to(dtype))) * tl.exp(tl.where(rows >= cols, gc[:, None] - gc[None, :],
                                                                         float("-inf")))
    v_new = tl.load(vnew_ptr + t[:, None] * stride_ut + h * stride_uh + vv[None, :],
                    mask=tmask[:, None] & vmask[None, :], other=0.0)
    o += tl.dot(attn.to(dtype), v_new)
    tl.store(out_ptr + t[:, None] * stride_ot + h * stride_oh + vv[None, :], o.to(out_ptr.dtype.element_ty),
             mask=tmask[:, None] & vmask[None, :])


def chunk_table(query_start_loc: torch.Tensor, num_tokens: int, max_query_len: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(request of each chunk id, -1 past the step's chunks; its first token; the requests' first chunk
    ids [batch + 1]), on the device without a host read, for at most num_tokens // CHUNK + batch chunks."""
    batch = query_start_loc.shape[0] - 1
    qsl = query_start_loc.to(torch.int64)
    counts = (qsl[1:] - qsl[:-1] + CHUNK - 1) // CHUNK  # [batch]
    offsets = torch.zeros(batch + 1, dtype=torch.int64, device=qsl.device)
    offsets[1:] = counts.cumsum(0)
    bound = min(num_tokens // CHUNK + batch, batch * triton.cdiv(max_query_len, CHUNK))
    ids = torch.arange(bound, device=qsl.device)
    seq = torch.searchsorted(offsets[1:], ids, right=True)  # [bound]; batch past the last chunk
    live = seq < batch
    seq = seq.clamp(max=batch - 1)
    tok = qsl[seq] + (ids - offsets[seq]) * CHUNK
    return torch.where(live, seq, -1).to(torch.int32), tok.to(torch.int32), offsets.to(torch.int32)


def chunk_gated_delta_rule(q: torch.Tensor,  # [T, Hk, Dk]
                           k: torch.Tensor,  # [T, Hk, Dk]
                           v: torch.Tensor,  # [T, Hv, Dv]
                           g: torch.Tensor,  # [T, Hv] float32
                           beta: torch.Tensor,  # [T, Hv]
                           state: torch.Tensor,  # [slots, Hv, Dk, Dv] float32, updated in place
                           query_start_loc: torch.Tensor,  # [batch + 1] int32
                           max_query_len: int,  # the step's longest request (a host int)
                           state_slots: torch.Tensor,  # [batch] int64
                           has_initial_state: torch.Tensor,  # [batch] bool
                           ) -> torch.Tensor:  # [T, Hv, Dv] v.dtype
    check_rule(q, k, v, g, beta, state)
    _check_strides(q, k, v, g, beta, state)
    if g.dtype != torch.float32:
        raise ValueError(f"the gated delta rule's g must be float32 (a log decay), got {g.dtype}")
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    batch = state_slots.shape[0]
    out = torch.empty((t, hv, dv), dtype=v.dtype, device=v.device)
    if t == 0 or batch == 0:
        return out
    chunk_seq, chunk_tok, offsets = chunk_table(query_start_loc, t, max_query_len)
    num_chunks = chunk_seq.shape[0]
    work = v.dtype
    gcum = torch.empty((t, hv), dtype=torch.float32, device=v.device)
    w = torch.empty((t, hv, dk), dtype=work, device=v.device)
    u = torch.empty((t, hv, dv), dtype=work, device=v.device)
    v_new = torch.empty_like(u)
    hbuf = torch.empty((num_chunks, hv, dk, dv), dtype=work, device=v.device)
    block_k = max(16, triton.next_power_of_2(dk))
    group = hv // hk
    _gdr_chunk_prep_kernel[(num_chunks, hv)](
        k, v, g, beta, gcum, w, u, chunk_seq, chunk_tok, query_start_loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0), w.stride(0), w.stride(1),
        u.stride(0), u.stride(1), dk, dv,
        GROUP=group, BT=CHUNK, BLOCK_K=block_k, BLOCK_DV=max(16, triton.next_power_of_2(dv)), num_warps=8)
    _gdr_chunk_state_kernel[(batch, hv, triton.cdiv(dv, BLOCK_V))](
        k, gcum, w, u, v_new, hbuf, state, query_start_loc, offsets, state_slots, has_initial_state,
        k.stride(0), k.stride(1), gcum.stride(0), w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        hbuf.stride(0), hbuf.stride(1), hbuf.stride(2), state.stride(0), state.stride(1), state.stride(2), dk, dv,
        GROUP=group, BT=CHUNK, BLOCK_K=block_k, BLOCK_V=BLOCK_V, num_warps=4)
    _gdr_chunk_output_kernel[(num_chunks, hv, triton.cdiv(dv, BLOCK_V))](
        q, k, gcum, v_new, hbuf, out, chunk_seq, chunk_tok, query_start_loc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), gcum.stride(0), u.stride(0), u.stride(1),
        hbuf.stride(0), hbuf.stride(1), hbuf.stride(2), out.stride(0), out.stride(1), dk, dv, dk ** -0.5,
        GROUP=group, BT=CHUNK, BLOCK_K=block_k, BLOCK_V=BLOCK_V, num_warps=4)
    return out
